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

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..plan.cuts import split_by_config
from ..plan.types import Plan, Topology

if TYPE_CHECKING:
    from ..graph.capture import CapturedModel

__all__ = ["quick_plan", "LOCAL_BANDWIDTH"]

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
        ``(plan, note)``: the plan, and one line saying where it came from.
    """
    from ..errors import PipetrainError
    from ..plan.api import PlanOptions
    from ..plan.api import plan as run_planner
    from ..plan.calibrated import plan_with_calibration, resolve_calibration
    from ..schedule import get_schedule

    cal = resolve_calibration(calibration)  # a bad file raises: the user asked for it
    fallback = split_by_config(captured, [1] * workers, model_name, batch_size)
    try:
        from ..profile.profiler import profile_captured

        prof = profile_captured(captured, inputs, batch_size=batch_size, warmup=1, repeats=2, optimizer=optimizer,
                                momentum=momentum, model_name=model_name, threads=threads)
        opts = PlanOptions(schedule=_memory_model(schedule), microbatches=microbatches)
        if cal is not None:  # measured costs: stage times measured as a whole correct the per-node profile
            from .stage_timing import refined_plan

            chosen, _ = refined_plan(prof, captured.gm, tuple(inputs),
                                     lambda pr: plan_with_calibration(pr, workers, cal, opts))
        else:
            chosen = run_planner(prof, Topology.flat(workers, LOCAL_BANDWIDTH), opts)
    except (PipetrainError, Exception) as e:  # noqa: BLE001 - any profile/planner failure falls back
        return fallback, f"balanced split into {workers} stages (planner failed: {type(e).__name__}: {e})"
    spec = get_schedule(schedule)
    options = dict(schedule_options or {})
    try:  # the schedule must run the plan's replicas on exactly `workers` ranks
        usable = spec.ranks_needed(chosen.replicas, options) == workers
        if usable:
            # one period of steps: pipedream steps a stage with r replicas once per r minibatches
            spec.build(chosen.replicas, microbatches, int(spec.steps_period(chosen.replicas)), **options)
    except PipetrainError:
        usable = False
    if not usable:
        return fallback, (f"balanced split into {workers} stages (the planner's plan {chosen.config} does not run "
                          f"on exactly {workers} workers with {schedule})")
    costs = (f"calibrated costs ({cal.where}, {cal.p2p.bandwidth_bits_per_second / 1e6:.4g} Mbit/s)"
             if cal is not None else "default costs")
    return chosen, f"planner ({chosen.config}) from a quick profile on this machine and {costs}"
