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
    SEND_*, RECV_*   through :class:`~pipetrain.runtime.engine.comm.Comm` (receives are posted
           ``lookahead`` actions ahead)
    ALLREDUCE        start summing the group's gradient over the stage's replicas
    STEP   mean gradient = sum / units in the group (design.md's gradient accounting),
           optional clipping, optimizer on the newest version -> version k+1

Random operations: with a ``seed``, every forward (and its recompute) of unit ``mb`` runs
under the per-unit random stream of its global unit index ``step * m + mb % m``
(:mod:`pipetrain.graph.random_ops`): the stage's random nodes draw the same masks as on one
worker with the same microbatches, whatever the layout or the order of units.

Gradient clipping: synchronous schedules clip by the global norm over all stages (each rank
adds its stages' squared norms, divided by their replica counts, in one all-reduce at the
step); asynchronous schedules (pipedream, 2bw), whose stages step at different times on
different versions, clip each stage by its own norm.

What the executor is built with, beyond its stages and data: the gradient exchange of
parameters tied across stages (:class:`~pipetrain.runtime.engine.tied_sync.TiedSync`, at
STEP before the hooks see the gradients) and its hooks
(:class:`~pipetrain.runtime.engine.hooks.EngineHooks`, called at the points listed there).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.func import functional_call

from ...graph.random_ops import unit_stream
from ...job.config import LRSchedule
from ...schedule.action import COMPUTE_OPS, Action, Op
from ...schedule.events import Event
from ..process.faults import inject_forward_failure
from ..process.log import progress
from . import recompute
from .comm import Comm
from .hooks import EngineHooks
from .optim import clip_coefficient, sum_of_squares
from .split_backward import backward_input, backward_weight
from .stage_runtime import StageRuntime
from .tied_sync import TiedSync
from .unit_state import UnitState
from .units import UnitData
from .versions import version_last_use

__all__ = ["Executor"]

_G = TypeVar("_G", Tensor, "Tensor | None")


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
            or SIGKILLs itself at its first forward of that step (:mod:`~pipetrain.runtime.process.faults`).
        log_every: log the loss of every ``log_every``-th step (last stage; 0: never) on the
            ``pipetrain.progress`` logger.
        lr_totals: stage -> the LR schedule's horizon in that stage's steps (default: the
            segment's steps after those already taken).
        tied: sums the gradients of parameters tied across stages at STEP, or ``None``.
        hooks: called at fixed points of every action, in order (:mod:`~pipetrain.runtime.engine.hooks`).
        on_step: called ``on_step(step, loss)`` for every minibatch the last stage finishes,
            instead of the log line (needs ``log_every >= 1``): the driving rank's progress
            (:mod:`pipetrain.runtime.worker.monitor`).
        seed: the run's seed, which the random nodes' per-unit stream derives from
            (``None``: they draw from the global generator as it is).
    """

    def __init__(self, rank: int, stages: dict[int, StageRuntime], comm: Comm, data: UnitData,
                 loss_fn: Callable[[Any, Any], Tensor], base_lr: float, lr_schedule: LRSchedule,
                 clip: float | None = None, global_clip: bool = False, lookahead: int = 8,
                 record: bool = False, fail_at: tuple[int, int, str] | None = None,
                 log_every: int = 0, lr_totals: dict[int, int] | None = None, tied: TiedSync | None = None,
                 hooks: Sequence[EngineHooks] = (), on_step: Callable[[int, float], None] | None = None,
                 seed: int | None = None) -> None:
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
        self.tied = tied
        self.hooks = tuple(hooks)
        self._dropping = [h for h in self.hooks if h.drops_steps]  # their agreement comes before any update
        self.on_step = on_step
        self.seed = seed
        self.events: list[Event] = []   # seconds since t0; every action if record, else the STEPs
        self.losses: dict[int, Tensor] = {}  # unit -> loss (last stage)
        self._units: dict[tuple[int, int], UnitState] = {}
        self._inbox: dict[tuple[int, int, int], tuple[list[Tensor], Action]] = {}
        self._outbox: dict[tuple[int, int, int], list[Tensor]] = {}
        self._deferred: list[tuple[StageRuntime, dict[str, Tensor | None]]] = []
        self._last_step_pos: set[int] = set()
        self._last_backward_pos: set[int] = set()
        self._recompute: set[tuple[int, int]] = set()  # (stage, unit) whose B recomputes its forward
        self._group_units: dict[int, list[int]] = {}
        self._logged = 0
        self._pos = 0
        self.t0 = time.perf_counter()
        self._handlers: dict[Op, Callable[[Action], None]] = {
            Op.F: self._forward, Op.B: self._backward, Op.I: self._backward_input, Op.W: self._backward_weight,
            Op.SEND_F: self._send, Op.SEND_B: self._send, Op.RECV_F: self._recv, Op.RECV_B: self._recv,
            Op.ALLREDUCE: self._allreduce, Op.STEP: self._step,
        }

    # -- what hooks read (hooks.EngineView) ----------------------------------------------
    @property
    def position(self) -> int:
        """Index in the segment's list of the action running (or the last one run)."""
        return self._pos

    def unit(self, stage: int, mb: int) -> UnitState | None:
        """The forward of unit ``mb`` in flight at ``stage`` (until its last backward piece)."""
        return self._units.get((stage, mb))

    def outgoing(self, stage: int, mb: int, direction: int) -> list[Tensor] | None:
        """The wires waiting for their SEND (``direction`` 0: SEND_F, 1: SEND_B)."""
        return self._outbox.get((stage, mb, direction))

    def received(self) -> list[Tensor]:
        """The tensors of every receive done and not yet taken by a forward or backward."""
        return [t for ts, _ in self._inbox.values() for t in ts]

    # -- the loop ----------------------------------------------------------------------
    def run(self, actions: Sequence[Action]) -> None:
        """Execute ``actions`` in order (one schedule segment)."""
        for h in self.hooks:
            h.before_run(self)
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
            self._execute(a)
            if record or a.op is Op.STEP:
                self.events.append(Event(self.rank, a, t - self.t0, time.perf_counter() - self.t0))
            if a.op in COMPUTE_OPS or a.op is Op.STEP:
                self.stages[a.stage].versions.release(i)
        if self._units or self._inbox or self._outbox:
            left = sorted(set(k[:2] for k in self._units) | set(k[:2] for k in self._inbox))[:4]
            raise RuntimeError(f"rank {self.rank}: the schedule left units unfinished: (stage, unit) {left}")
        for h in self.hooks:
            h.after_run(self)

    def _execute(self, a: Action) -> None:
        """One action's handler (an F inside every hook's forward scope), then the hooks."""
        if a.op is Op.F and self.hooks:
            with ExitStack() as scopes:
                for h in self.hooks:
                    scopes.enter_context(h.forward_scope(self, a))
                self._forward(a)
        else:
            self._handlers[a.op](a)
        for h in self.hooks:
            h.after_action(self, a)

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
        # each group's last weight-gradient op (B or W) before its ALLREDUCE: its backward
        # starts the stage's all-reduce buckets as they fill (stage_runtime.py)
        last_grad: dict[int, int] = {}
        self._last_backward_pos = set()
        for i, a in enumerate(actions):
            if a.op in (Op.B, Op.W):
                last_grad[a.stage] = i
            elif a.op is Op.ALLREDUCE and a.stage in last_grad:
                self._last_backward_pos.add(last_grad.pop(a.stage))
        self._recompute = recompute.recompute_units(actions, [k for k, st in self.stages.items() if st.recompute])

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
        # a unit whose backward recomputes its forward keeps no graph of this one (recompute.py)
        with torch.set_grad_enabled(rng is None), self._stream(a.stage, a.mb), st.compute_scope():
            out = functional_call(sm.module, params, tuple(values))
            if sm.is_last:
                loss = self.loss_fn(sm.finish_output(out), self.data.unit(a.mb)[1])
                self.losses[a.mb] = loss.detach()
                outputs = sent = [loss]
            else:
                codec = sm.out_codec
                assert codec is not None
                sent = st.own_wires(codec.encode(out, self.comm.device))
                self._outbox[(a.stage, a.mb, 0)] = sent
                outputs = [sent[i] for i in codec.grad_indices]
        for h in self.hooks:
            h.after_forward(self, a, values, params, sent)
        u = UnitState(version, params, leaves, outputs, recv_action, bufs)
        if rng is not None:  # its B runs under a newer version: keep the input, drop the graph (recompute.py)
            u.inputs, u.rng, u.outputs = tuple(values), rng, []
        self._units[(a.stage, a.mb)] = u

    def _grad_outputs(self, a: Action, u: UnitState) -> list[Tensor] | None:
        if self.stages[a.stage].stage.is_last:
            return None
        if u.grad_bufs is None:
            bufs, action = self._inbox.pop((a.stage, a.mb, 1))
            u.grad_bufs, u.grad_action = bufs, action
        return u.grad_bufs

    def _differentiable(self, u: UnitState,
                        gouts: list[Tensor] | None) -> tuple[list[Tensor], list[Tensor] | None]:
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
        if (a.stage, a.mb) in self._recompute:
            self._recompute_forward(a, u)
        self._check_version(a, u)
        outs, gouts = self._differentiable(u, self._grad_outputs(a, u))
        if self._pos in self._last_backward_pos:
            st.arm_last_backward(self.comm)
        params = [u.params[n] for n in st.trainable]
        grads = self._grads(outs, gouts, u.leaves + params, retain=False)
        for h in self.hooks:
            h.after_backward(self, a, u, gouts, grads)
        nleaf = len(u.leaves)
        self._finish_input_grads(a, u, grads[:nleaf])
        st.accumulate(self._owned(grads[nleaf:], u))
        self._note_unit(a)
        self._release(u)

    def _recompute_forward(self, a: Action, u: UnitState) -> None:
        """The forward of ``u`` again under B's (or I's) version, which ``u`` then describes (recompute.py)."""
        version = a.version if a.version is not None else u.version
        target = self.data.unit

        def loss(output: Any) -> Tensor:
            return self.loss_fn(output, target(a.mb)[1])

        u.params, u.outputs = recompute.recompute(self.stages[a.stage], version, u, self.comm.device, loss,
                                                  self._stream(a.stage, a.mb))
        u.version = version

    def _stream(self, stage: int, mb: int) -> AbstractContextManager[None]:
        """The per-unit random stream of unit ``mb`` of this segment (module docstring), for a
        stage with random nodes."""
        if self.seed is None or not self.stages[stage].stage.random_nodes:
            return nullcontext()
        m = self.data.m
        return unit_stream(self.seed, self.data.step_of(mb) * m + mb % m, [self.comm.device])

    # I and W: one backward split in two with no work done twice (split_backward.py)
    def _backward_input(self, a: Action) -> None:
        st = self.stages[a.stage]
        u = self._units[(a.stage, a.mb)]
        if (a.stage, a.mb) in self._recompute:
            self._recompute_forward(a, u)
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
        if self._pos in self._last_backward_pos:
            st.arm_last_backward(self.comm)
        st.accumulate(self._owned(backward_weight(u.weight_work, st.sink), u))
        u.weight_work = None
        self._note_unit(a)
        self._release(u)

    def _finish_input_grads(self, a: Action, u: UnitState, grads: list[Tensor | None]) -> None:
        sm = self.stages[a.stage].stage
        if sm.is_first:
            return
        codec = sm.in_codec
        assert codec is not None
        out: list[Tensor] = []
        for i, g in zip(codec.grad_indices, grads):
            out.append(self.comm.zeros(codec.specs[i]) if g is None else g)
        self._outbox[(a.stage, a.mb, 1)] = self._owned(out, u)

    def _owned(self, grads: Sequence[_G], u: UnitState) -> list[_G]:
        """Gradients that alias a receive buffer (a value passed straight through) are copied,
        since the buffer goes back to the pool."""
        if not u.grad_bufs:
            return list(grads)
        ptrs = {b.untyped_storage().data_ptr() for b in u.grad_bufs}
        return [g.clone() if g is not None and g.untyped_storage().data_ptr() in ptrs else g for g in grads]

    def _note_unit(self, a: Action) -> None:
        if self.log_every and self.stages[a.stage].stage.is_last:
            self._group_units.setdefault(a.stage, []).append(a.mb)

    def _release(self, u: UnitState) -> None:
        if u.recv_action is not None:
            self.comm.release(u.recv_bufs, u.recv_action)
        if u.grad_bufs is not None and u.grad_action is not None:
            self.comm.release(u.grad_bufs, u.grad_action)

    def _check_version(self, a: Action, u: UnitState) -> None:
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
        if self.tied is not None:  # the tied copies' gradients are summed before the update
            self.tied.sync(st, grads)
        for h in self.hooks:
            h.check_step(self, st, a, grads)
        if not self.global_clip and not self._dropping:
            st.apply(grads, self.base_lr, self.lr_schedule, clip=self.clip, position=self._pos)
            self._after_update(st, a)
        else:
            self._deferred.append((st, grads))
            if self._pos in self._last_step_pos:
                self._apply_deferred(a)
        if self.log_every and st.stage.is_last:
            self._log_step(a)

    def _apply_deferred(self, a: Action) -> None:
        """At the rank's last STEP of a minibatch: every local stage has its step-k gradient.
        A hook that drops steps decides first (every rank agrees); then, with global clipping
        (synchronous schedules), one all-reduce over ranks gives the norm."""
        if self._dropping and any([h.agree(self, a) for h in self._dropping]):  # every hook enters its agreement
            for s, _ in self._deferred:
                s.drop_group(self._pos)
            self._deferred = []
        coef = None
        if self.global_clip and self._deferred:
            assert self.clip is not None  # global_clip needs a clip norm (constructor)
            coef = clip_coefficient(self._global_norm(), self.clip)
        for s, g in self._deferred:
            s.apply(g, self.base_lr, self.lr_schedule, clip=self.clip, coef=coef, position=self._pos)
            self._after_update(s, a)
        self._deferred = []

    def _global_norm(self) -> float:
        """The 2-norm of every deferred gradient over all ranks: each replica adds its
        squared norm / replicas; a tied tensor counts once."""
        tied = self.tied
        local = sum((tied.sum_of_squares(s, g) if tied is not None else sum_of_squares(g.values())) / s.replicas
                    for s, g in self._deferred)
        return math.sqrt(max(0.0, self.comm.sum_over_ranks(local)))

    def _after_update(self, st: StageRuntime, a: Action) -> None:
        for h in self.hooks:
            h.after_update(self, st, a)

    def _log_step(self, a: Action) -> None:
        """Log the loss of the minibatches this STEP completes (last stage, every n-th step)."""
        every = self.log_every
        units = self._group_units.pop(a.stage, [])
        if not every or not units:
            return
        step = max(self.data.step_of(u) for u in units)
        if self.on_step is not None:  # progress and logs of the driving rank (runtime/worker/monitor.py)
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
