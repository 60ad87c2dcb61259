"""A rehearsal: every rank's actions run as its worker runs them, one rank after another in
this process, timed. What ``train --schedule auto`` predicts a candidate from.

A stage's forward and backward inside a run are more than its graph: the worker binds a
weight version per call (``functional_call``), writes ``Linear`` and ``Embedding`` gradients
into its sinks (:mod:`~pipetrain.runtime.engine.fused`), checks outputs and gradients (the
numerics guard), computes the loss on the last stage, and a zero-bubble schedule runs each
backward as two autograd passes (:mod:`~pipetrain.runtime.engine.split_backward`). None of
that is in a profile of the graph. Measured on a Hugging Face T5 (2 + 2 layers, d_model 256)
at 1-sample units: the run's split backward took 1.44x its whole backward on the last
stage, and its units 1.0-1.6x the choice's stage timing; a rehearsal of the same
configuration gave the run's own unit times within 2-10%.

:func:`rehearse` takes a resolved run (a candidate's plan, schedule and microbatches on a
short run) and, for each distinct set of stages a rank holds, in pipeline order:

1. builds that rank's stages as its worker does (:func:`~pipetrain.job.model.build_stages`:
   storage for this rank's tensors only, so the process holds one rank's share at a time),
   with the run's optimizer, fused gradients, precision and recomputation;
2. executes the rank's own action list with the :class:`~pipetrain.runtime.engine.executor.Executor`
   and the worker's hooks (the numerics guard, the naming of the model's exceptions), on a
   :class:`RehearsalComm`: no process group; a forward receive gets what the previous stage's
   rehearsal sent for that unit (real values), or another unit's of that cut; a backward
   receive a fixed small stand-in gradient; sends are kept for the next rank;
3. keeps every compute action's and STEP's seconds. Every STEP updates at a learning rate of
   0: the same arithmetic as the run's, on weights that stay as built (stand-in gradients
   would move them the same way every update, and a long rehearsal could overflow).

The result is each stage's median seconds of one unit's F, B, I, W and of one STEP
(:class:`~pipetrain.simulate.costs.MeasuredUnit`), leaving out the first minibatch (warm
caches, first allocations). A replicated stage's STEP divides its gradients by every
replica's units, as after a run's all-reduce. What it leaves out, and the prediction adds:
the transfers, the all-reduce of replicated stages and of tensors tied across stages, the
waits, and ranks sharing the machine's cores (the calibration's ``compute_slowdown``).
"""
from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..graph.held import trim_heap
from ..job.model import build_stages
from ..job.resolved import ResolvedRun
from ..schedule.action import Action, Op, Schedule
from ..simulate.costs import MeasuredUnit
from ..stages.boundary import BoundaryCodec
from ..stages.partition import build_stage_modules
from ..stages.tied import holds_tie
from .engine.comm import Comm, message_specs
from .engine.executor import Executor
from .engine.precision import wire_dtype
from .engine.stage_runtime import stage_runtimes
from .engine.units import UnitData
from .guards.numerics import NumericsGuard
from .worker.forward_errors import ForwardErrors

__all__ = ["Rehearsal", "RehearsalComm", "rehearse", "rehearsal_ranks", "STAND_IN_GRADIENT"]

#: The scale of the stand-in gradients a backward receive gets (normal, fixed per wire):
#: finite, and far from the denormal range whose arithmetic is many times slower on a CPU.
STAND_IN_GRADIENT = 1e-3

_F, _B = 0, 1


@dataclass
class _Wires:
    """What the rehearsed ranks sent forward: (cut, unit) -> the wires, and each cut's last."""

    sent: dict[tuple[int, int], list[Tensor]] = field(default_factory=dict)
    last: dict[int, list[Tensor]] = field(default_factory=dict)

    def keep(self, cut: int, unit: int, tensors: Sequence[Tensor]) -> None:
        kept = [t.detach().clone() for t in tensors]
        self.sent[(cut, unit)] = kept
        self.last[cut] = kept

    def drop_before(self, cut: int) -> None:
        """Let go of the wires of cuts below ``cut`` (no rank still to rehearse reads them)."""
        self.sent = {k: v for k, v in self.sent.items() if k[0] >= cut}
        self.last = {c: v for c, v in self.last.items() if c >= cut}


class RehearsalComm(Comm):
    """A worker's transfers inside one process (module docstring, 2): no process group,
    forward receives from ``wires``, backward receives stand-ins, forward sends into ``wires``."""

    def __init__(self, rank: int, schedule: Schedule, codecs: Sequence[BoundaryCodec], device: torch.device,
                 wires: _Wires, wire_dtype: torch.dtype | None = None) -> None:
        super().__init__(rank, schedule, codecs, device, timeout=1.0, wire_dtype=wire_dtype, distributed=False)
        self.wires = wires
        self._stand_ins: dict[int, list[Tensor]] = {}

    def post(self, action: Action) -> None:
        """Nothing to post: every receive is served at once."""

    def wait(self, action: Action) -> list[Tensor]:
        cut, d = self._message(action)
        specs = message_specs(self.codecs[cut], d)
        if d == _F:
            got = self.wires.sent.get((cut, action.mb)) or self.wires.last.get(cut)
            return [t.clone() for t in got] if got is not None else [self.zeros(s).clone() for s in specs]
        if cut not in self._stand_ins:
            gen = torch.Generator().manual_seed(cut)
            self._stand_ins[cut] = [
                (torch.randn(s.shape, generator=gen) * STAND_IN_GRADIENT).to(self.device, s.dtype)
                if s.dtype.is_floating_point else torch.zeros(s.shape, dtype=s.dtype, device=self.device)
                for s in specs]
        return [t.clone() for t in self._stand_ins[cut]]

    def send(self, action: Action, tensors: Sequence[Tensor]) -> None:
        cut, d = self._message(action)
        if d == _F:
            self.wires.keep(cut, action.mb, tensors)

    def allreduce_count(self, stage: int, flat: Tensor) -> None:
        """The unit count the all-reduce would give a replicated stage: every replica's (the
        round-robin gives each the same), so its STEP divides the gradients as in a run."""
        flat[-1] *= self._group_size[stage]


@dataclass(frozen=True)
class Rehearsal:
    """Each stage's measured unit (:class:`MeasuredUnit`) and the rehearsal's own seconds."""

    stages: tuple[MeasuredUnit, ...]
    seconds: float
    ranks: tuple[int, ...]   # the ranks rehearsed (one per distinct set of stages)
    forwards: tuple[int, ...]  # per stage, the forwards timed (after the first minibatch)


def rehearsal_ranks(schedule: Schedule) -> list[int]:
    """One rank for each distinct set of stages a rank holds (replicas do the same work), in
    pipeline order (by their first stage): the ranks :func:`rehearse` runs."""
    first: dict[tuple[int, ...], int] = {}
    for r in range(schedule.num_workers):
        first.setdefault(tuple(schedule.stages_of_rank(r)), r)
    return sorted(first.values(), key=lambda r: (min(schedule.stages_of_rank(r), default=0), r))


def rehearse(run: ResolvedRun) -> Rehearsal:
    """Rehearse ``run``'s timed schedule (module docstring) at its workers' torch threads
    (``--threads``; the caller's restored after); the device is the CPU, or the run's
    (``--device cuda``: the first GPU)."""
    threads = run.config.performance.threads
    if threads is None or run.config.parallel.device == "cuda":  # as runtime.process.setup leaves them
        return _rehearse(run)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _rehearse(run)
    finally:
        torch.set_num_threads(old)


def _rehearse(run: ResolvedRun) -> Rehearsal:
    t0 = time.perf_counter()
    schedule = run.schedule
    times: dict[tuple[int, Op], list[float]] = {}
    wires = _Wires()
    ranks = rehearsal_ranks(schedule)
    for rank in ranks:
        _rehearse_rank(run, rank, wires, times)
        wires.drop_before(min(schedule.stages_of_rank(rank)))
        gc.collect()
        trim_heap()
    stages = []
    for k in range(schedule.num_stages):
        def med(op: Op, k: int = k) -> float | None:
            xs = times.get((k, op))
            return float(statistics.median(xs)) if xs else None

        fwd = med(Op.F)
        if fwd is None:
            raise RuntimeError(f"the rehearsal ran no forward of stage {k}")
        stages.append(MeasuredUnit(fwd, med(Op.B), med(Op.I), med(Op.W), med(Op.STEP)))
    return Rehearsal(tuple(stages), time.perf_counter() - t0, tuple(ranks),
                     tuple(len(times.get((k, Op.F), [])) for k in range(schedule.num_stages)))


def _rehearse_rank(run: ResolvedRun, rank: int, wires: _Wires, times: dict[tuple[int, Op], list[float]]) -> None:
    """Build ``rank``'s stages as its worker does, run its actions, add their seconds to ``times``."""
    cfg = run.config
    schedule = run.schedule
    mine = schedule.stages_of_rank(rank)
    device = torch.device("cuda" if cfg.parallel.device == "cuda" else "cpu")
    staged = build_stages(run, mine)
    modules = build_stage_modules(staged.captured, staged.partition, staged.codecs, mine)
    stages = stage_runtimes(run, modules, device, bucket_bytes=0)  # no all-reduce: every rank alone
    comm = RehearsalComm(rank, schedule, staged.codecs, device, wires, wire_dtype(cfg.training.precision))
    bundle = staged.bundle
    del staged
    data = UnitData(bundle.make_batch, run.batch_size, run.microbatches, cfg.training.seed, 0, device)
    data.prefetch(schedule.steps)
    # as the worker's: a rank summing tied gradients with other stages reads them in full at STEP
    ties = next(iter(modules.values())).ties if modules else ()
    guard = NumericsGuard(rank, None, skip=False, synchronous=cfg.synchronous, schedule=cfg.parallel.schedule,
                          tied=holds_tie(ties, mine))
    # The rehearsal times the updates, it does not train: at a learning rate of 0 an update
    # does the same arithmetic and the weights stay as built. Stand-in gradients are fixed per
    # wire, so training on them would move every update the same way until a long rehearsal
    # overflowed.
    executor = Executor(rank, stages, comm, data, bundle.loss_fn, 0.0, cfg.training.lr_schedule,
                        clip=cfg.training.clip_grad_norm, global_clip=False, lookahead=cfg.performance.lookahead,
                        record=True, hooks=[ForwardErrors(rank), guard], seed=cfg.training.seed)
    executor.run(schedule.workers[rank])
    per_step = max(1, run.microbatches)
    for e in executor.events:
        a = e.action
        if a.op not in (Op.F, Op.B, Op.I, Op.W, Op.STEP):
            continue
        step = a.mb if a.op is Op.STEP else a.mb // per_step
        if step == 0 and schedule.steps > 1:  # the first minibatch warms up
            continue
        times.setdefault((a.stage, a.op), []).append(e.end - e.start)
