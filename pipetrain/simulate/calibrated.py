"""The simulator on measured communication costs (a calibration file).

- :class:`CalibratedStageCosts` / :func:`calibrated_costs`: the simulator's costs of a plan
  with transfers at ``latency + bytes / bandwidth`` (the calibration's point-to-point fit) and
  all-reduces over the calibration's rank count at its measured means by size
  (:func:`~pipetrain.cluster.calibration.measured_curve`, linear between sizes), over other
  rank counts at the calibrated ring time (:mod:`pipetrain.plan.calibrated`)::

      allreduce(P, r) = 2 (r-1)/r * P / B_bus + 2 (r-1) * alpha_step

- Compute: the profile's node times and the optimizer steps ``x compute_slowdown`` (the
  calibration's measure of how much slower a rank computes while every rank of its host
  does, :mod:`pipetrain.cluster.calibration`).
- :func:`predict_run`: the simulated time per minibatch of a run and its bytes per sample
  (:func:`pipetrain.plan.traffic.plan_traffic`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..cluster.calibration import Curve, curve_seconds
from ..errors import PlanError
from ..plan.calibrated import calibrated_topology, ring_step_latency, slowed
from ..plan.traffic import plan_traffic
from ..plan.types import Plan
from ..schedule.registry import get_schedule
from ..schedule.traffic import TiedBuffer, bytes_per_sample
from .costs import MeasuredUnit, StageCost, StageCosts
from .engine import simulate

if TYPE_CHECKING:
    from ..cluster.calibration import Calibration
    from ..profile.types import Profile

__all__ = ["CalibratedStageCosts", "calibrated_costs", "predict_run"]


@dataclass
class CalibratedStageCosts(StageCosts):
    """The simulator's costs with the calibrated all-reduce: over as many ranks as the
    calibration measured (``curve_ranks``), its measured means by size (``allreduce_curve``,
    :func:`~pipetrain.cluster.calibration.measured_curve`); over other counts, or without
    samples, the ring ``2 (r-1)/r * P / allreduce_bandwidth + 2 (r-1) * allreduce_step_latency``."""

    allreduce_bandwidth: float = float("inf")
    allreduce_step_latency: float = 0.0
    allreduce_curve: Curve = ()
    curve_ranks: int = 0

    def collective_time(self, nbytes: float, ranks: Sequence[int]) -> float:
        r = len(ranks)
        if r <= 1 or nbytes <= 0:
            return 0.0
        per_byte = 2 * (r - 1) / r / self.allreduce_bandwidth
        if self.allreduce_curve and r == self.curve_ranks:
            return curve_seconds(self.allreduce_curve, nbytes, per_byte)
        return nbytes * per_byte + 2 * (r - 1) * self.allreduce_step_latency


def calibrated_costs(plan: Plan, profile: Profile, cal: Calibration, units: int = 1,
                     step_time: float | Sequence[float] = 0.0,
                     tied: Sequence[TiedBuffer] = (),
                     measured: Sequence[MeasuredUnit] | None = None) -> CalibratedStageCosts:
    """The simulator's costs of ``plan`` from ``profile`` on the calibrated network.

    Transfers take ``p2p latency + bytes / p2p bandwidth`` (every pair of ranks on its own
    full-duplex link); all-reduces the calibrated ring time (module docstring).
    ``step_time``: seconds of one optimizer step, for every stage or one per stage.
    ``tied``: tensors tied across stages (:attr:`StageCosts.tied`), all-reduced at the
    calibrated ring time. ``measured``: every stage's compute as its worker runs it (a
    rehearsal, :class:`~pipetrain.simulate.costs.MeasuredUnit`) in place of the profile's;
    a measured STEP in place of ``step_time``.
    """
    if isinstance(step_time, (int, float)):
        steps = [float(step_time)] * plan.num_stages
    else:
        steps = [float(x) for x in step_time]
    if len(steps) != plan.num_stages or any(not 0 <= x < float("inf") for x in steps):
        raise PlanError(f"step_time needs one finite value >= 0 or one per stage ({plan.num_stages}), "
                        f"got {step_time!r}")
    base = StageCosts.from_plan(plan, slowed(profile, cal.compute_slowdown),
                                calibrated_topology(cal, max(plan.num_workers, 1)), units=units,
                                latency=cal.p2p.latency_seconds)
    slow = cal.compute_slowdown
    stages = [replace(c, step_time=x) for c, x in zip(base.stages, steps)]
    if measured is not None:  # measured alone: compute and STEP x slow, as the profile's are
        stages = [_slowed(c, slow) for c in replace(base, stages=stages).with_measured(measured).stages]
    else:
        stages = [replace(c, step_time=c.step_time * slow) for c in stages]
    return CalibratedStageCosts(stages=stages,
                                bandwidth=base.bandwidth, latency=base.latency, topology=base.topology,
                                extra=dict(base.extra), tied=tuple(tied),
                                allreduce_bandwidth=cal.allreduce_bus_bandwidth,
                                allreduce_step_latency=ring_step_latency(cal),
                                allreduce_curve=cal.allreduce_curve, curve_ranks=cal.allreduce_ranks)


def _slowed(c: StageCost, slow: float) -> StageCost:
    """A measured stage's compute and STEP ``x slow`` (measured alone; the run shares the cores)."""
    return replace(c, forward_time=c.forward_time * slow, backward_time=c.backward_time * slow,
                   step_time=c.step_time * slow) if slow != 1.0 else c


def predict_run(plan: Plan, profile: Profile, cal: Calibration, schedule: str, *, microbatches: int | None = None,
                steps: int = 8, options: Mapping[str, Any] | None = None,
                step_time: float | Sequence[float] = 0.0, tied: Sequence[TiedBuffer] = (),
                measured: Sequence[MeasuredUnit] | None = None) -> dict[str, Any]:
    """Simulate ``schedule`` on ``plan`` with calibrated costs: time per minibatch and bytes.

    ``profile.batch_size`` is the minibatch; a microbatched schedule cuts it into
    ``microbatches`` units (default: the schedule's own default for the plan's replicas).
    Returns ``{"time_per_minibatch", "samples_per_second", "bytes_per_sample" (by kind and
    total), "schedule", "replicas", "microbatches", "steps", "stage_unit_seconds"}``;
    ``stage_unit_seconds`` is each stage's simulated compute, ``{"forward", "backward",
    "step"}`` seconds of one unit's forward and backward (I + W) and of one STEP, what a
    measured trace's F, B (I + W) and STEP are compared with. ``tied``: tensors tied across
    the plan's stages (:func:`pipetrain.stages.tied.tied_buffers`): their holders' STEPs meet
    for the gradients' all-reduce, in the time and in the bytes. ``measured``: every stage's
    compute as its worker runs it (:func:`calibrated_costs`).
    """
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
    costs = calibrated_costs(plan, profile, cal, units=units, step_time=step_time, tied=tied, measured=measured)
    sim = simulate(sched, costs)
    traffic = plan_traffic(plan, profile, sched, max(1, profile.batch_size // units), tied=tied)
    t = sim.time_per_minibatch
    return {"schedule": spec.name, "replicas": reps, "microbatches": units, "steps": steps,
            "time_per_minibatch": t, "samples_per_second": profile.batch_size / t if t > 0 else None,
            "bytes_per_sample": bytes_per_sample(traffic, float(profile.batch_size) * steps),
            "stage_unit_seconds": [{"forward": c.forward_time, "backward": c.backward_time, "step": c.step_time}
                                   for c in costs.stages]}
