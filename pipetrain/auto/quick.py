"""``pipetrain train`` without ``--plan``: profile the model quickly on this machine and plan.

:func:`quick_plan` is what the launcher calls when a run names only its number of workers:
a short profile of the captured model (one warm-up, two repeats), then :func:`~pipetrain.plan.api.plan`
on a flat topology of ``workers`` local processes. Any failure of the profile or the planner,
or a plan the run's schedule cannot execute on exactly ``workers`` ranks, falls back to a
balanced split into ``workers`` single-replica stages (:func:`~pipetrain.plan.cuts.split_by_config`).
The returned note says which happened (it is recorded in the run's outputs).

With ``calibration`` (``train --calibration FILE``: a file from ``pipetrain calibrate
--output``, or ``measure`` for a loopback measurement now) the planner plans on the measured
link bandwidth, latency and all-reduce cost (:mod:`pipetrain.plan.calibrated`), and the
chosen stages are timed as a whole to correct the per-node profile and re-plan
(:func:`pipetrain.auto.stage_timing.refined_plan`); without, on
a flat topology at :data:`LOCAL_BANDWIDTH` and the ``pipetrain`` model's default constants.
A calibration that cannot be read is the user's error and is raised, not fallen back from.

Measured times differ from run to run, so the answer is computed once, in the launcher (or
by rank 0 under an outer ``torchrun``), and handed to every worker.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..plan.cuts import split_by_config
from ..plan.types import Plan, Topology

if TYPE_CHECKING:
    from ..graph.capture import CapturedModel
    from ..plan.api import PlanOptions
    from ..profile.types import Profile

__all__ = ["quick_plan", "explain_choice", "LOCAL_BANDWIDTH"]

#: Bandwidth assumed between local worker processes when the planner is asked (bytes/s).
LOCAL_BANDWIDTH = 2e9


def _memory_model(schedule: str) -> str:
    """The schedule whose memory rule the planner applies: the run's own when the planner has
    one, else the first flushed 1F1B schedule's (``flush``)."""
    from ..plan.stage_memory import MEMORY_SCHEDULES
    from ..schedule import SCHEDULES

    if schedule in MEMORY_SCHEDULES:
        return schedule
    return next(n for n in MEMORY_SCHEDULES if SCHEDULES[n].flushes and SCHEDULES[n].memory_rule == "one_f_one_b")


def quick_plan(captured: CapturedModel, inputs: tuple[Any, ...], *, batch_size: int, workers: int,
               schedule: str, microbatches: int, schedule_options: Mapping[str, Any] | None = None,
               optimizer: str = "sgd", momentum: float = 0.0, threads: int | None = None,
               model_name: str = "", calibration: Any = None) -> tuple[Plan, str]:
    """The planner's plan for ``workers`` local ranks, from a quick profile; or a balanced split.

    Args:
        captured: the captured model (its nodes are the plan's).
        inputs: one minibatch of inputs (``batch_size`` samples) to profile with.
        schedule: the schedule the run executes; the planner's memory model uses it when it
            has one for it (``plan.stage_memory.MEMORY_SCHEDULES``), else a flushed 1F1B schedule's.
        microbatches: units per minibatch of the run.
        schedule_options: the run's schedule options (checked by building one step).
        calibration: None, a calibration file's path, ``"measure"``, or a
            :class:`~pipetrain.cluster.calibration.Calibration`: plan on measured costs.

    Returns:
        ``(plan, note)``: the plan, and one line saying where it came from; a plan of the
        planner's adds what it chose and the predicted times that decided it
        (:func:`explain_choice`).
    """
    from ..errors import PipetrainError
    from ..plan.api import PlanOptions
    from ..plan.calibrated import resolve_calibration

    cal = resolve_calibration(calibration)  # a bad file raises: the user asked for it
    fallback = split_by_config(captured, [1] * workers, model_name, batch_size)
    runs = _Runs(schedule, workers, microbatches, dict(schedule_options or {}))
    try:
        from ..profile.profiler import profile_captured

        prof = profile_captured(captured, inputs, batch_size=batch_size, warmup=1, repeats=2, optimizer=optimizer,
                                momentum=momentum, model_name=model_name, threads=threads,
                                held_share=1.0 / workers)  # a weightless capture: a stage's share at most
        opts = PlanOptions(schedule=_memory_model(schedule), microbatches=microbatches)
        planner = _planner(workers, cal)
        if cal is not None:  # measured costs: stage times measured as a whole correct the per-node profile
            from .stage_timing import refined_plan

            chosen, prof = refined_plan(prof, captured.gm, tuple(inputs), lambda pr: planner(pr, opts),
                                        tensor_values=captured.tensor_values)
        else:
            chosen = planner(prof, opts)
    except (PipetrainError, Exception) as e:  # noqa: BLE001 - any profile/planner failure falls back
        return fallback, f"balanced split into {workers} stages (planner failed: {type(e).__name__}: {e})"
    if not runs(chosen):
        return fallback, (f"balanced split into {workers} stages (the planner's plan {chosen.config} does not run "
                          f"on exactly {workers} workers with {schedule})")
    costs = (f"calibrated costs ({cal.where}, {cal.p2p.bandwidth_bits_per_second / 1e6:.4g} Mbit/s)"
             if cal is not None else "default costs")
    pipeline = _fastest_pipeline(prof, opts, planner, runs) if chosen.num_stages == 1 else None
    return chosen, (f"planner ({chosen.config}) from a quick profile on this machine and {costs}: "
                    f"{explain_choice(chosen, pipeline, schedule, workers)}")


Planner = Callable[["Profile", "PlanOptions"], Plan]


def _planner(workers: int, cal: Any) -> Planner:
    """The planner on ``workers`` local ranks: on the calibration's costs, else on a flat
    topology at :data:`LOCAL_BANDWIDTH` with the default constants."""
    from ..plan.api import plan as run_planner
    from ..plan.calibrated import plan_with_calibration

    if cal is not None:
        return lambda prof, opts: plan_with_calibration(prof, workers, cal, opts)
    return lambda prof, opts: run_planner(prof, Topology.flat(workers, LOCAL_BANDWIDTH), opts)


@dataclass(frozen=True)
class _Runs:
    """Whether the run's schedule executes a plan's replicas on exactly ``workers`` ranks."""

    schedule: str
    workers: int
    microbatches: int
    options: dict[str, Any]

    def __call__(self, plan: Plan) -> bool:
        from ..errors import PipetrainError
        from ..schedule import get_schedule

        spec = get_schedule(self.schedule)
        try:
            if spec.ranks_needed(plan.replicas, self.options) != self.workers:
                return False
            # one period of steps: pipedream steps a stage with r replicas once per r minibatches
            spec.build(plan.replicas, self.microbatches, int(spec.steps_period(plan.replicas)), **self.options)
        except PipetrainError:
            return False
        return True


def _fastest_pipeline(prof: Profile, opts: PlanOptions, planner: Planner, runs: _Runs) -> Plan | None:
    """The planner's fastest plan of two or more stages that the run's schedule executes
    (``None``: none does), on the same profile and costs as the plan chosen."""
    from dataclasses import replace

    from ..errors import PipetrainError

    best: Plan | None = None
    for stages in range(2, runs.workers + 1):
        try:
            candidate = planner(prof, replace(opts, num_stages=stages))
        except PipetrainError:  # more stages than layers, or than the memory allows
            continue
        if candidate.predicted_time is None or not runs(candidate):
            continue
        if best is None or candidate.predicted_time < (best.predicted_time or math.inf):
            best = candidate
    return best


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.3f} ms"


def explain_choice(chosen: Plan, pipeline: Plan | None, schedule: str, workers: int) -> str:
    """What the planner chose for ``schedule`` on ``workers`` ranks and the predicted times per
    minibatch that decided it. One stage on every worker (data parallelism) is compared with
    ``pipeline``, the fastest pipeline the schedule runs, and names the ``--config`` that trains
    it; a pipeline is compared with data parallelism (the planner's figure, PipeDream section 3.1).

    >>> from pipetrain.plan.types import Stage
    >>> dp = Plan(stages=[Stage(nodes=["a", "b"], replicas=2)], predicted_time=0.001)
    >>> p = Plan(stages=[Stage(nodes=["a"]), Stage(nodes=["b"])], predicted_time=0.002)
    >>> explain_choice(dp, p, "pipedream", 2)
    'one stage on 2 replicas (data parallelism) is predicted 1.000 ms per minibatch under pipedream, the fastest \
pipeline (1-1) 2.000 ms; pass --config 1-1 to train that pipeline'
    """
    if chosen.num_stages == 1:
        head = (f"one stage on {chosen.stages[0].replicas} replicas (data parallelism) is predicted "
                f"{_ms(chosen.predicted_time)} per minibatch under {schedule}")
        if pipeline is None:
            return f"{head}; no pipeline of 2 or more stages runs on {workers} workers with {schedule}"
        return (f"{head}, the fastest pipeline ({pipeline.config}) {_ms(pipeline.predicted_time)}; "
                f"pass --config {pipeline.config} to train that pipeline")
    return (f"{chosen.num_stages} stages are predicted {_ms(chosen.predicted_time)} per minibatch under {schedule}, "
            f"data parallelism {_ms(chosen.data_parallel_time)}; --config names another configuration")
