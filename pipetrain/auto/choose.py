"""``train --schedule auto``: the planner chooses the schedule, the microbatches and the stages.

PipeDream's planner (paper section 3.1) picks stages and replicas for one schedule. A user who
leaves the schedule open wants the fastest *configuration* on the machine at hand, which may
be data parallelism (communication is cheap), a straight pipeline, or a replicated one, under
an asynchronous schedule (pipedream, 2bw) or a flushed one (flush, zerobubble) at some
number of microbatches. :func:`choose` predicts each candidate's time per minibatch on
measured costs and returns the fastest:

1. **Costs.** Communication: a calibration (``--calibration FILE``, or measured now on
   loopback with the run's number of ranks: point-to-point and gloo all-reduce fits,
   :mod:`pipetrain.cluster.measure`). Compute: the model profiled here, one profile per
   unit size (per-node times do not scale linearly with the unit size on a CPU), each
   scaled to the minibatch (times and activations ``x units``, so the simulator's division
   by the unit count gives the unit's measured times back). Optimizer steps: each stage's
   STEP over its parameters as the runtime runs it (the gradients' mean, the ``torch.optim``
   step, the numerics guard's read of the weights), timed here. Every measurement goes through the
   measurement cache when the caller gives one (:mod:`pipetrain.auto.measured`), so a run
   repeated on the same machine measures nothing again.
2. **Candidates.** Every schedule whose spec says ``auto`` (:class:`ScheduleSpec`): the unit
   ``minibatch`` schedule (pipedream) at 1; one-stage data parallelism (dp) at its default
   microbatches; the microbatched pipelines at their default ``d`` for a straight pipeline
   of all ranks, ``2d`` and ``4d`` (those dividing the batch), or only at ``--microbatches``
   when given.
3. **Plan and correct.** Each pipeline candidate is planned by the dynamic program with the
   calibrated costs and that schedule's memory rule; its stages are then timed as a whole
   (:mod:`pipetrain.auto.stage_timing`), the unit profile corrected and the plan made again
   once (a stage's time as a whole differs from the sum of its nodes'). Data parallelism's one
   stage, the whole model, is timed as a whole the same way.
4. **Predict.** The schedule simulated on the plan (:func:`pipetrain.simulate.calibrated.predict_run`:
   the same simulator and steady-state definition as ``pipetrain simulate`` and the runtime;
   tensors tied across the plan's stages, :func:`plan_ties`, make their holders' STEPs meet
   for the gradients' all-reduce, as the runtime's exchange does).
5. **Rehearse the fastest.** A profile times the graph, not what a worker runs around it:
   binding a weight version per call, the fused gradient sinks, the numerics checks, the
   loss, a zero-bubble backward's two autograd passes (1.4x the whole backward on a T5's
   1-sample units). So the candidates are taken in the order of their profile predictions
   and each is rehearsed (``rehearse``, the run layer's :class:`Rehearse`:
   :mod:`pipetrain.runtime.rehearsal` runs every rank's own actions with the executor, one
   rank at a time, here), and predicted again with each stage's measured F, B (or I and W)
   and STEP in place of the profile's, while the next candidate's profile prediction is
   within :data:`TIE_TOLERANCE` of the fastest rehearsed one (a profile predicts low, so one
   already slower stays slower), at most :data:`REHEARSALS`. A candidate whose rank would
   hold more than :data:`REHEARSAL_MAX_BYTES` (the planner's memory rule for its schedule),
   or whose rehearsal fails, keeps its profile's prediction and says why.
   5b. **Plan again on the rehearsal.** Per-node times measured on a busy machine can tip a
   cut; a rehearsal times each stage as a whole, as its worker runs it. When the fastest
   rehearsed pipeline's stages moved against each other (each stage's rehearsed over
   profiled forward + backward, the largest over the smallest, beyond
   :data:`REBALANCE_TOLERANCE`), its unit profile is scaled stage by stage to the rehearsed
   times and planned again; a different plan is rehearsed, and replaces the candidate when
   it rehearses faster.
6. **Pick.** Among the candidates rehearsed or too large to rehearse (one whose rehearsal
   failed ran its workers' own code and is left out; all of them when none is), the
   fastest prediction wins, except that predictions within
   :data:`TIE_TOLERANCE` (5%) of the fastest count as a tie, below the simulator's measured
   error; a tie goes to data parallelism, then a synchronous schedule, then an asynchronous
   one (stale weights cost statistical efficiency, so a gain the prediction cannot show is
   not worth them).

What the prediction leaves out: transfers and all-reduces slower inside a run than in the
calibration, cache effects between processes sharing cores, and gloo's CPU time competing
with compute on the same cores; ``docs/performance.md`` reports the measured errors.

The choice is made once, in the launcher (or by rank 0 under an outer torchrun), and handed
to every worker inside the resolved run, like any plan.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from ..plan.types import Plan
from .measured import AutoMeasurements

if TYPE_CHECKING:
    from ..cluster.calibration import Calibration
    from ..cluster.measure import RankProcesses
    from ..graph.capture import CapturedModel
    from ..profile.cache import MeasurementCache
    from ..profile.types import Profile
    from ..schedule.traffic import TiedBuffer
    from ..simulate.costs import MeasuredUnit

__all__ = ["Candidate", "AutoChoice", "Rehearse", "compared", "REHEARSALS", "REHEARSAL_MAX_BYTES", "rehearsal_bytes",
           "choose", "choose_on_profile", "microbatch_candidates", "scale_profile", "sample_shapes", "stage_parameters",
           "plan_ties", "STEP_SAMPLE_ELEMENTS"]

#: A function giving the captured model and one unit of inputs at ``samples`` samples.
ModelAt = Callable[[int], "tuple[CapturedModel, tuple[Any, ...]]"]


class Rehearse(Protocol):
    """Runs a candidate as its workers would and measures each stage's compute
    (:mod:`pipetrain.runtime.rehearsal`; the run layer passes it in)."""

    #: what its measurements depend on besides the candidate and the model (the cache's key)
    settings: Mapping[str, Any]

    def __call__(self, candidate: Candidate) -> Sequence[MeasuredUnit]:
        """Each stage's compute per unit as its worker runs it, one per stage of ``candidate.plan``."""
        ...


#: The most candidates rehearsed, fastest first by the profile's prediction (step 5 of the
#: module docstring): a rehearsal costs a short run of every rank.
REHEARSALS = 4
#: A rehearsal whose stages' compute moved against each other by more than this (the
#: largest over the smallest of each stage's rehearsed over profiled seconds, less 1) plans
#: the candidate's stages again on the rehearsed times (module docstring, 5b): one layer of
#: a 16-layer stage is 6%, and a rehearsal repeats to a few percent.
REBALANCE_TOLERANCE = 0.05
#: A candidate whose rank would hold more than this is not rehearsed (its profile's
#: prediction stands): the launcher holds what the rank's worker would, the bytes the
#: planner's memory rule predicts for its schedule (plan/stage_memory.py: every weight
#: version it keeps, their gradients, the optimizer's state, the units in flight). Measured
#: rehearsing a 0.8 GB Llama's ranks on 4 stages: flush m=4 0.43-0.48 GiB above the launcher,
#: 2bw m=4 0.64-0.71, pipedream 0.81-1.20 (its first stage stashes 4 weight versions; the
#: rule predicts 1.56).
REHEARSAL_MAX_BYTES = 1 << 30


@dataclass(frozen=True)
class Candidate:
    """One configuration considered: its schedule, microbatches, plan and predicted time."""

    schedule: str
    microbatches: int
    plan: Plan | None
    predicted_time: float | None          # seconds per minibatch (steady state); None: not runnable
    why_not: str | None = None            # why it could not be planned or run, when so
    #: each stage's simulated per-unit compute (``predict_run``'s ``stage_unit_seconds``)
    stage_unit_seconds: tuple[Mapping[str, float], ...] = ()
    #: the prediction from the profile; ``predicted_time`` is the rehearsal's when ``rehearsed``
    profile_predicted_time: float | None = None
    rehearsed: bool = False
    rehearsal_note: str | None = None     # why it was not rehearsed, or why its rehearsal failed
    rehearsal_failed: bool = False        # its rehearsal ran and failed (its workers would run the same code)
    #: each stage's forward + backward seconds per unit as rehearsed (empty: not rehearsed)
    rehearsed_stage_seconds: tuple[float, ...] = ()
    #: how far the rehearsal moved the stages against each other: the largest over the
    #: smallest of each stage's rehearsed over profiled compute (1.0: as the profile said)
    rehearsed_imbalance: float = 1.0
    replanned_from: str | None = None     # the stages it replaces, planned again on their rehearsal

    @property
    def config(self) -> str:
        return self.plan.config if self.plan is not None else "-"

    def to_json(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "microbatches": self.microbatches, "config": self.config,
                "predicted_time_per_minibatch": self.predicted_time, "why_not": self.why_not,
                "stage_unit_seconds": [dict(c) for c in self.stage_unit_seconds],
                "profile_predicted_time_per_minibatch": self.profile_predicted_time,
                "rehearsed": self.rehearsed, "rehearsal_note": self.rehearsal_note,
                "rehearsal_failed": self.rehearsal_failed, "rehearsed_imbalance": self.rehearsed_imbalance,
                "replanned_from": self.replanned_from}

    def line(self) -> str:
        if self.predicted_time is None:
            return f"{self.schedule} m={self.microbatches}: not runnable ({self.why_not})"
        idle = self.plan.extra.get("idle_workers") if self.plan is not None else None
        how = ""
        if self.rehearsed and self.profile_predicted_time is not None:
            how = f" (rehearsed; the profile said {self.profile_predicted_time * 1e3:.2f} ms)"
        elif self.rehearsal_note:
            how = f" (profile only: {self.rehearsal_note})"
        if self.replanned_from:
            how += f" (stages planned again on the rehearsal of {self.replanned_from})"
        return (f"{self.schedule} m={self.microbatches} {self.config}: {self.predicted_time * 1e3:.2f} ms"
                + (f" ({idle} workers idle)" if idle else "") + how)


@dataclass
class AutoChoice:
    """The fastest candidate, every candidate, and the costs used."""

    best: Candidate
    candidates: list[Candidate]
    costs: str                            # one line: where the communication costs came from
    seconds: float = 0.0                  # time spent choosing
    compute: str = "a profile here"       # where the compute costs came from
    reused: str = ""                      # what came from earlier runs' cache entries ('' for nothing)

    def note(self) -> str:
        """The run's plan source line."""
        b = self.best
        if b.predicted_time is None:
            return "auto"
        pool = compared(self.candidates)
        fastest = min(pool, key=lambda c: c.predicted_time or 0.0)
        among = (f"{len(pool)} configurations" if len(pool) == len(self.runnable) else
                 f"the {len(pool)} compared of {len(self.runnable)} configurations")
        how = (f"fastest of {among}" if fastest is b else
               f"within {TIE_TOLERANCE:.0%} of the fastest of {among}, "
               f"{fastest.schedule} m={fastest.microbatches} at {(fastest.predicted_time or 0.0) * 1e3:.2f} ms, "
               f"and simpler: {_SEMANTICS[_semantics(b)]}")
        if b.replanned_from:
            how += f"; stages planned again on the rehearsal of {b.replanned_from}"
        rehearsed = sum(1 for c in self.candidates if c.rehearsed)
        compute = (f"{self.compute}, the {rehearsed} fastest rehearsed as their workers run them" if rehearsed
                   else self.compute)
        return (f"auto: {b.schedule} m={b.microbatches} on {b.config}, predicted {b.predicted_time * 1e3:.2f} ms "
                f"per minibatch ({how}; on {self.costs} and {compute}; chosen in {self.seconds:.1f} s"
                + (f"; {self.reused})" if self.reused else ")"))

    @property
    def runnable(self) -> list[Candidate]:
        return [c for c in self.candidates if c.predicted_time is not None]

    def to_json(self) -> dict[str, Any]:
        return {"schedule": self.best.schedule, "microbatches": self.best.microbatches, "config": self.best.config,
                "predicted_time_per_minibatch": self.best.predicted_time, "costs": self.costs,
                "stage_unit_seconds": [dict(c) for c in self.best.stage_unit_seconds],
                "seconds": self.seconds, "candidates": [c.to_json() for c in self.candidates]}


def scale_profile(unit: Profile, units: int, batch_size: int) -> Profile:
    """A minibatch profile of ``units`` units made from a unit profile: node times,
    activations and saved tensors (the loss's too) ``x units`` (the simulator divides by the
    unit count), parameters unchanged; the unit's measured step is not the minibatch's (dropped)."""
    if units == 1:
        return unit

    def times(b: int | None) -> int | None:
        return None if b is None else b * units

    nodes = [replace(n, forward_time=n.forward_time * units, backward_time=n.backward_time * units,
                     activation_bytes=n.activation_bytes * units, saved_bytes=times(n.saved_bytes))
             for n in unit.nodes]
    return replace(unit, batch_size=batch_size, nodes=nodes, loss_saved_bytes=times(unit.loss_saved_bytes),
                   measured_forward_time=None, measured_backward_time=None, measured_from=None)


def microbatch_candidates(spec: Any, workers: int, batch: int, given: int | None) -> list[int]:
    """Microbatch counts tried for ``spec`` (module docstring, 2)."""
    if spec.unit == "minibatch":
        return [1] if given in (None, 1) else []
    if given is not None:
        return [given] if given <= batch and batch % given == 0 else []
    reps = [workers] if spec.one_stage else [1] * workers
    ranks = spec.rank_replicas(reps, {})
    d = int(spec.default_microbatches(len(ranks), ranks))
    tries = [d] if spec.one_stage else [d, 2 * d, 4 * d]
    return [m for m in tries if m <= batch and batch % m == 0]


class _StepTimer:
    """Seconds of one STEP over the parameters of a stage's nodes as the runtime runs it (median
    of 5): the gradients' mean (a division), the numerics guard's check of the gradients, the
    ``torch.optim`` step, and the guard's check of the weights after it (one fused norm each,
    runtime/guards/numerics.py)."""

    def __init__(self, optimizer: str, momentum: float, measured: AutoMeasurements) -> None:
        self.optimizer, self.momentum, self.measured = optimizer, momentum, measured
        self._cache: dict[tuple[str, ...], float] = {}

    def __call__(self, gm: Any, nodes: Sequence[str]) -> float:
        key = tuple(nodes)
        if key in self._cache:
            return self._cache[key]
        shapes = [p.shape for p in stage_parameters(gm, nodes)]
        self._cache[key] = self.measured.step_seconds(shapes, lambda: self._scaled(shapes)) if shapes else 0.0
        return self._cache[key]

    def _scaled(self, shapes: Sequence[Any]) -> float:
        """:meth:`_time` on at most :data:`STEP_SAMPLE_ELEMENTS` of the stage's parameters,
        scaled by its elements (an optimizer step is linear in them): timing a stage as large
        as the model never allocates the model's weights, gradients and optimizer state."""
        sample, total = sample_shapes(shapes, STEP_SAMPLE_ELEMENTS)
        taken = sum(math.prod(s) for s in sample)
        return self._time(sample) * (total / taken if taken else 1.0)

    def _time(self, shapes: Sequence[Any]) -> float:
        import torch

        ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
        for p in ps:
            p.grad = torch.randn(p.shape)
        if self.optimizer == "sgd":
            opt: Any = torch.optim.SGD(ps, lr=1e-3, momentum=self.momentum, foreach=True)
        elif self.optimizer == "adamw":
            opt = torch.optim.AdamW(ps, lr=1e-3, foreach=True)
        else:
            opt = torch.optim.Adam(ps, lr=1e-3, foreach=True)
        grads = [g for p in ps if (g := p.grad) is not None]

        def once() -> None:
            torch._foreach_div_(grads, 1.0)
            with torch.no_grad():
                torch.nn.utils.get_total_norm(grads, foreach=True)
            opt.step()
            with torch.no_grad():
                torch.nn.utils.get_total_norm(ps, foreach=True)

        once()
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            once()
            runs.append(time.perf_counter() - t)
        return float(statistics.median(runs))


#: The most parameter elements one optimizer step is timed on (``_StepTimer``); a larger
#: stage's step is scaled from it (16 Mi elements: 64 MiB in fp32, and as much per gradient
#: and optimizer state).
STEP_SAMPLE_ELEMENTS = 1 << 24


def sample_shapes(shapes: Sequence[Any], limit: int) -> tuple[list[tuple[int, ...]], int]:
    """The first of ``shapes`` up to ``limit`` elements in all (the one that crosses it cut to
    a flat tensor of what is left), and the elements of all of them."""
    total = sum(math.prod(s) for s in shapes)
    out: list[tuple[int, ...]] = []
    left = limit
    for s in shapes:
        n = math.prod(s)
        if n <= left:
            out.append(tuple(s))
            left -= n
        else:
            if left > 0:
                out.append((left,))
            break
    return out, total


def stage_parameters(gm: Any, nodes: Sequence[str]) -> list[Any]:
    """The parameters a stage made of ``nodes`` updates at its STEP, each once: its
    ``call_module`` nodes' own and those of the ``get_attr`` nodes it reads. A plan's stages
    name the profile's nodes, and a ``torch.export`` capture's ``get_attr`` nodes are folded
    into the nodes reading them (``CapturedModel.folded_attributes``), so they are found
    through the nodes' inputs, not among the stage's names."""
    names = set(nodes)
    out: dict[str, Any] = {}
    for n in gm.graph.nodes:
        if n.name not in names:
            continue
        if n.op == "call_module":
            for k, p in gm.get_submodule(str(n.target)).named_parameters(recurse=False):
                out.setdefault(f"{n.target}.{k}", p)
        for a in (n, *n.all_input_nodes):
            if a.op == "get_attr" and _is_parameter(gm, str(a.target)):
                out.setdefault(str(a.target), gm.get_parameter(str(a.target)))
    return list(out.values())


def plan_ties(gm: Any, plan: Plan) -> tuple[TiedBuffer, ...]:
    """The tensors of ``gm`` tied across ``plan``'s stages, as the runtime's exchange holds
    them (:func:`pipetrain.stages.tied.tied_buffers` of the partition the workers build): their
    holders' STEPs meet for each one's all-reduce, which the prediction simulates."""
    from ..stages.partition import partition_graph
    from ..stages.tied import tied_buffers

    if plan.num_stages < 2:
        return ()
    part = partition_graph(gm, [list(s.nodes) for s in plan.stages])
    return tuple(tied_buffers(dict(gm.named_parameters(remove_duplicate=False)), part.tied))


def _is_parameter(gm: Any, target: str) -> bool:
    try:
        gm.get_parameter(target)
    except AttributeError:
        return False
    return True


def _plan_at(measured: AutoMeasurements, units: int, batch_size: int, workers: int, cal: Calibration,
             opts: Any, unit_prof: Profile) -> Plan:
    """The plan of the minibatch of ``units`` units of ``unit_prof`` (kept in the cache).
    Without a memory limit the dynamic program's answer is every schedule's, so it is solved
    under one memory rule and given ``opts``' (:func:`~pipetrain.plan.api.under_schedule`)."""
    from ..plan.api import under_schedule
    from ..plan.calibrated import plan_with_calibration

    scaled = scale_profile(unit_prof, units, batch_size)
    if opts.memory_limit is not None:
        return measured.plan(scaled, workers, cal, opts, lambda: plan_with_calibration(scaled, workers, cal, opts))
    solved = replace(opts, schedule="pipedream", microbatches=1)
    plan = measured.plan(scaled, workers, cal, solved, lambda: plan_with_calibration(scaled, workers, cal, solved))
    return under_schedule(plan, scaled, opts.schedule, opts.microbatches)


def _planned(unit_prof: Profile, plan_fn: Callable[[Profile], Plan], rehearsed: Candidate | None,
             timed_as_whole: Callable[[list[list[str]], Profile], Profile]) -> tuple[Plan, Profile]:
    """A pipeline candidate's plan and the unit profile it is made on: planned, its stages
    timed as a whole (``timed_as_whole``) to correct the node sums, planned again once
    (module docstring, 3); or, for a candidate ``rehearsed`` (5b), planned once on the
    profile scaled stage by stage to its rehearsed times."""
    from .stage_timing import refine_profile

    if rehearsed is not None and rehearsed.plan is not None:
        stages = [list(s.nodes) for s in rehearsed.plan.stages]
        prof = refine_profile(unit_prof, stages, rehearsed.rehearsed_stage_seconds)
        return plan_fn(prof), prof
    plan = plan_fn(unit_prof)
    lists = [list(s.nodes) for s in plan.stages]
    if len(lists) > 1:
        unit_prof = timed_as_whole(lists, unit_prof)
        again = plan_fn(unit_prof)
        plan = plan if _same(plan, again) else again
    return plan, unit_prof


def _same(a: Plan, b: Plan) -> bool:
    return [list(s.nodes) for s in a.stages] == [list(s.nodes) for s in b.stages] and a.replicas == b.replicas


def choose(model_at: ModelAt, *, batch_size: int, workers: int, optimizer: str = "sgd", momentum: float = 0.0,
           threads: int | None = None, model_name: str = "", calibration: Any = None,
           microbatches: int | None = None, repeats: int = 3,
           schedules: Sequence[str] | None = None,
           accept: Callable[[Candidate, Any], str | None] | None = None,
           cache: MeasurementCache | None = None, cache_key: Mapping[str, Any] | None = None,
           rehearse: Rehearse | None = None, malloc_tuned: bool = False,
           processes: RankProcesses | None = None) -> AutoChoice:
    """The fastest configuration of the model on ``workers`` ranks (module docstring).

    Args:
        model_at: ``samples -> (captured model, one unit of inputs)`` at that unit size.
        calibration: a Calibration, a file, ``"measure"``, or None (measured now on loopback
            with ``workers`` ranks).
        microbatches: the user's ``--microbatches``, if given (only that count is tried).
        schedules: candidate schedule names (default: every spec with ``auto``).
        accept: ``(candidate, captured model) -> None``, or why the run cannot use it (the
            caller's rules: step counts, tied weights, synchronous-only options).
        cache: where measurements are kept between runs (:mod:`pipetrain.auto.measured`);
            None: measure everything.
        cache_key: what identifies the model for the cache (its name and options); None:
            only the calibration is cached.
        rehearse: runs a candidate as its workers would (module docstring, 5); None: every
            prediction is the profile's.
        malloc_tuned: the caller times under the workers' allocator tuning
            (:func:`pipetrain.runtime.process.rss.workers_allocator`): part of the cache's key,
            so times measured under another allocator are measured again.
        processes: how a calibration measured now starts its ranks
            (:func:`pipetrain.cluster.measure.calibrate`); None: a fresh interpreter each.

    Raises:
        PlanError: when no candidate can run (one line naming why for each).
    """
    from ..errors import PipetrainError, PlanError
    from ..plan.api import PlanOptions
    from ..plan.calibrated import resolve_calibration
    from ..plan.cuts import split_by_config
    from ..profile import profiler
    from ..schedule import get_schedule
    from .stage_timing import refine_profile, stage_seconds

    t0 = time.monotonic()
    if workers < 2:
        raise PlanError(f"the automatic choice compares parallel configurations; it needs 2 or more workers, "
                        f"got {workers}")
    measured = AutoMeasurements(cache, cache_key, _cache_settings(optimizer, momentum, threads, repeats, malloc_tuned))
    cal = resolve_calibration(calibration)
    if cal is None:  # measured now (or earlier on this machine), at this run's rank count
        cal = measured.calibration(workers, lambda: _measure_calibration(workers, threads, processes))
    costs = f"{cal.where} costs ({cal.p2p.bandwidth_bits_per_second / 1e6:.4g} Mbit/s point-to-point)"
    names = list(schedules) if schedules is not None else _auto_names()
    steps_of = _StepTimer(optimizer, momentum, measured)
    units_cache: dict[int, tuple[Any, tuple[Any, ...], Profile, dict[str, Any] | None]] = {}
    predictors: dict[int, _Predictor] = {}  # id(candidate) -> its prediction, to make again with measured compute

    def at(samples: int) -> tuple[Any, tuple[Any, ...], Profile, dict[str, Any] | None]:
        if samples not in units_cache:
            captured, inputs = model_at(samples)
            key = measured.profile_key(captured, samples)
            prof = measured.profile(key, lambda: profiler.profile_captured(
                captured, inputs, batch_size=samples, warmup=1, repeats=repeats, optimizer=optimizer,
                momentum=momentum, model_name=model_name, threads=threads, progress=True,
                held_share=1.0 / workers))  # a weightless capture: its check holds a stage's share at most
            units_cache[samples] = (captured, tuple(inputs), prof, key)
        return units_cache[samples]

    def timed_as_whole(captured: Any, inputs: Any, key: Any, lists: list[list[str]], unit_prof: Profile) -> Profile:
        """``unit_prof`` corrected by the stages ``lists`` timed as a whole."""
        seconds = measured.stage_seconds(
            key, lists, lambda: stage_seconds(captured.gm, inputs, lists, 2, tensor_values=captured.tensor_values))
        return refine_profile(unit_prof, lists, seconds)

    def evaluate(name: str, spec: Any, m: int, rehearsed: Candidate | None = None) -> Candidate:
        """``name`` at ``m`` planned and predicted; ``rehearsed``: the same candidate, whose
        rehearsed stage times correct the unit profile it is planned on (5b)."""
        units = 1 if spec.unit == "minibatch" else m
        captured, inputs, unit_prof, key = at(batch_size // units)
        if spec.one_stage:  # the whole model is the stage: timed as a whole, like a pipeline's stages
            plan = split_by_config(captured, [workers], model_name, batch_size)
            unit_prof = timed_as_whole(captured, inputs, key, [list(s.nodes) for s in plan.stages], unit_prof)
        else:
            opts = PlanOptions(schedule=memory_rule_of(name), microbatches=m, use_all_workers=True)
            plan_fn = partial(_plan_at, measured, units, batch_size, workers, cal, opts)
            plan, unit_prof = _planned(unit_prof, plan_fn, rehearsed, partial(timed_as_whole, captured, inputs, key))
        why = _runnable(spec, plan, m, workers)
        if why is None and accept is not None:
            why = accept(Candidate(name, m, plan, None), captured)
        if why is not None:
            return Candidate(name, m, plan, None, why)
        try:
            tied = plan_ties(captured.gm, plan)
        except PipetrainError as e:  # the workers could not partition the graph so
            return Candidate(name, m, plan, None, str(e))
        predict = _Predictor.of(plan, scale_profile(unit_prof, units, batch_size), cal, name, m, captured.gm,
                                steps_of, tied, key)
        pred = predict()
        t = float(pred["time_per_minibatch"])
        out = Candidate(name, m, plan, t, stage_unit_seconds=tuple(pred["stage_unit_seconds"]),
                        profile_predicted_time=t)
        predictors[id(out)] = predict
        return out

    # Every timing here (profiles, stages as a whole, optimizer steps) at the workers' threads.
    with profiler.num_threads(threads):
        out = _each(names, workers, batch_size, microbatches, evaluate)
        if rehearse is not None:
            out = _rehearsed(out, rehearse, predictors, measured)
            out = _rebalanced(out, lambda c: evaluate(c.schedule, get_schedule(c.schedule), c.microbatches, c),
                              rehearse, predictors, measured)
    return AutoChoice(_best(out, "pass --schedule and --config instead"), out, costs, time.monotonic() - t0)


@dataclass(frozen=True)
class _Predictor:
    """One candidate's prediction (:func:`~pipetrain.simulate.calibrated.predict_run`), made
    again with measured compute after its rehearsal; ``key``: its profile's cache key."""

    plan: Plan
    profile: Profile
    cal: Calibration
    schedule: str
    microbatches: int
    step_time: list[float]
    tied: tuple[TiedBuffer, ...]
    key: dict[str, Any] | None
    rank_bytes: float  # a worker's predicted bytes under the schedule, the largest of the plan's stages

    @staticmethod
    def of(plan: Plan, profile: Profile, cal: Calibration, schedule: str, microbatches: int, gm: Any,
           steps_of: Callable[[Any, Sequence[str]], float], tied: tuple[TiedBuffer, ...],
           key: dict[str, Any] | None) -> _Predictor:
        """The predictor of ``plan`` on the captured graph ``gm`` (each stage's STEP timed by
        ``steps_of``; a worker's bytes by the planner's memory rule of ``schedule``)."""
        stages = [list(s.nodes) for s in plan.stages]
        return _Predictor(plan, profile, cal, schedule, microbatches, [steps_of(gm, n) for n in stages], tied, key,
                          rehearsal_bytes(plan, profile, schedule, microbatches))

    def __call__(self, measured: Sequence[MeasuredUnit] | None = None) -> dict[str, Any]:
        from ..simulate.calibrated import predict_run

        return predict_run(self.plan, self.profile, self.cal, self.schedule, microbatches=self.microbatches,
                           step_time=self.step_time, tied=self.tied, measured=measured)


def _rehearsed(out: list[Candidate], rehearse: Rehearse, predictors: Mapping[int, _Predictor],
               measured: AutoMeasurements) -> list[Candidate]:
    """``out`` with the fastest candidates rehearsed (module docstring, 5): in the order of
    their profile predictions, while one is within :data:`TIE_TOLERANCE` of the fastest
    rehearsed prediction so far (a profile leaves out the runtime's own work, so it predicts
    low: a candidate already slower than a rehearsed one by the profile stays slower), at most
    :data:`REHEARSALS`. A rehearsal that fails leaves its candidate's profile prediction, with why."""
    from ..errors import PipetrainError

    done: dict[int, Candidate] = {}
    best = math.inf
    order = sorted((c for c in out if c.predicted_time is not None and id(c) in predictors),
                   key=lambda c: c.predicted_time or 0.0)
    for c in order[:REHEARSALS]:
        if (c.predicted_time or 0.0) > best * (1.0 + TIE_TOLERANCE):
            break
        predict = predictors[id(c)]
        if predict.rank_bytes > REHEARSAL_MAX_BYTES:
            mib = predict.rank_bytes / 2**20
            done[id(c)] = replace(c, rehearsal_note=f"not rehearsed: a rank would hold {mib:.0f} MiB (weights, "
                                                    f"gradients, optimizer state, activations), above the "
                                                    f"{REHEARSAL_MAX_BYTES >> 20} MiB a rehearsal may hold here")
            continue
        what = {"schedule": c.schedule, "microbatches": c.microbatches,
                "stages": [list(s.nodes) for s in predict.plan.stages], "replicas": list(predict.plan.replicas),
                "runtime": dict(rehearse.settings)}
        try:
            units = measured.rehearsal(predict.key, what, predict.plan.num_stages, partial(_listed, rehearse, c))
            pred = predict(units)
        except (PipetrainError, RuntimeError, ValueError) as e:  # the candidate keeps its profile prediction
            done[id(c)] = replace(c, rehearsal_note=f"its rehearsal failed: {type(e).__name__}: {e}",
                                  rehearsal_failed=True)
            continue
        t = float(pred["time_per_minibatch"])
        done[id(c)] = replace(c, predicted_time=t, stage_unit_seconds=tuple(pred["stage_unit_seconds"]),
                              rehearsed=True, rehearsed_stage_seconds=tuple(u.compute for u in units),
                              rehearsed_imbalance=_imbalance(c.stage_unit_seconds, pred["stage_unit_seconds"]))
        best = min(best, t)
    return [done.get(id(c), c) for c in out]


def _imbalance(profiled: Sequence[Mapping[str, float]], rehearsed: Sequence[Mapping[str, float]]) -> float:
    """The largest over the smallest of each stage's rehearsed over profiled forward + backward."""
    ratios = [(r["forward"] + r["backward"]) / (p["forward"] + p["backward"])
              for p, r in zip(profiled, rehearsed) if p["forward"] + p["backward"] > 0]
    return max(ratios) / min(ratios) if ratios and min(ratios) > 0 else 1.0


def _rebalanced(out: list[Candidate], replan: Callable[[Candidate], Candidate], rehearse: Rehearse,
                predictors: Mapping[int, _Predictor], measured: AutoMeasurements) -> list[Candidate]:
    """``out`` with the fastest rehearsed pipeline planned again on its rehearsed stage times
    when its rehearsal moved them against each other beyond :data:`REBALANCE_TOLERANCE`
    (module docstring, 5b): the new plan is rehearsed, and it replaces the candidate when it
    rehearses faster. At most one more rehearsal."""
    pipelines = [c for c in out if c.rehearsed and c.plan is not None and c.plan.num_stages > 1]
    if not pipelines:
        return out
    c = min(pipelines, key=lambda x: x.predicted_time or 0.0)
    if c.rehearsed_imbalance <= 1.0 + REBALANCE_TOLERANCE or c.plan is None:
        return out
    from ..errors import PipetrainError

    try:
        again = replan(c)
    except (PipetrainError, RuntimeError, ValueError):  # the candidate as planned and rehearsed stands
        return out
    if again.predicted_time is None or again.plan is None or _same(again.plan, c.plan):
        return out
    (again,) = _rehearsed([again], rehearse, predictors, measured)
    if not again.rehearsed or (again.predicted_time or math.inf) >= (c.predicted_time or math.inf):
        return out
    cuts = "/".join(str(len(s.nodes)) for s in c.plan.stages)
    was = f"{c.config} ({cuts} nodes, {(c.predicted_time or 0.0) * 1e3:.2f} ms rehearsed)"
    return [replace(again, replanned_from=was) if x is c else x for x in out]


def rehearsal_bytes(plan: Plan, profile: Profile, schedule: str, microbatches: int) -> float:
    """What rehearsing ``plan``'s largest rank holds in the launcher: a worker's bytes by the
    planner's memory rule for ``schedule`` (plan/stage_memory.py: every weight version it
    keeps, their gradients, the optimizer's state, the units in flight), compared with
    :data:`REHEARSAL_MAX_BYTES`. ``profile``: one minibatch's."""
    from ..plan.stage_memory import stage_memory

    return max(stage_memory(profile, plan, memory_rule_of(schedule), microbatches))


def _listed(rehearse: Rehearse, candidate: Candidate) -> list[MeasuredUnit]:
    return list(rehearse(candidate))


def _cache_settings(optimizer: str, momentum: float, threads: int | None, repeats: int,
                      malloc_tuned: bool) -> dict[str, Any]:
    """What the choice's measurements depend on besides the model (the cache's key)."""
    import torch

    from ..profile.profiler import fast_counts

    return {"optimizer": optimizer, "momentum": momentum, "repeats": fast_counts(1, repeats),
            "threads": threads if threads is not None else torch.get_num_threads(), "device": "cpu",
            "malloc": "workers' tuning" if malloc_tuned else "glibc defaults"}


def _measure_calibration(workers: int, threads: int | None, processes: RankProcesses | None) -> Calibration:
    """A loopback calibration measured now at ``workers`` ranks of ``threads`` threads."""
    from ..plan.calibrated import MEASURE, resolve_calibration

    cal = resolve_calibration(MEASURE, ranks=workers, threads=threads, processes=processes)
    assert cal is not None
    return cal


def choose_on_profile(profile: Profile, workers: int, calibration: Any, *, microbatches: int | None = None,
                      schedules: Sequence[str] | None = None, memory_limit: float | None = None,
                      max_states: int = 2048) -> AutoChoice:
    """The fastest configuration of a profiled model on ``workers`` ranks (``pipetrain plan``).

    The same candidates, planner and simulator as :func:`choose`, on a given profile
    (``profile.batch_size`` is the minibatch) instead of one measured here: a unit of
    ``batch / m`` samples is taken to cost ``1/m`` of the minibatch (one profile cannot say
    how per-node times change with the unit size; ``train --schedule auto`` profiles each), and
    optimizer steps are not counted (a profile holds no step times). ``memory_limit`` (bytes
    per worker) is checked with each schedule's own memory rule.

    Raises:
        PlanError: no batch size in the profile, fewer than 2 workers, or no candidate runnable.
    """
    from ..errors import PlanError
    from ..plan.api import PlanOptions
    from ..plan.baselines import data_parallel_plan
    from ..plan.calibrated import calibrated_params, calibrated_topology, plan_with_calibration, resolve_calibration
    from ..plan.stage_memory import stage_memory
    from ..simulate.calibrated import predict_run

    t0 = time.monotonic()
    if workers < 2:
        raise PlanError(f"the automatic choice compares parallel configurations; it needs 2 or more workers, "
                        f"got {workers}")
    if not profile.batch_size:
        raise PlanError(f"profile of {profile.model!r} has no batch size; the automatic choice needs the minibatch "
                        f"size: pass --batch-size")
    cal = resolve_calibration(calibration)
    if cal is None:
        raise PlanError("the automatic choice needs measured link costs: pass --calibration FILE (from "
                        "`pipetrain calibrate --output FILE`) or --calibration measure")
    costs = f"{cal.where} costs ({cal.p2p.bandwidth_bits_per_second / 1e6:.4g} Mbit/s point-to-point)"
    names = list(schedules) if schedules is not None else _auto_names()
    batch = int(profile.batch_size)

    def evaluate(name: str, spec: Any, m: int) -> Candidate:
        rule = memory_rule_of(name)
        if spec.one_stage:
            plan = data_parallel_plan(profile, calibrated_topology(cal, workers), "pipetrain",
                                      calibrated_params(cal))
            held = stage_memory(profile, plan, schedule=rule, microbatches=m)
            if memory_limit is not None and max(held) > memory_limit:
                return Candidate(name, m, plan, None, f"needs {max(held) / 2**30:.2f} GiB per worker, over the "
                                                      f"{memory_limit / 2**30:.2f} GiB limit")
        else:
            opts = PlanOptions(schedule=rule, microbatches=m, use_all_workers=True, memory_limit=memory_limit,
                               max_states=max_states)
            plan = plan_with_calibration(profile, workers, cal, opts)
        why = _runnable(spec, plan, m, workers, exact=False)  # a plan may leave workers idle (the DP's optimum)
        if why is not None:
            return Candidate(name, m, plan, None, why)
        pred = predict_run(plan, profile, cal, name, microbatches=m)
        return Candidate(name, m, plan, float(pred["time_per_minibatch"]),
                         stage_unit_seconds=tuple(pred["stage_unit_seconds"]))

    out = _each(names, workers, batch, microbatches, evaluate)
    return AutoChoice(_best(out, "pass --schedule instead, or raise --memory"), out, costs, time.monotonic() - t0,
                      compute=f"the profile of {profile.model or 'the model'} (batch {batch})")


def _auto_names() -> list[str]:
    from ..schedule import SCHEDULES

    return [n for n, s in SCHEDULES.items() if s.auto]


def memory_rule_of(name: str) -> str:
    """The planner's memory rule for schedule ``name``: its own, or (one without, such as
    zerobubble or dp) the 1F1B rule's schedule."""
    from ..plan.stage_memory import MEMORY_SCHEDULES
    from ..schedule import SCHEDULES

    return name if name in MEMORY_SCHEDULES else next(
        n for n in MEMORY_SCHEDULES if SCHEDULES[n].memory_rule == "one_f_one_b")


def _runnable(spec: Any, plan: Plan, m: int, workers: int, exact: bool = True) -> str | None:
    """Why ``plan`` cannot run ``spec`` at ``m`` on ``workers`` ranks (``exact``: all of them;
    else at most), or None (building the schedule raises when ``m`` breaks its rules)."""
    ranks = int(spec.ranks_needed(plan.replicas, {}))
    if ranks != workers and (exact or ranks > workers):
        return f"the plan {plan.config} does not use {workers} ranks"
    spec.build(plan.replicas, m, int(spec.steps_period(plan.replicas)))
    return None


def _each(names: Sequence[str], workers: int, batch: int, microbatches: int | None,
          evaluate: Callable[[str, Any, int], Candidate]) -> list[Candidate]:
    """Every candidate (module docstring, 2) evaluated; one that cannot be planned or built is
    kept with why."""
    from ..schedule import get_schedule

    out: list[Candidate] = []
    for name in names:
        spec = get_schedule(name)
        for m in microbatch_candidates(spec, workers, batch, microbatches):
            try:
                out.append(evaluate(name, spec, m))
            except Exception as e:  # noqa: BLE001 - a candidate that cannot be planned or built is skipped, said why
                out.append(Candidate(name, m, None, None, f"{type(e).__name__}: {e}"))
    return out


def _best(out: list[Candidate], fix: str) -> Candidate:
    """The pick among the runnable candidates: those rehearsed, and those too large to
    rehearse, when there are any (a profile predicts low: a candidate left out for its
    profile prediction is not compared with rehearsed ones, and one whose rehearsal failed,
    running its workers' own code, is not chosen over one that ran); else all of them."""
    from ..errors import PlanError

    pool = compared(out)
    if not pool:
        raise PlanError("no configuration could be planned for --schedule auto: "
                        + "; ".join(c.line() for c in out) + f"; {fix}")
    return pick(pool)


def compared(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates the pick compares (module docstring, 6): the runnable ones rehearsed or
    too large to rehearse, when there are any, else every runnable one."""
    runnable = [c for c in candidates if c.predicted_time is not None]
    tried = [c for c in runnable if c.rehearsed or (c.rehearsal_note and not c.rehearsal_failed)]
    return tried or runnable


#: Predictions closer than this to the fastest are a tie (module docstring, 6): the
#: simulator's error against measured runs is 2-12% here (docs/performance.md), so a smaller
#: difference says nothing about which runs faster.
TIE_TOLERANCE = 0.05


_SEMANTICS = ("data parallel", "synchronous", "asynchronous")


def _semantics(c: Candidate) -> int:
    """0 data parallelism (one process's result), 1 a synchronous pipeline, 2 an asynchronous one."""
    from ..schedule import get_schedule

    spec = get_schedule(c.schedule)
    return 0 if spec.one_stage else 1 if spec.synchronous else 2


def pick(runnable: Sequence[Candidate], tolerance: float = TIE_TOLERANCE) -> Candidate:
    """The choice among runnable candidates: of those predicted within ``tolerance`` of the
    fastest, the simplest semantics (data parallelism, then a synchronous schedule, then an
    asynchronous one: stale weights cost statistical efficiency, PipeDream section 3.3 and
    2BW section 3), and among those the fastest prediction."""
    fastest = min(c.predicted_time or 0.0 for c in runnable)
    tied = [c for c in runnable if (c.predicted_time or 0.0) <= fastest * (1.0 + tolerance)]
    return min(tied, key=lambda c: (_semantics(c), c.predicted_time or 0.0))


def summary_lines(choice: AutoChoice) -> list[str]:
    """Lines for the log: the choice, then every candidate."""
    return [choice.note()] + [f"  {c.line()}" for c in choice.candidates]

