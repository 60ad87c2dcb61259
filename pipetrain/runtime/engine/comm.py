"""The one module that puts tensors on the wire.

Point-to-point: a SEND/RECV action moves the wire tensors of one unit across one cut
(:mod:`pipetrain.stages.boundary`): ``kSEND_Fu`` / ``(k+1)RECV_Fu`` the activations of cut
``k``, ``(k+1)SEND_Bu`` / ``kRECV_Bu`` their gradients. Everything is asynchronous:

- receives are posted ahead (the executor calls :meth:`Comm.post` a few actions early) into
  pre-allocated buffers from a pool, so transfers overlap compute and no step allocates;
- sends return at once; a small reaper thread per peer waits for their completion, after
  which their tensors are dropped and buffers they read may be reused;
- a buffer returns to the pool (:meth:`Comm.release`) after the backward of its unit, and is
  reused only when no pending send still reads it (a value relayed unchanged is sent from the
  buffer it arrived in).

Precision (``wire_dtype``, ``--precision bf16``): a float32 wire travels as that dtype: a send
rounds it, a receive lands in a buffer of that dtype and hands the stage a float32 copy (the
buffer goes straight back to the pool); a transfer to this same rank is rounded the same way,
so the numbers do not depend on where the stages run. A float32 wire the stage produced in
bfloat16 already (an autocast output) is sent as it is. Every other wire travels as it is.

Messages are told apart by tag (gloo matches a receive by source and tag): one tag per
(cut, direction, unit mod U, wire index), so units in flight, directions and the tensors of
one message never mix. (NCCL ignores tags; both ends then post in their schedule's order,
which pairs up for every builder's schedule.)

Collectives: the gradients of a replicated stage are all-reduced (sum) in one flat buffer in
the stage's own process group (``dist.new_group`` per replicated stage, created in the same
order on every rank); the last element of the buffer carries the number of units the replica
accumulated, so STEP can divide by the group's total. Global gradient clipping sums squared
norms over all ranks in a group of its own. Every wait is bounded by the process group's
timeout.

Accounting (:attr:`Comm.traffic`, a :class:`~pipetrain.schedule.traffic.Traffic`): every message
and collective is counted by kind as it is started (sends, collectives) or completed
(receives), with the conventions of :mod:`pipetrain.schedule.traffic`, whose
:func:`~pipetrain.plan.traffic.predict_traffic` predicts the same figures from the schedule:

- a ``SEND_F``/``RECV_F`` message is ``activation``, a ``SEND_B``/``RECV_B`` one ``gradient``
  (the bytes of its wire tensors; a transfer to this same rank counts nothing);
- an all-reduce of a stage's flat buffer of ``n`` elements of size ``e`` over ``r`` ranks is
  ``allreduce`` for the ``n - 1`` gradient elements and ``control`` for the count element,
  each counted as the ring figure ``floor(2 (r-1) bytes / r)`` sent and received, and as
  ``bytes`` in ``reduced``;
- the global clipping norm (one float64 over all ranks) is ``control``.

:meth:`Comm.traffic_since` gives the counts since a snapshot (e.g. the timed segment), and
:func:`cut_bytes` the exact per-unit sizes of every cut from the codecs, for the prediction.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...schedule.action import Action, Op, Schedule
from ...schedule.traffic import CutBytes, ReduceBuffer, Traffic
from ...stages.boundary import BoundaryCodec, WireSpec

__all__ = ["Comm", "message_specs", "cut_bytes", "reduce_buffers"]

_F, _B = 0, 1


def message_specs(codec: BoundaryCodec, direction: int) -> list[WireSpec]:
    """Wire specs of a forward (all wires) or backward (gradients of the ``needs_grad`` wires) message."""
    if direction == _F:
        return list(codec.specs)
    return [codec.specs[i] for i in codec.grad_indices]


def cut_bytes(codecs: Sequence[BoundaryCodec], wire_dtype: torch.dtype | None = None) -> list[CutBytes]:
    """Exact bytes one unit moves across every cut: all wires forward, the needs-grad wires back
    (float32 wires in ``wire_dtype`` when given)."""
    def nbytes(s: WireSpec) -> int:
        dt = _on_wire(s.dtype, wire_dtype)
        return s.nbytes if dt == s.dtype else s.nbytes // _element_size(s.dtype) * _element_size(dt)

    return [CutBytes(sum(nbytes(s) for s in message_specs(c, _F)), sum(nbytes(s) for s in message_specs(c, _B)))
            for c in codecs]


def _on_wire(dtype: torch.dtype, wire_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a wire of ``dtype`` travels in."""
    return wire_dtype if wire_dtype is not None and dtype == torch.float32 else dtype


def reduce_buffers(params: Sequence[Tensor]) -> list[ReduceBuffer]:
    """The flat all-reduce buffers of a replicated stage with these trainable parameters: one per
    dtype (in order of first appearance), gradients plus one count element."""
    by_dtype: dict[torch.dtype, int] = {}
    for p in params:
        by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
    return [ReduceBuffer(n * _element_size(dt), _element_size(dt)) for dt, n in by_dtype.items()]


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_KIND = {_F: "activation", _B: "gradient"}


@dataclass
class _Ticket:
    """A send in flight: its work handle and the tensors it reads."""

    work: Any
    tensors: list[Tensor] | None
    storages: list[int]
    done: bool = False
    error: BaseException | None = None


@dataclass
class _PooledBuffer:
    tensor: Tensor
    fence: list[_Ticket] = field(default_factory=list)

    def ready(self) -> bool:
        return all(t.done for t in self.fence)


class _Reaper:
    """One thread per peer that waits for sends to complete (gloo sends complete only when waited on)."""

    def __init__(self, nccl: bool) -> None:
        self.nccl = nccl
        self.q: queue.Queue[_Ticket | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            t = self.q.get()
            if t is None:
                return
            try:
                if self.nccl:
                    while not t.work.is_completed():
                        time.sleep(1e-4)
                else:
                    t.work.wait()
            except BaseException as e:  # noqa: BLE001 - reported by Comm.finish
                t.error = e
            t.done = True
            t.tensors = None

    def close(self, timeout: float) -> None:
        self.q.put(None)
        self.thread.join(timeout)


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Comm:
    """Transfers and collectives of one worker (see the module docstring).

    Args:
        rank: this worker's rank.
        schedule: the complete schedule (stage -> ranks, for the process groups).
        codecs: ``codecs[c]`` describes what crosses cut ``c``.
        device: where wire tensors live.
        timeout: seconds for new process groups (waits use the group's timeout).
        global_clip: create the all-ranks group used by global gradient clipping.
        wire_dtype: the dtype float32 wires travel in (``None``: as they are; module docstring).
        distributed: whether transfers go through the process group (``None``: when one is
            initialised); ``False`` keeps every transfer in this process and creates no group.
    """

    def __init__(self, rank: int, schedule: Schedule, codecs: Sequence[BoundaryCodec], device: torch.device,
                 timeout: float, global_clip: bool = False, wire_dtype: torch.dtype | None = None,
                 distributed: bool | None = None) -> None:
        self.rank = rank
        self.wire_dtype = wire_dtype
        self.device = device
        self.codecs = list(codecs)
        self.distributed = (dist.is_available() and dist.is_initialized()) if distributed is None else distributed
        self.nccl = self.distributed and dist.get_backend() == "nccl"
        self._pool: dict[tuple[int, int, int], list[_PooledBuffer]] = {}
        self._pooled: set[int] = set()  # ids of tensors that are pool buffers
        self._posted: dict[tuple[int, int, int], tuple[list[Tensor], list[Any]]] = {}
        self._local: dict[tuple[int, int, int], list[Tensor]] = {}
        self._reapers: dict[int, _Reaper] = {}
        self._tickets: list[_Ticket] = []
        self._zeros: dict[tuple[tuple[int, ...], torch.dtype], Tensor] = {}
        self.traffic = Traffic()  # counted by kind (module docstring)
        self._group_size = [len(r) for r in schedule.stage_ranks]
        ncuts = max(1, len(self.codecs))
        width = max([len(c.specs) for c in self.codecs] + [1])
        self._width = width
        self._ncuts = ncuts
        self._units_mod = max(1, (2 ** 31 - 1) // (ncuts * 2 * width))
        # Process groups: every rank creates every group, in the same order.
        self.groups: dict[int, Any] = {}
        self.clip_group: Any = None
        if self.distributed:
            td = timedelta(seconds=timeout)
            for k, ranks in enumerate(schedule.stage_ranks):
                if len(ranks) > 1:
                    g = dist.new_group(ranks=list(ranks), timeout=td)
                    if rank in ranks:
                        self.groups[k] = g
            if global_clip and dist.get_world_size() > 1:
                self.clip_group = dist.new_group(ranks=list(range(dist.get_world_size())), timeout=td)

    # -- accounting ----------------------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        """Bytes this worker sent, every kind (collectives by the ring convention)."""
        return int(self.traffic.total_sent)

    def traffic_since(self, snapshot: Traffic) -> Traffic:
        """What was counted since ``snapshot`` (a ``comm.traffic.copy()`` taken earlier)."""
        return self.traffic - snapshot

    # -- tags and keys -------------------------------------------------------------------
    @staticmethod
    def _message(action: Action) -> tuple[int, int]:
        """(cut, direction) an action's message travels on."""
        k = action.stage
        if action.op is Op.SEND_F:
            return k, _F
        if action.op is Op.RECV_F:
            return k - 1, _F
        if action.op is Op.SEND_B:
            return k - 1, _B
        if action.op is Op.RECV_B:
            return k, _B
        raise ValueError(f"{action} is not a transfer")

    def _tag(self, cut: int, direction: int, unit: int, i: int) -> int:
        return (((unit % self._units_mod) * self._ncuts + cut) * 2 + direction) * self._width + i

    def specs(self, action: Action) -> list[WireSpec]:
        cut, d = self._message(action)
        return message_specs(self.codecs[cut], d)

    # -- buffers -------------------------------------------------------------------------
    def _acquire(self, cut: int, direction: int, i: int, spec: WireSpec) -> Tensor:
        free = self._pool.setdefault((cut, direction, i), [])
        for j, b in enumerate(free):
            if b.ready():
                free.pop(j)
                return b.tensor
        t = torch.empty(spec.shape, dtype=_on_wire(spec.dtype, self.wire_dtype), device=self.device)
        self._pooled.add(id(t))
        return t

    def release(self, tensors: Sequence[Tensor], action: Action) -> None:
        """Give receive buffers of ``action``'s message back to the pool (others are ignored)."""
        cut, d = self._message(action)
        pending = [t for t in self._tickets if not t.done]
        for i, t in enumerate(tensors):
            if id(t) not in self._pooled:
                continue
            st = _storage(t)
            fence = [tk for tk in pending if st in tk.storages]
            self._pool.setdefault((cut, d, i), []).append(_PooledBuffer(t, fence))

    def buffers(self) -> list[Tensor]:
        """Every receive buffer this object holds: free in the pool, posted, or received from
        this same rank and not yet taken."""
        out = [b.tensor for free in self._pool.values() for b in free]
        out += [t for ts, _ in self._posted.values() for t in ts]
        return out + [t for ts in self._local.values() for t in ts]

    def zeros(self, spec: WireSpec) -> Tensor:
        """A shared, never-written zero tensor (the gradient of an unused output)."""
        key = (spec.shape, spec.dtype)
        z = self._zeros.get(key)
        if z is None:
            z = self._zeros[key] = torch.zeros(spec.shape, dtype=spec.dtype, device=self.device)
        return z

    # -- point to point -----------------------------------------------------------------
    def post(self, action: Action) -> None:
        """Post the receives of a RECV action (idempotent)."""
        cut, d = self._message(action)
        key = (cut, d, action.mb)
        if key in self._posted:
            return
        specs = message_specs(self.codecs[cut], d)
        if action.peer == self.rank or not self.distributed:
            self._posted[key] = ([], [])
            return
        bufs, works = [], []
        for i, spec in enumerate(specs):
            b = self._acquire(cut, d, i, spec)
            bufs.append(b)
            works.append(dist.irecv(b, src=action.peer, tag=self._tag(cut, d, action.mb, i)))
        self._posted[key] = (bufs, works)

    def wait(self, action: Action) -> list[Tensor]:
        """The wire tensors of a RECV action (posting it first if needed)."""
        self.post(action)
        cut, d = self._message(action)
        key = (cut, d, action.mb)
        bufs, works = self._posted.pop(key)
        if action.peer == self.rank or not self.distributed:
            try:
                return self._local.pop(key)
            except KeyError:
                raise RuntimeError(f"rank {self.rank}: {action.long} has no matching local send before it") from None
        for w in works:
            w.wait()
        self.traffic.count_receive(_KIND[d], sum(b.numel() * b.element_size() for b in bufs))
        return self._widen(cut, d, bufs, message_specs(self.codecs[cut], d))

    def _widen(self, cut: int, d: int, bufs: list[Tensor], specs: Sequence[WireSpec]) -> list[Tensor]:
        """Received wires in their specs' dtypes; a buffer copied that way goes back to the pool."""
        out = []
        for i, (b, spec) in enumerate(zip(bufs, specs)):
            if b.dtype == spec.dtype:
                out.append(b)
                continue
            out.append(b.to(spec.dtype))
            if id(b) in self._pooled:
                self._pool.setdefault((cut, d, i), []).append(_PooledBuffer(b))
        return out

    def send(self, action: Action, tensors: Sequence[Tensor]) -> None:
        """Start sending a SEND action's wire tensors (returns at once)."""
        cut, d = self._message(action)
        specs = message_specs(self.codecs[cut], d)
        if len(tensors) != len(specs):
            raise RuntimeError(f"rank {self.rank}: {action.long} has {len(tensors)} tensors, expected {len(specs)}")
        out: list[Tensor] = []
        for t, spec in zip(tensors, specs):
            t = t.detach()
            # a float32 wire may already be in its wire dtype (an autocast output)
            if tuple(t.shape) != spec.shape or t.dtype not in (spec.dtype, _on_wire(spec.dtype, self.wire_dtype)):
                from ...errors import RuntimeConfigError

                raise RuntimeConfigError(
                    f"stage {action.stage} produced a {tuple(t.shape)} {t.dtype} tensor for unit {action.mb} where the "
                    f"example run gave {spec.shape} {spec.dtype}; the pipeline needs fixed shapes per unit (same "
                    f"sequence length and microbatch size for every unit)")
            wire = _on_wire(t.dtype, self.wire_dtype)
            out.append(t.to(dtype=wire, memory_format=torch.contiguous_format) if wire != t.dtype
                       else t if t.is_contiguous() else t.contiguous())
        key = (cut, d, action.mb)
        peer = action.peer
        if peer == self.rank or not self.distributed:
            self._local[key] = self._widen(cut, d, out, specs)
            return
        if peer is None:
            raise RuntimeError(f"rank {self.rank}: {action.long} has no peer; build schedules with insert_comm")
        if self.nccl:  # different peers use different streams: never send a buffer we may reuse
            out = [t.clone() if id(t) in self._pooled else t for t in out]
        works = [dist.isend(t, dst=peer, tag=self._tag(cut, d, action.mb, i)) for i, t in enumerate(out)]
        self.traffic.count_send(_KIND[d], sum(t.numel() * t.element_size() for t in out))
        reaper = self._reapers.get(peer)
        if reaper is None:
            reaper = self._reapers[peer] = _Reaper(self.nccl)
        for w, t in zip(works, out):
            tk = _Ticket(w, [t], [_storage(t)])
            self._tickets.append(tk)
            reaper.q.put(tk)
        if len(self._tickets) > 64:
            self._tickets = [t for t in self._tickets if not t.done]

    # -- collectives ---------------------------------------------------------------------
    def allreduce_start(self, stage: int, flat: Tensor) -> Any:
        """Start summing ``flat`` over the stage's replicas; returns a handle with ``wait()``."""
        self.allreduce_count(stage, flat)
        return self.allreduce_launch(stage, flat)

    def allreduce_count(self, stage: int, flat: Tensor) -> None:
        """Count the all-reduce of a stage's flat buffer as one collective, however many bucket
        launches (:meth:`allreduce_launch`) sum its parts: the last element carries the unit
        count (control), the rest are gradients."""
        if stage not in self.groups:
            return
        e, r = flat.element_size(), self._group_size[stage]
        self.traffic.count_collective("allreduce", (flat.numel() - 1) * e, r)
        self.traffic.count_collective("control", e, r, calls=0)

    def allreduce_launch(self, stage: int, part: Tensor) -> Any:
        """Start summing ``part`` (a contiguous piece of a counted flat buffer) over the stage's
        replicas, uncounted; returns a handle with ``wait()``, or ``None`` for one replica."""
        group = self.groups.get(stage)
        if group is None:
            return None
        return dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def sum_over_ranks(self, value: float) -> float:
        """Sum of a float over all ranks (global gradient norm)."""
        if self.clip_group is None:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        self.traffic.count_collective("control", t.numel() * t.element_size(), dist.get_world_size())
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.clip_group)
        return float(t.item())

    def finish(self, timeout: float) -> None:
        """Wait for every send to complete; re-raise a send's failure."""
        for r in self._reapers.values():
            r.close(timeout)
        for r in self._reapers.values():
            if r.thread.is_alive():
                raise RuntimeError(f"rank {self.rank}: sends did not complete within {timeout:.0f} s")
        self._reapers.clear()
        for t in self._tickets:
            if t.error is not None:
                raise t.error
        self._tickets.clear()
        if self._posted:
            keys = sorted(self._posted)[:4]
            raise RuntimeError(f"rank {self.rank}: receives posted but never consumed: {keys}")
