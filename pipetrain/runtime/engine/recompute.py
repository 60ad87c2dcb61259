"""Recomputing a stage's forward in its backward: PipeDream without weight stashing, and ``--recompute``.

With weight stashing (PipeDream SOSP'19 section 3.3) a stage's backward of unit ``u`` uses
the version ``v_F`` its forward used. Without it (the schedule option ``stashing=False``)
the backward names the newest version ``v_B >= v_F`` of its stage when it runs. What that
backward computes is defined here, and implemented by the executor (B handler) and by the
reference replay (:func:`pipetrain.runtime.reference.replay_schedule`) alike:

    x_s          the stage's input for unit u, as its forward received it (stage 0: the
                 unit's inputs), i.e. computed by the upstream stages' forwards
    y_s^F        = f_s(x_s; W_s^(v_F))    what the forward sent on (and, last stage, the
                                          loss reported for the unit)
    g_s          the gradient of the loss w.r.t. y_s^F, as the downstream stage's
                 backward sends it back
    recompute    y_s^B = f_s(x_s; W_s^(v_B))    (same random stream as the forward: the
                                          unit's stream, graph/random_ops.py)
    backward     (dL/dx_s, dL/dW_s) = vjp of y_s^B at (x_s, W_s^(v_B)) applied to g_s

So the weight gradient uses the newest weights and activations recomputed from the stashed
stage input under them; the gradient sent upstream is the same vjp's input part. The last
stage recomputes its loss from the recomputed output. Only the stage input is stashed, never
a second weight copy (the forward's own graph is dropped after the forward: it is never
back-propagated).

Activation recomputation (``--recompute``, or a plan stage with ``"recompute": true``) is the
case ``v_B = v_F`` of the same rule, for every unit of the stage: its forward runs without
a graph (nothing saved for backward, only ``x_s`` and the random state kept), and the first
backward piece (B, or I under zero-bubble's split) recomputes ``y_s`` under the version the
backward names (the stashed one under weight stashing, the forward's under a flush) before
differentiating. The recomputed values are the forward's, bit for bit: same inputs, same
weights, same random stream; so the gradients are those without recomputation.

Buffers (batch-norm running statistics) are left as they were before the recompute, so each
unit updates them once, in its forward; the recompute reads them as they are when it runs.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor
from torch.func import functional_call

from ...schedule.action import Action, Op
from .stage_runtime import StageRuntime
from .unit_state import UnitState

__all__ = ["BufferGuard", "RngState", "recompute", "recompute_units", "rng_state"]

#: The CPU generator state and, on CUDA, the device's (``None`` on CPU).
RngState = tuple[Tensor, Tensor | None]


class BufferGuard:
    """The buffers of a module before a recompute, to put back the ones it changed.

    Only changed buffers are written back: a constant buffer (a causal mask) that the
    recompute's graph saved for its backward must keep its autograd version, or that
    backward fails; running statistics are not saved for backward, so restoring them is safe.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._saved = [(b, b.detach().clone()) for b in module.buffers()]

    @torch.no_grad()
    def restore_changed(self) -> None:
        for b, v in self._saved:
            if not torch.equal(b, v):
                b.copy_(v)


def recompute_units(actions: Sequence[Action], always: Collection[int] = ()) -> set[tuple[int, int]]:
    """``(stage, unit)`` of every backward in ``actions`` whose version differs from its
    forward's, and of every unit of the stages in ``always`` (activation recomputation)."""
    fwd: dict[tuple[int, int], int | None] = {}
    out: set[tuple[int, int]] = set()
    for a in actions:
        if a.op is Op.F:
            fwd[(a.stage, a.mb)] = a.version
            if a.stage in always:
                out.add((a.stage, a.mb))
        elif a.op is Op.B and a.version is not None:  # I and W keep their F's version (checked there)
            v = fwd.get((a.stage, a.mb))
            if v is not None and v != a.version:
                out.add((a.stage, a.mb))
    return out


def rng_state(device: torch.device) -> RngState:
    """The random state a forward starts from (restored for its recompute: same dropout masks)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def recompute(st: StageRuntime, version: int, u: UnitState, device: torch.device,
              loss: Callable[[Any], Tensor],
              stream: AbstractContextManager[None] | None = None) -> tuple[dict[str, Tensor], list[Tensor]]:
    """The forward of ``u`` run again under ``version`` (module docstring): that version's
    weights and the recomputation's outputs (the roots its backward differentiates).

    ``u`` holds the stage input and random state its forward kept; ``loss(output)`` is the
    unit's loss (called on the last stage only); ``stream`` is the unit's random stream, the
    one its forward ran under (:func:`pipetrain.graph.random_ops.unit_stream`). What autograd
    saves for the backward goes into ``u.recomputed`` (held until the unit's last backward
    piece: the tensor ledger counts it between zero-bubble's I and W).
    """
    sm = st.stage
    assert u.rng is not None, "recompute needs the forward's stashed input"
    params = st.versions.get(version)
    cpu, cuda = u.rng
    devices = [device] if cuda is not None else []
    snap = BufferGuard(sm.module)
    with torch.random.fork_rng(devices=devices, enabled=True):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        saved = u.recomputed = []

        def pack(t: Tensor) -> Tensor:
            saved.append(t)
            return t

        with (torch.enable_grad(), stream or nullcontext(), st.compute_scope(),
              torch.autograd.graph.saved_tensors_hooks(pack, _same)):
            out = functional_call(sm.module, params, tuple(u.inputs))
            if sm.is_last:
                outputs = [loss(sm.finish_output(out))]
            else:
                codec = sm.out_codec
                assert codec is not None
                wires = codec.encode(out, device)
                outputs = [wires[i] for i in codec.grad_indices]
    snap.restore_changed()
    return params, outputs


def _same(t: Tensor) -> Tensor:
    return t
