"""The executor: runs one worker's action list through one table of handlers keyed by Op.

The action list is the schedule's (the same data the simulator runs); the executor adds
nothing to it. Per action::

    F      stage 0 takes the unit's inputs, other stages the received values; runs the stage
           with the weights of the action's version (torch.func.functional_call); the last
           stage computes loss_fn(output, target) of the unit
    B      backward of that forward with the received output gradients (last stage: of the
           loss), through the same version's weights (stashed by reference); accumulates the
           weight gradients into the stage's current group
    I, W   the input-gradient and weight-gradient halves of B (zero-bubble schedules)
    SEND_*, RECV_*   through :class:`~pipetrain.runtime.comm.Comm` (receives are posted
           ``lookahead`` actions ahead)
    ALLREDUCE        start summing the group's gradient over the stage's replicas
    STEP   mean gradient = sum / units in the group (design.md's gradient accounting),
           optional clipping, optimizer on the newest version -> version k+1

Gradient clipping: synchronous schedules clip by the global norm over all stages (each rank
adds its stages' squared norms, divided by their replica counts, in one all-reduce at the
step); asynchronous schedules (pipedream, 2bw), whose stages step at different times on
different versions, clip each stage by its own norm.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.func import functional_call

from ..schedule.action import COMPUTE_OPS, Action, Op
from ..schedule.events import Event
from . import recompute
from .comm import Comm
from .config import LRSchedule
from .data import UnitData
from .faults import inject_forward_failure
from .fused import GradSink, install
from .log import progress
from .numerics import drop_step
from .optim import FunctionalOptimizer, clip_coefficient, sum_of_squares
from .split_backward import backward_input, backward_weight
from .stage import StageModule
from .tied import TiedSync
from .versions import WeightVersions, version_last_use

__all__ = ["StageRuntime", "Executor"]


class StageRuntime:
    """Everything a worker keeps for one of its stages: module, versions, optimizer, gradients."""

    def __init__(self, stage: StageModule, optimizer: FunctionalOptimizer, replicas: int,
                 device: torch.device, fuse_linear: bool = False) -> None:
        self.stage = stage
        self.index = stage.index
        self.replicas = replicas
        self.optimizer = optimizer
        mod = stage.module.to(device)
        named = dict(mod.named_parameters())
        initial = {n: named[n].detach().requires_grad_(named[n].requires_grad) for n in stage.param_names}
        self.trainable = [n for n in stage.param_names if named[n].requires_grad]
        # The module keeps only shapes (meta tensors): the weights live in the versions, so a
        # dropped version's memory is really freed. functional_call binds a version per call.
        # [tied] Every name of a tensor (a tie inside the stage: emb.weight and head.weight) gets
        # the same meta parameter, so functional_call binds the version's tensor to all of them.
        metas: dict[int, torch.nn.Parameter] = {}
        for n, p in list(mod.named_parameters(remove_duplicate=False)):
            meta = metas.get(id(p))
            if meta is None:
                meta = metas[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                                         requires_grad=p.requires_grad)
            owner, _, leaf = n.rpartition(".")
            sub = mod.get_submodule(owner) if owner else mod
            setattr(sub, leaf, meta)
        self.versions = WeightVersions(initial)
        self.lr_total = 1  # horizon of the LR schedule, in this stage's steps
        self._acc: dict[str, Tensor] = {}
        self.acc_count = 0
        # Replicated stages accumulate straight into flat all-reduce buffers (one per dtype;
        # the last element of each carries the unit count).
        self.flats: dict[torch.dtype, Tensor] = {}
        self.views: dict[str, Tensor] = {}
        # Linear layers write their weight gradients straight into the accumulators
        # (fused.py); the sink's "touched" set is the group's, shared with the flat views.
        self.sink = GradSink()
        self._touched: set[str] = self.sink.touched
        self.fused: set[str] = set(install(mod, set(self.trainable), self.sink)) if fuse_linear else set()
        self.pending: list[Any] = []
        self.ready_grads: dict[str, Tensor | None] | None = None
        if replicas > 1:
            by_dtype: dict[torch.dtype, list[str]] = {}
            for n in self.trainable:
                by_dtype.setdefault(initial[n].dtype, []).append(n)
            for dt, names in by_dtype.items():
                total = sum(initial[n].numel() for n in names)
                flat = torch.zeros(total + 1, dtype=dt, device=device)
                off = 0
                for n in names:
                    k = initial[n].numel()
                    self.views[n] = flat[off:off + k].view_as(initial[n])
                    off += k
                self.flats[dt] = flat
        for n in self.fused:
            self.sink.buffers[n] = self.views[n] if self.views else torch.zeros_like(initial[n])

    # -- gradient accumulation ------------------------------------------------------------
    def accumulate(self, grads: Sequence[Tensor | None]) -> None:
        """Add one unit's weight gradients (aligned with :attr:`trainable`) to the group."""
        self.acc_count += 1
        fused = self.fused
        for n, g in zip(self.trainable, grads):
            if g is None:
                continue
            if n in fused:  # the backward already added the Linear's part; add any other part
                self.sink.add(n, g)
            elif self.views:
                v = self.views[n]
                if n in self._touched:
                    v.add_(g)
                else:
                    v.copy_(g)
                    self._touched.add(n)
            else:
                cur = self._acc.get(n)
                if cur is None:
                    self._acc[n] = g  # fresh tensor from autograd: owned, no copy
                else:
                    cur.add_(g)

    def start_allreduce(self, comm: Comm) -> None:
        for n, v in self.views.items():
            if n not in self._touched:
                v.zero_()
        for flat in self.flats.values():
            flat[-1] = float(self.acc_count)
            work = comm.allreduce_start(self.index, flat)
            if work is not None:
                self.pending.append(work)

    def mean_gradients(self) -> dict[str, Tensor | None]:
        """Finish the group: wait for the all-reduce, divide by the group's unit count."""
        for w in self.pending:
            w.wait()
        self.pending = []
        if self.views:
            count = float(next(iter(self.flats.values()))[-1].item()) if self.flats else float(self.acc_count)
            if count <= 0:
                raise RuntimeError(f"stage {self.index}: STEP with no accumulated units")
            for flat in self.flats.values():
                if count != 1:
                    flat[:-1].div_(count)
            grads: dict[str, Tensor | None] = {n: self.views.get(n) for n in self.trainable}
        else:
            count = float(self.acc_count)
            if count <= 0:
                raise RuntimeError(f"stage {self.index}: STEP with no accumulated units")
            grads = {n: ((self.sink.buffers[n] if n in self._touched else None) if n in self.fused
                         else self._acc.get(n)) for n in self.trainable}
            if count != 1:
                for g in grads.values():
                    if g is not None:
                        g.div_(count)
        return grads

    def apply(self, grads: dict[str, Tensor | None], base_lr: float, schedule: LRSchedule,
              clip: float | None = None, coef: float | None = None, position: int | None = None) -> None:
        """Optimizer step on the newest version -> a new version; resets the group."""
        if coef is None and clip is not None:  # per-stage clipping (asynchronous schedules)
            coef = clip_coefficient(math.sqrt(sum_of_squares(grads.values())), clip)
        if coef is not None and coef < 1.0:
            for g in grads.values():
                if g is not None:
                    g.mul_(coef)
        lr = schedule.lr(base_lr, self.optimizer.steps, self.lr_total)
        # In place when no later action of this segment uses the newest version (flushed
        # schedules, the last stage of 1F1B): torch.optim's update, one version held. Else
        # out of place (weight stashing), into the tensors of a dropped version if any.
        in_place = position is not None and self.versions.unused_after(position)
        out = self.versions.latest if in_place else self.versions.spare()
        new = self.optimizer.apply(self.versions.latest, grads, lr, out=out)
        self.versions.push(new, replace=in_place)
        self._acc = {}
        self._touched.clear()
        self.acc_count = 0


@dataclass
class _Unit:
    """A forward in flight at one stage: what its backward needs."""

    version: int
    params: dict[str, Tensor]
    leaves: list[Tensor]            # received wires that require grad
    outputs: list[Tensor]           # wires whose gradient comes back (or the loss)
    recv_action: Action | None      # the RECV_F whose buffers to release
    recv_bufs: list[Tensor] = field(default_factory=list)
    grad_bufs: list[Tensor] | None = None
    grad_action: Action | None = None
    inputs: tuple[Any, ...] = ()    # [no stashing] the stage input, kept for the recompute
    rng: Any = None                 # [no stashing] the random state the forward started from
    weight_work: Any = None         # [zero-bubble] what I kept for W (runtime/split_backward.py)


class Executor:
    """Runs one worker's actions (see the module docstring).

    Args:
        rank: the worker's rank.
        stages: its stages (several for interleaved schedules).
        comm: the communication object.
        data: per-unit inputs and targets.
        loss_fn: ``loss_fn(output, target)``, the mean over the unit's samples.
        base_lr, lr_schedule, clip, global_clip: the optimizer step settings.
        lookahead: actions ahead to post receives for.
        record: keep an :class:`~pipetrain.schedule.events.Event` per action (traces); STEP
            events are always kept (the steady-state throughput is computed from them).
        fail_at: hidden debug option, ``(rank, step, mode)``: this rank raises, blocks forever
            or SIGKILLs itself at its first forward of that step (:mod:`~pipetrain.runtime.faults`).
        log_every: log the loss of every ``log_every``-th step (last stage; 0: never) on the
            ``pipetrain.progress`` logger.
    """

    def __init__(self, rank: int, stages: dict[int, StageRuntime], comm: Comm, data: UnitData,
                 loss_fn: Callable[[Any, Any], Tensor], base_lr: float, lr_schedule: LRSchedule,
                 clip: float | None = None, global_clip: bool = False, lookahead: int = 8,
                 record: bool = False, fail_at: tuple[int, int, str] | None = None,
                 log_every: int = 0, lr_totals: dict[int, int] | None = None) -> None:
        self.rank = rank
        self.stages = stages
        self.comm = comm
        self.data = data
        self.loss_fn = loss_fn
        self.base_lr = base_lr
        self.lr_schedule = lr_schedule
        self.clip = clip
        self.global_clip = global_clip and clip is not None
        self.lookahead = lookahead
        self.record = record
        self.fail_at = fail_at
        self.log_every = log_every
        self.lr_totals = lr_totals
        #: [tied] sums the gradients of parameters tied across stages at STEP (runtime/tied.py)
        self.tied: TiedSync | None = None
        #: [numerics] checks losses and gradients at STEP (runtime/numerics.py); None: no checks
        self.numerics: Any = None
        self.events: list[Event] = []   # seconds since t0; every action if record, else the STEPs
        self.losses: dict[int, Tensor] = {}  # unit -> loss (last stage)
        self._units: dict[tuple[int, int], _Unit] = {}
        self._inbox: dict[tuple[int, int, int], tuple[list[Tensor], Action]] = {}
        self._outbox: dict[tuple[int, int, int], list[Tensor]] = {}
        self._deferred: list[tuple[StageRuntime, dict[str, Tensor | None]]] = []
        self._last_step_pos: set[int] = set()
        self._recompute: set[tuple[int, int]] = set()  # [no stashing] (stage, unit) whose B recomputes
        self._group_units: dict[int, list[int]] = {}
        self._logged = 0
        #: called ``on_step(step, loss)`` for every minibatch the last stage finishes, instead of
        #: the log line (needs ``log_every >= 1``); the driving rank's progress (runtime/monitor.py)
        self.on_step: Callable[[int, float], None] | None = None
        self._pos = 0
        self.t0 = time.perf_counter()
        self.handlers: dict[Op, Callable[[Action], None]] = {
            Op.F: self._forward, Op.B: self._backward, Op.I: self._backward_input, Op.W: self._backward_weight,
            Op.SEND_F: self._send, Op.SEND_B: self._send, Op.RECV_F: self._recv, Op.RECV_B: self._recv,
            Op.ALLREDUCE: self._allreduce, Op.STEP: self._step,
        }

    # -- the loop ----------------------------------------------------------------------
    def run(self, actions: Sequence[Action]) -> None:
        """Execute ``actions`` in order (one schedule segment)."""
        self._prepare(actions)
        post = 0
        n = len(actions)
        recv_ops = (Op.RECV_F, Op.RECV_B)
        send_ops = (Op.SEND_F, Op.SEND_B)
        nccl = self.comm.nccl
        record = self.record
        for i, a in enumerate(actions):
            limit = min(n, i + 1 + self.lookahead)
            while post < limit:
                nxt = actions[post]
                if nxt.op in recv_ops:
                    self.comm.post(nxt)
                elif nccl and post > i and nxt.op in send_ops:
                    # NCCL runs a peer pair's transfers in issue order on one stream: a
                    # receive posted before one of our sends could block that send.
                    break
                post += 1
            self._pos = i
            t = time.perf_counter()
            self.handlers[a.op](a)
            if record or a.op is Op.STEP:
                self.events.append(Event(self.rank, a, t - self.t0, time.perf_counter() - self.t0))
            if a.op in COMPUTE_OPS or a.op is Op.STEP:
                self.stages[a.stage].versions.release(i)
        if self._units or self._inbox or self._outbox:
            left = sorted(set(k[:2] for k in self._units) | set(k[:2] for k in self._inbox))[:4]
            raise RuntimeError(f"rank {self.rank}: the schedule left units unfinished: (stage, unit) {left}")

    def _prepare(self, actions: Sequence[Action]) -> None:
        """Version liveness and step positions of this segment; stage horizons for the LR schedule."""
        for k, st in self.stages.items():
            uses = [(i, a.version) for i, a in enumerate(actions)
                    if a.stage == k and a.op in COMPUTE_OPS and a.version is not None]
            st.versions.rebase(version_last_use(uses))
            if self.lr_totals is not None and k in self.lr_totals:
                st.lr_total = max(1, self.lr_totals[k])
            else:
                nsteps = sum(1 for a in actions if a.stage == k and a.op is Op.STEP)
                st.lr_total = max(1, st.optimizer.steps + nsteps)
        last_pos: dict[int, int] = {}
        for i, a in enumerate(actions):
            if a.op is Op.STEP:
                last_pos[a.mb] = i
        self._last_step_pos = set(last_pos.values())
        self._recompute = recompute.recompute_units(actions)

    # -- compute -----------------------------------------------------------------------
    def _forward(self, a: Action) -> None:
        st = self.stages[a.stage]
        sm = st.stage
        if self.fail_at is not None and self.fail_at[0] == self.rank and self.data.step_of(a.mb) >= self.fail_at[1]:
            inject_forward_failure(self.fail_at[2], self.rank, self.data.step_of(a.mb))  # faults.py: raise/hang/kill
        leaves: list[Tensor] = []
        bufs: list[Tensor] = []
        recv_action = None
        if sm.is_first:
            values = list(self.data.unit(a.mb)[0])
        else:
            bufs, recv_action = self._inbox.pop((a.stage, a.mb, 0))
            codec = sm.in_codec
            assert codec is not None
            wires = list(bufs)
            for i in codec.grad_indices:
                wires[i] = bufs[i].detach().requires_grad_(True)
                leaves.append(wires[i])
            values = codec.decode(wires)
        version = a.version if a.version is not None else st.versions.newest
        params = st.versions.get(version)
        rng = recompute.rng_state(self.comm.device) if (a.stage, a.mb) in self._recompute else None
        with torch.enable_grad():
            out = functional_call(sm.module, params, tuple(values))
            if sm.is_last:
                loss = self.loss_fn(sm.finish_output(out), self.data.unit(a.mb)[1])
                self.losses[a.mb] = loss.detach()
                outputs = [loss]
            else:
                codec = sm.out_codec
                assert codec is not None
                wires_out = codec.encode(out, self.comm.device)
                self._outbox[(a.stage, a.mb, 0)] = wires_out
                outputs = [wires_out[i] for i in codec.grad_indices]
        if self.numerics is not None:  # [numerics] a non-finite output: find its node (runtime/numerics.py)
            self.numerics.after_forward(self, a, values, params, outputs if sm.is_last else wires_out)
        self._units[(a.stage, a.mb)] = _Unit(version, params, leaves, outputs, recv_action, bufs)
        if rng is not None:  # [no stashing] its B runs under a newer version (runtime/recompute.py)
            recompute.keep_for_recompute(self._units[(a.stage, a.mb)], values, rng)

    def _grad_outputs(self, a: Action, u: _Unit) -> list[Tensor] | None:
        if self.stages[a.stage].stage.is_last:
            return None
        if u.grad_bufs is None:
            bufs, action = self._inbox.pop((a.stage, a.mb, 1))
            u.grad_bufs, u.grad_action = bufs, action
        return u.grad_bufs

    def _differentiable(self, u: _Unit, gouts: list[Tensor] | None) -> tuple[list[Tensor], list[Tensor] | None]:
        """Outputs that carry a graph, with their gradients."""
        if gouts is None:
            return u.outputs, None
        outs, gs = [], []
        for o, g in zip(u.outputs, gouts):
            if o.requires_grad:
                outs.append(o)
                gs.append(g)
        return outs, gs

    def _grads(self, outs: list[Tensor], gouts: list[Tensor] | None, inputs: list[Tensor],
               retain: bool) -> list[Tensor | None]:
        if not outs or not inputs:
            return [None] * len(inputs)
        return list(torch.autograd.grad(outs, inputs, grad_outputs=gouts, allow_unused=True, retain_graph=retain))

    def _backward(self, a: Action) -> None:
        st = self.stages[a.stage]
        u = self._units.pop((a.stage, a.mb))
        if (a.stage, a.mb) in self._recompute:  # [no stashing] forward again under B's version
            recompute.recompute(self, a, u)
        self._check_version(a, u)
        outs, gouts = self._differentiable(u, self._grad_outputs(a, u))
        params = [u.params[n] for n in st.trainable]
        grads = self._grads(outs, gouts, u.leaves + params, retain=False)
        if self.numerics is not None:  # [numerics] a non-finite gradient: find its node (runtime/numerics.py)
            self.numerics.after_backward(self, a, u, gouts, grads)
        nleaf = len(u.leaves)
        self._finish_input_grads(a, u, grads[:nleaf])
        st.accumulate(self._owned(grads[nleaf:], u))
        self._note_unit(a)
        self._release(u)

    # -- [zero-bubble] I and W: one backward split with no work done twice (split_backward.py)
    def _backward_input(self, a: Action) -> None:
        st = self.stages[a.stage]
        u = self._units[(a.stage, a.mb)]
        self._check_version(a, u)
        outs, gouts = self._differentiable(u, self._grad_outputs(a, u))
        grads, u.weight_work = backward_input(outs, gouts, u.leaves, [u.params[n] for n in st.trainable], st.sink)
        u.outputs = []  # W starts from what I kept, not from the outputs
        self._finish_input_grads(a, u, grads)

    def _backward_weight(self, a: Action) -> None:
        st = self.stages[a.stage]
        u = self._units.pop((a.stage, a.mb))
        self._check_version(a, u)
        if u.weight_work is None:
            raise RuntimeError(f"rank {self.rank}: {a.long} runs before the unit's I; a schedule must put I before W")
        st.accumulate(self._owned(backward_weight(u.weight_work, st.sink), u))
        u.weight_work = None
        self._note_unit(a)
        self._release(u)
    # -- [zero-bubble] end

    def _finish_input_grads(self, a: Action, u: _Unit, grads: list[Tensor | None]) -> None:
        sm = self.stages[a.stage].stage
        if sm.is_first:
            return
        codec = sm.in_codec
        assert codec is not None
        out: list[Tensor] = []
        for i, g in zip(codec.grad_indices, grads):
            out.append(self.comm.zeros(codec.specs[i]) if g is None else g)
        self._outbox[(a.stage, a.mb, 1)] = self._owned(out, u)  # type: ignore[assignment]

    def _owned(self, grads: Sequence[Tensor | None], u: _Unit) -> list[Tensor | None]:
        """Gradients that alias a receive buffer (a value passed straight through) are copied,
        since the buffer goes back to the pool."""
        if not u.grad_bufs:
            return list(grads)
        ptrs = {b.untyped_storage().data_ptr() for b in u.grad_bufs}
        return [g.clone() if g is not None and g.untyped_storage().data_ptr() in ptrs else g for g in grads]

    def _note_unit(self, a: Action) -> None:
        if self.log_every and self.stages[a.stage].stage.is_last:
            self._group_units.setdefault(a.stage, []).append(a.mb)

    def _release(self, u: _Unit) -> None:
        if u.recv_action is not None:
            self.comm.release(u.recv_bufs, u.recv_action)
        if u.grad_bufs is not None and u.grad_action is not None:
            self.comm.release(u.grad_bufs, u.grad_action)

    def _check_version(self, a: Action, u: _Unit) -> None:
        if a.version is not None and a.version != u.version:
            raise RuntimeError(
                f"rank {self.rank}: {a.long} uses version {a.version} but its forward used {u.version}; "
                f"design.md requires B to use its F's version")

    # -- transfers ---------------------------------------------------------------------
    def _send(self, a: Action) -> None:
        d = 0 if a.op is Op.SEND_F else 1
        tensors = self._outbox.pop((a.stage, a.mb, d))
        self.comm.send(a, tensors)

    def _recv(self, a: Action) -> None:
        d = 0 if a.op is Op.RECV_F else 1
        self._inbox[(a.stage, a.mb, d)] = (self.comm.wait(a), a)

    # -- updates -----------------------------------------------------------------------
    def _allreduce(self, a: Action) -> None:
        self.stages[a.stage].start_allreduce(self.comm)

    def _step(self, a: Action) -> None:
        st = self.stages[a.stage]
        if a.mb != st.versions.newest:
            raise RuntimeError(
                f"rank {self.rank}: {a} would make version {a.mb + 1} but stage {a.stage}'s newest version is "
                f"{st.versions.newest}; STEP k must follow STEP k-1")
        grads = st.mean_gradients()
        if self.tied is not None:  # [tied] before applying the update: sum the tied copies' gradients
            self.tied.sync(st, grads)
        if self.numerics is not None:  # [numerics] a NaN/Inf loss or gradient stops here (runtime/numerics.py)
            self.numerics.check_step(self, st, a, grads)
        skip = self.numerics is not None and self.numerics.skip  # [numerics] --skip-nonfinite: ranks agree first
        if not self.global_clip and not skip:
            st.apply(grads, self.base_lr, self.lr_schedule, clip=self.clip, position=self._pos)
            if self.numerics is not None:  # [numerics] weights finite after the update
                self.numerics.after_update(self, st, a)
        else:
            # Global norm (synchronous schedules): once every local stage has its step-k
            # gradient, one all-reduce over ranks; each replica adds sumsq / replicas.
            self._deferred.append((st, grads))
            if self._pos in self._last_step_pos:
                if skip and self.numerics.agree(self, a):  # [numerics] a NaN/Inf on some rank: every stage drops it
                    for s, _ in self._deferred:
                        drop_step(s, self._pos)
                    self._deferred = []
                coef = None
                if self.global_clip and self._deferred:
                    local = sum((self.tied.sum_of_squares(s, g) if self.tied is not None  # [tied] counted once
                                 else sum_of_squares(g.values())) / s.replicas for s, g in self._deferred)
                    total = math.sqrt(max(0.0, self.comm.sum_over_ranks(local)))
                    coef = clip_coefficient(total, self.clip)  # type: ignore[arg-type]
                for s, g in self._deferred:
                    s.apply(g, self.base_lr, self.lr_schedule, clip=self.clip, coef=coef, position=self._pos)
                    if self.numerics is not None:  # [numerics] weights finite after the update
                        self.numerics.after_update(self, s, a)
                self._deferred = []
        if self.log_every and st.stage.is_last:
            self._log_step(a)

    def _log_step(self, a: Action) -> None:
        """Log the loss of the minibatches this STEP completes (last stage, every n-th step)."""
        every = self.log_every
        units = self._group_units.pop(a.stage, [])
        if not every or not units:
            return
        step = max(self.data.step_of(u) for u in units)
        if self.on_step is not None:  # progress and logs of the driving rank (runtime/monitor.py)
            self.on_step(step + 1, sum(float(self.losses[u]) for u in units) / len(units))
            return
        bucket = (step + 1) // every
        if bucket > self._logged:  # a replicated last stage sees every r-th step only
            self._logged = bucket
            loss = sum(float(self.losses[u]) for u in units) / len(units)
            progress.info("step %d: loss %.6f", step + 1, loss)

    # -- results -----------------------------------------------------------------------
    def unit_losses(self) -> dict[int, float]:
        return {u: float(v) for u, v in self.losses.items()}
