"""The planner on measured communication costs (a calibration file).

A :class:`~pipetrain.cluster.calibration.Calibration` (``pipetrain calibrate --output FILE``)
holds two fits of ``t(S) = latency + S / bandwidth``: one point-to-point message between two
ranks, and one all-reduce of an ``S``-byte buffer over ``allreduce_ranks`` ranks. This module
turns them into what the planner's ``pipetrain`` cost model needs:

- :func:`calibrated_topology`: a flat topology of ``workers`` at the measured point-to-point
  bandwidth (the cut terms ``X / B``);
- :func:`calibrated_params`: :class:`~pipetrain.plan.cost.CostParams` with the measured
  point-to-point latency (``alpha`` per message), the ring all-reduce's per-link bandwidth
  (``Calibration.allreduce_bus_bandwidth``) and per-step latency (the measured all-reduce
  latency over its ``2 (n-1)`` ring steps), and ``overlap = 0``: the runtime starts a stage's
  all-reduce after the minibatch's last backward (one flat buffer, ``ALLREDUCE`` right before
  ``STEP`` in every schedule), so no backward time hides it;
- :func:`plan_with_calibration`: :func:`~pipetrain.plan.api.plan` with both.

The simulator on the same costs is :mod:`pipetrain.simulate.calibrated`. The predicted
all-reduce of ``P`` bytes over ``m`` ranks is::

    allreduce(P, m) = 2 (m-1)/m * P / B_bus + 2 (m-1) * alpha_step
    B_bus       = allreduce bandwidth * 2 (n-1) / n        (n = ranks measured)
    alpha_step  = allreduce latency / (2 (n-1))

which is exactly the measured fit for ``m = n``. What the model leaves out is listed in
``docs/planner.md`` ("Calibrated costs").
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import PlanError
from .cost import CostParams
from .types import Plan, Topology

if TYPE_CHECKING:
    from ..cluster.calibration import Calibration
    from ..cluster.measure import RankProcesses
    from ..profile.types import Profile

__all__ = ["MEASURE", "resolve_calibration", "calibrated_params", "calibrated_topology", "plan_with_calibration",
           "calibration_summary", "ring_step_latency"]

#: ``--calibration measure``: measure on loopback now instead of reading a file.
MEASURE = "measure"


def resolve_calibration(value: str | Path | Calibration | None, ranks: int = 2,
                        threads: int | None = None, processes: RankProcesses | None = None) -> Calibration | None:
    """A calibration from a file path, ``"measure"`` (``ranks`` ranks on loopback, now, so the
    all-reduce fit is at that count; ``threads``: torch threads per rank of its compute probe,
    default 1; ``processes``: how its ranks start, :func:`pipetrain.cluster.measure.calibrate`),
    or as given.

    Raises CalibrationError (a PipetrainError) when the file is missing or malformed.
    """
    from ..cluster.calibration import Calibration, load_calibration

    if value is None or isinstance(value, Calibration):
        return value
    if str(value) == MEASURE:
        from ..cluster.measure import calibrate

        return calibrate(None, ranks=ranks, threads=threads or 1, processes=processes)
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
    return Topology.flat(workers, cal.p2p.bandwidth_bytes_per_second, memory_per_worker)


def slowed(profile: Profile, factor: float) -> Profile:
    """``profile`` with every node's compute time ``x factor`` (a calibration's
    ``compute_slowdown``: a stage computes slower inside a run than profiled alone), its other
    fields (the loss's saved bytes, the measured step) as they are."""
    if factor == 1.0:
        return profile
    return replace(profile, nodes=[replace(n, forward_time=n.forward_time * factor,
                                           backward_time=n.backward_time * factor) for n in profile.nodes])


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
    result = plan(slowed(profile, cal.compute_slowdown), calibrated_topology(cal, workers), opts)
    result.extra["calibration"] = calibration_summary(cal)
    return result


def calibration_summary(cal: Calibration) -> dict[str, Any]:
    """The figures the planner used, for ``Plan.extra`` and reports."""
    return {"where": cal.where, "hosts": cal.hosts, "measured_at": cal.measured_at,
            "bandwidth_limit_bits_per_second": cal.bandwidth_limit_bits_per_second,
            "p2p_latency_seconds": cal.p2p.latency_seconds,
            "p2p_bandwidth_bytes_per_second": cal.p2p.bandwidth_bytes_per_second,
            "allreduce_bus_bandwidth_bytes_per_second": cal.allreduce_bus_bandwidth,
            "allreduce_step_latency_seconds": ring_step_latency(cal), "compute_slowdown": cal.compute_slowdown}
