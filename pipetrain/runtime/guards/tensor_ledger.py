"""Tensor memory a worker really holds, counted by kind, with its peak (RSS blurs it).

A :class:`TensorLedger` keeps a live byte count of tensor *storages* (each counted once,
however many views, names or holders it has) attributed to one kind:

============== =============================================================================
kind           what
============== =============================================================================
weights        every weight version held (``WeightVersions``: live versions and the spare
               kept for recycling) and the version each unit in flight was run with
gradients      the gradient accumulators (``StageRuntime.gradient_buffers``: unfused ones, fused
               Linear sinks, flat all-reduce buffers)
optimizer      optimizer state (SGD momentum 1x, Adam 2x the parameters)
activations    per unit in flight: what autograd saved for its backward (counted with
               ``torch.autograd.graph.saved_tensors_hooks`` during the unit's F), the stage's
               outputs (kept as the roots of its backward), the stage input a unit that
               recomputes its forward keeps, and what a zero-bubble I kept for W (with
               recomputation: also what the recompute in I saved)
communication  receive buffers (comm's pool: free, posted, or held by a unit until its
               backward) and gradients waiting for their SEND_B
data           the minibatches the run's data object caches (synthetic data: prefetched)
============== =============================================================================

A storage held under several kinds counts once, under the first kind of the table (a weight
that ``Linear`` saves for its input gradient is a weight, not an activation; a receive
buffer that the first layer saves is communication). The invariant: ``live`` equals the sum
of ``nbytes`` over distinct storages some owner holds, and ``peak`` is its maximum over the
run (sampled whenever something is held, so after every action).

:class:`TensorMemory` is one of the executor's hooks (:mod:`pipetrain.runtime.engine.hooks`):
F runs under the saved-tensor hooks and holds the unit; the unit's backward end (B, or W
for zero-bubble) drops it; STEP, B and W refresh the stage's weights, gradients and
optimizer state; every action refreshes the communication buffers; every segment starts and
ends with a refresh of everything. What is *not*
counted: temporaries inside one action (a backward's intermediate gradients, an update's
scratch), sends in flight after their SEND action returned, the torch runtime and the
allocator's free lists (docs/performance.md, "Memory").
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from ...schedule.action import Action, Op
from ..engine.hooks import EngineHooks, EngineView

__all__ = ["KINDS", "TensorLedger", "TensorMemory", "storage_key"]

#: Kinds in attribution order: a storage held under several kinds counts as the first.
KINDS: tuple[str, ...] = ("weights", "gradients", "optimizer", "activations", "communication", "data")
_INDEX = {k: i for i, k in enumerate(KINDS)}

Key = tuple[int, int]  # (data pointer, bytes) of a storage


def storage_key(t: Tensor) -> Key | None:
    """(data pointer, bytes) of ``t``'s storage; None for an empty or meta tensor."""
    if t.device.type == "meta":
        return None
    st = t.untyped_storage()
    ptr = st.data_ptr()
    return (ptr, st.nbytes()) if ptr else None


def tensors_in(obj: Any) -> Iterable[Tensor]:
    """Every tensor in nested dicts, lists and tuples."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


class TensorLedger:
    """Live bytes of distinct storages by kind, with the peak (module docstring)."""

    def __init__(self) -> None:
        self._owners: dict[Hashable, tuple[list[Key], int]] = {}
        self._counts: dict[Key, list[int]] = {}    # key -> holders per kind
        self._kind: dict[Key, int] = {}            # key -> attributed kind
        self.live = 0
        self.peak = 0
        self.by_kind = [0] * len(KINDS)
        self.peak_by_kind = [0] * len(KINDS)       # the breakdown at the peak
        self.max_by_kind = [0] * len(KINDS)        # each kind's own maximum

    def hold(self, owner: Hashable, tensors: Iterable[Tensor], kind: str) -> None:
        """``owner`` now holds exactly ``tensors`` (replacing what it held) under ``kind``."""
        keys = [k for k in (storage_key(t) for t in tensors) if k is not None]
        self.hold_keys(owner, keys, kind)

    def hold_keys(self, owner: Hashable, keys: Iterable[Key], kind: str) -> None:
        """Like :meth:`hold`, with storage keys (as :func:`storage_key` gives them)."""
        self.drop(owner)
        ki = _INDEX[kind]
        mine = list(dict.fromkeys(keys))
        self._owners[owner] = (mine, ki)
        for key in mine:
            c = self._counts.get(key)
            if c is None:
                c = self._counts[key] = [0] * len(KINDS)
                c[ki] = 1
                self._kind[key] = ki
                self.live += key[1]
                self.by_kind[ki] += key[1]
                continue
            c[ki] += 1
            cur = self._kind[key]
            if ki < cur:
                self._kind[key] = ki
                self.by_kind[cur] -= key[1]
                self.by_kind[ki] += key[1]
        self._note()

    def drop(self, owner: Hashable) -> None:
        """``owner`` holds nothing any more."""
        held = self._owners.pop(owner, None)
        if held is None:
            return
        keys, ki = held
        for key in keys:
            c = self._counts[key]
            c[ki] -= 1
            cur = self._kind[key]
            if not any(c):
                del self._counts[key], self._kind[key]
                self.live -= key[1]
                self.by_kind[cur] -= key[1]
            elif ki == cur and c[ki] == 0:
                new = next(i for i, n in enumerate(c) if n)
                self._kind[key] = new
                self.by_kind[cur] -= key[1]
                self.by_kind[new] += key[1]

    def _note(self) -> None:
        for i, b in enumerate(self.by_kind):
            if b > self.max_by_kind[i]:
                self.max_by_kind[i] = b
        if self.live > self.peak:
            self.peak = self.live
            self.peak_by_kind = list(self.by_kind)

    def summary(self) -> dict[str, Any]:
        """``peak_bytes``, ``peak_by_kind`` (the breakdown at the peak), ``max_by_kind`` and ``live_bytes``."""
        return {"peak_bytes": self.peak, "peak_by_kind": dict(zip(KINDS, self.peak_by_kind)),
                "max_by_kind": dict(zip(KINDS, self.max_by_kind)), "live_bytes": self.live}


class TensorMemory(EngineHooks):
    """A ledger fed by the executor it hooks into (module docstring)."""

    def __init__(self) -> None:
        self.ledger = TensorLedger()
        self._data_state: tuple[int, int] | None = None
        self._saved: list[Key] = []    # what autograd saved during the running F

    # -- what the engine holds, read through its accessors ------------------------------
    def refresh_stage(self, ex: EngineView, k: int) -> None:
        """The weights, gradient accumulators and optimizer state of stage ``k``."""
        st = ex.stages[k]
        self.ledger.hold(("weights", k), st.versions.held_tensors(), "weights")
        self.ledger.hold(("gradients", k), st.gradient_buffers(), "gradients")
        self.ledger.hold(("optimizer", k), tensors_in(st.optimizer.state), "optimizer")

    def refresh_comm(self, ex: EngineView) -> None:
        """Receive buffers: free in the pool, posted, or received and not yet taken by a unit."""
        self.ledger.hold("comm", ex.comm.buffers() + ex.received(), "communication")

    def refresh_data(self, ex: EngineView) -> None:
        """The data object's cached minibatches (when it has a cache), on a change only."""
        data = ex.data
        cached = data.cached_batches() if hasattr(data, "cached_batches") else None
        state = (id(data), len(cached) if cached is not None else -1)
        if state == self._data_state:
            return
        self._data_state = state
        self.ledger.hold("data", tensors_in(cached) if cached is not None else (), "data")

    def refresh_all(self, ex: EngineView) -> None:
        """Everything ``ex`` holds now (call once when the executor is built, to count from there)."""
        for k in ex.stages:
            self.refresh_stage(ex, k)
        self.refresh_comm(ex)
        self.refresh_data(ex)

    # -- the hooks ------------------------------------------------------------------------
    def before_run(self, ex: EngineView) -> None:
        self.refresh_all(ex)

    def after_run(self, ex: EngineView) -> None:
        self.refresh_all(ex)

    def forward_scope(self, ex: EngineView, a: Action) -> AbstractContextManager[object]:
        """Every storage autograd saves during the forward is recorded for the unit."""
        saved: list[Key] = []
        self._saved = saved

        def pack(t: Tensor) -> Tensor:
            key = storage_key(t)
            if key is not None:
                saved.append(key)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)

    def after_action(self, ex: EngineView, a: Action) -> None:
        if a.op is Op.F:
            self._forward_done(ex, a)
        elif a.op in (Op.B, Op.W):  # the unit's last backward piece
            self._backward_done(ex, a)
        elif a.op is Op.I:
            self._input_done(ex, a)
        elif a.op in (Op.SEND_F, Op.SEND_B):
            self.ledger.drop(("out", a.stage, a.mb, 0 if a.op is Op.SEND_F else 1))
        elif a.op is Op.STEP:
            self.refresh_stage(ex, a.stage)
        self.refresh_comm(ex)

    def _forward_done(self, ex: EngineView, a: Action) -> None:
        """The unit holds its version, its receive buffers and its activations."""
        led, unit = self.ledger, (a.stage, a.mb)
        u = ex.unit(*unit)
        if u is not None:
            led.hold(("unit-weights", *unit), u.params.values(), "weights")
            led.hold(("unit-recv", *unit), u.recv_bufs, "communication")
            outs = [k for k in (storage_key(t) for t in [*u.outputs, *tensors_in(u.inputs)]) if k is not None]
            led.hold_keys(("unit-act", *unit), self._saved + outs, "activations")
        self._saved = []
        out = ex.outgoing(a.stage, a.mb, 0)
        if out is not None:
            led.hold(("out", a.stage, a.mb, 0), out, "activations")
        self.refresh_data(ex)

    def _backward_done(self, ex: EngineView, a: Action) -> None:
        """The unit's last backward piece ended: its activations, version and buffers go."""
        for part in ("unit-weights", "unit-recv", "unit-act", "unit-grad", "unit-kept"):
            self.ledger.drop((part, a.stage, a.mb))
        self._hold_out_grads(ex, a)
        self.refresh_stage(ex, a.stage)

    def _input_done(self, ex: EngineView, a: Action) -> None:
        """I kept what W needs and took the received output gradients."""
        u = ex.unit(a.stage, a.mb)
        if u is not None and u.weight_work is not None:
            self.ledger.hold(("unit-kept", a.stage, a.mb),
                             [*tensors_in(list(u.weight_work.kept.values())), *u.recomputed], "activations")
        if u is not None and u.grad_bufs:
            self.ledger.hold(("unit-grad", a.stage, a.mb), u.grad_bufs, "communication")
        self._hold_out_grads(ex, a)

    def _hold_out_grads(self, ex: EngineView, a: Action) -> None:
        out = ex.outgoing(a.stage, a.mb, 1)
        if out is not None:
            self.ledger.hold(("out", a.stage, a.mb, 1), out, "communication")

    def summary(self) -> dict[str, Any]:
        return self.ledger.summary()


def _unpack(t: Tensor) -> Tensor:
    return t
