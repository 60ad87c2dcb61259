"""The planner and the simulator on measured communication costs (a calibration file).

A :class:`~pipetrain.cluster.calibration.Calibration` (``pipetrain calibrate --output FILE``)
holds two fits of ``t(S) = latency + S / bandwidth``: one point-to-point message between two
ranks, and one all-reduce of an ``S``-byte buffer over ``allreduce_ranks`` ranks. This module
turns them into what the planner's ``pipetrain`` cost model and the simulator need:

- :func:`calibrated_topology`: a flat topology of ``workers`` at the measured point-to-point
  bandwidth (the cut terms ``X / B``);
- :func:`calibrated_params`: :class:`~pipetrain.plan.cost.CostParams` with the measured
  point-to-point latency (``alpha`` per message), the ring all-reduce's per-link bandwidth
  (``Calibration.allreduce_bus_bandwidth``) and per-step latency (the measured all-reduce
  latency over its ``2 (n-1)`` ring steps), and ``overlap = 0``: the runtime starts a stage's
  all-reduce after the minibatch's last backward (one flat buffer, ``ALLREDUCE`` right before
  ``STEP`` in every schedule), so no backward time hides it;
- :func:`plan_with_calibration`: :func:`~pipetrain.plan.api.plan` with both;
- :class:`CalibratedStageCosts` / :func:`calibrated_costs`: the simulator's costs of a plan
  with transfers at ``latency + bytes / bandwidth`` and all-reduces at the calibrated ring
  time, and :func:`predict_run`: the simulated time per minibatch of a run and its bytes per
  sample (:mod:`pipetrain.plan.traffic`).

So the predicted all-reduce of ``P`` bytes over ``m`` ranks is::

    allreduce(P, m) = 2 (m-1)/m * P / B_bus + 2 (m-1) * alpha_step
    B_bus       = allreduce bandwidth * 2 (n-1) / n        (n = ranks measured)
    alpha_step  = allreduce latency / (2 (n-1))

which is exactly the measured fit for ``m = n``. What the model leaves out is listed in
``docs/planner.md`` ("Calibrated costs").
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import PlanError
from ..simulate.costs import StageCosts
from .cost import CostParams
from .types import Plan, Topology

if TYPE_CHECKING:
    from ..cluster.calibration import Calibration
    from ..profile.types import Profile

__all__ = ["MEASURE", "resolve_calibration", "calibrated_params", "calibrated_topology", "plan_with_calibration",
           "CalibratedStageCosts", "calibrated_costs", "predict_run", "ring_step_latency"]

#: ``--calibration measure``: measure on loopback now instead of reading a file.
MEASURE = "measure"


def resolve_calibration(value: str | Path | Calibration | None, ranks: int = 2) -> Calibration | None:
    """A calibration from a file path, ``"measure"`` (``ranks`` ranks on loopback, now, so the
    all-reduce fit is at that count), or as given.

    Raises CalibrationError (a PipetrainError) when the file is missing or malformed.
    """
    from ..cluster.calibration import Calibration, load_calibration

    if value is None or isinstance(value, Calibration):
        return value
    if str(value) == MEASURE:
        from ..cluster.calibrate import calibrate

        return calibrate(None, ranks=ranks)
    return load_calibration(value)


def ring_step_latency(cal: Calibration) -> float:
    """Seconds per ring step: the measured all-reduce latency over its ``2 (n-1)`` steps."""
    n = max(int(cal.allreduce_ranks), 2)
    return cal.allreduce.latency_seconds / (2.0 * (n - 1))


def calibrated_params(cal: Calibration, minibatches: int = 100) -> CostParams:
    """The ``pipetrain`` cost model's constants from a calibration (module docstring)."""
    return CostParams(latency=cal.p2p.latency_seconds, overlap=0.0, minibatches=minibatches,
                      allreduce_bandwidth=cal.allreduce_bus_bandwidth, allreduce_latency=ring_step_latency(cal))


def calibrated_topology(cal: Calibration, workers: int, memory_per_worker: float | None = None) -> Topology:
    """A flat topology of ``workers`` at the calibration's point-to-point bandwidth."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise PlanError(f"workers must be an integer >= 1, got {workers!r}; pass the number of worker processes")
    return cal.topology(workers, memory_per_worker)


def plan_with_calibration(profile: Profile, workers: int, cal: Calibration, options: Any = None) -> Plan:
    """:func:`pipetrain.plan.api.plan` on ``workers`` with the calibrated topology and costs.

    ``options`` (a PlanOptions) keeps its other fields; its cost model must be ``pipetrain``
    (the published ``pipedream`` formula has no latency or all-reduce constants to calibrate;
    only its bandwidth would change).
    """
    from .api import PlanOptions, plan

    opts = options if options is not None else PlanOptions()
    if opts.cost_model != "pipetrain":
        raise PlanError(f"a calibration sets the 'pipetrain' cost model's constants, but cost model "
                        f"{opts.cost_model!r} was asked for; drop --cost-model or the calibration")
    opts = replace(opts, cost_params=calibrated_params(cal, opts.cost_params.minibatches))
    result = plan(profile, calibrated_topology(cal, workers), opts)
    result.extra["calibration"] = calibration_summary(cal)
    return result


def calibration_summary(cal: Calibration) -> dict[str, Any]:
    """The figures the planner used, for ``Plan.extra`` and reports."""
    return {"where": cal.where, "hosts": cal.hosts, "measured_at": cal.measured_at,
            "bandwidth_limit_bits_per_second": cal.bandwidth_limit_bits_per_second,
            "p2p_latency_seconds": cal.p2p.latency_seconds,
            "p2p_bandwidth_bytes_per_second": cal.p2p.bandwidth_bytes_per_second,
            "allreduce_bus_bandwidth_bytes_per_second": cal.allreduce_bus_bandwidth,
            "allreduce_step_latency_seconds": ring_step_latency(cal)}


# -- the simulator on calibrated costs ------------------------------------------------------
@dataclass
class CalibratedStageCosts(StageCosts):
    """The simulator's costs with the calibrated ring all-reduce:
    ``2 (r-1)/r * P / allreduce_bandwidth + 2 (r-1) * allreduce_step_latency``."""

    allreduce_bandwidth: float = float("inf")
    allreduce_step_latency: float = 0.0

    def allreduce_time(self, stage: int, ranks: Sequence[int]) -> float:
        r = len(ranks)
        nbytes = self.stages[stage].parameter_bytes
        if r <= 1 or nbytes <= 0:
            return 0.0
        return 2 * (r - 1) / r * nbytes / self.allreduce_bandwidth + 2 * (r - 1) * self.allreduce_step_latency


def calibrated_costs(plan: Plan, profile: Profile, cal: Calibration, units: int = 1,
                     step_time: float | Sequence[float] = 0.0) -> CalibratedStageCosts:
    """The simulator's costs of ``plan`` from ``profile`` on the calibrated network.

    Transfers take ``p2p latency + bytes / p2p bandwidth`` (every pair of ranks on its own
    full-duplex link); all-reduces the calibrated ring time (module docstring).
    ``step_time``: seconds of one optimizer step, for every stage or one per stage.
    """
    if isinstance(step_time, (int, float)):
        steps = [float(step_time)] * plan.num_stages
    else:
        steps = [float(x) for x in step_time]
    if len(steps) != plan.num_stages or any(not 0 <= x < float("inf") for x in steps):
        raise PlanError(f"step_time needs one finite value >= 0 or one per stage ({plan.num_stages}), "
                        f"got {step_time!r}")
    base = StageCosts.from_plan(plan, profile, calibrated_topology(cal, max(plan.num_workers, 1)), units=units,
                                latency=cal.p2p.latency_seconds)
    return CalibratedStageCosts(stages=[replace(c, step_time=x) for c, x in zip(base.stages, steps)],
                                bandwidth=base.bandwidth, latency=base.latency, topology=base.topology,
                                extra=dict(base.extra), allreduce_bandwidth=cal.allreduce_bus_bandwidth,
                                allreduce_step_latency=ring_step_latency(cal))


def predict_run(plan: Plan, profile: Profile, cal: Calibration, schedule: str, *, microbatches: int | None = None,
                steps: int = 8, options: Mapping[str, Any] | None = None,
                step_time: float | Sequence[float] = 0.0) -> dict[str, Any]:
    """Simulate ``schedule`` on ``plan`` with calibrated costs: time per minibatch and bytes.

    ``profile.batch_size`` is the minibatch; a microbatched schedule cuts it into
    ``microbatches`` units (default: the schedule's own default for the plan's replicas).
    Returns ``{"time_per_minibatch", "samples_per_second", "bytes_per_sample" (by kind and
    total), "schedule", "replicas", "microbatches", "steps"}``.
    """
    from ..schedule import get_schedule
    from ..simulate import simulate
    from .traffic import bytes_per_sample, plan_traffic

    if not profile.batch_size:
        raise PlanError(f"profile of {profile.model!r} has no batch size; profile with one to predict a run")
    spec = get_schedule(schedule)
    opts = dict(options or {})
    reps = list(plan.replicas)
    if microbatches is None:
        ranks = spec.rank_replicas(reps, opts)
        microbatches = int(spec.default_microbatches(len(ranks), ranks))
    period = spec.steps_period(reps)
    steps = max(period, -(-steps // period) * period)  # pipedream: a multiple of every replica count
    sched = spec.build(reps, microbatches, steps, **opts)
    units = max(1, int(sched.microbatches))
    costs = calibrated_costs(plan, profile, cal, units=units, step_time=step_time)
    sim = simulate(sched, costs)
    traffic = plan_traffic(plan, profile, sched, max(1, profile.batch_size // units))
    t = sim.time_per_minibatch
    return {"schedule": spec.name, "replicas": reps, "microbatches": units, "steps": steps,
            "time_per_minibatch": t, "samples_per_second": profile.batch_size / t if t > 0 else None,
            "bytes_per_sample": bytes_per_sample(traffic, float(profile.batch_size) * steps)}
