"""The simulator's communication figures: bytes per worker by kind, from the costs' sizes.

The simulator moves ``StageCost.activation_send_bytes`` per ``SEND_F`` and
``StageCost.grad_send_bytes`` per ``SEND_B``, and all-reduces ``parameter_bytes`` per
``ALLREDUCE``; :func:`simulated_traffic` counts exactly those with
:func:`pipetrain.plan.traffic.predict_traffic`, so the figures follow the conventions the
runtime's ``Comm`` counts by (``docs/traffic.md``): a stage's all-reduce is one float32 buffer
whose 4-byte count element is ``control``.

Bytes per sample need the samples a unit holds: :meth:`StageCosts.from_plan` records the
profile's batch size and the units per minibatch in ``costs.extra``; synthetic costs have
none (then only bytes per minibatch are known).
"""
from __future__ import annotations

from typing import Any

from ..plan.traffic import predict_traffic, schedule_units
from ..schedule.action import Schedule
from ..schedule.traffic import CutBytes, Traffic, traffic_report
from .costs import StageCosts

__all__ = ["simulated_traffic", "simulated_samples", "traffic_summary"]


def simulated_traffic(schedule: Schedule, costs: StageCosts) -> dict[int, Traffic]:
    """rank -> :class:`Traffic` of ``schedule`` with the per-unit sizes of ``costs``.

    Cut ``k`` carries ``costs[k].activation_send_bytes`` forward and
    ``costs[k+1].grad_send_bytes`` back; stage ``k`` all-reduces ``costs[k].parameter_bytes``;
    every STEP of a stage holding a tie (``costs.tied``) all-reduces the tied tensor.
    """
    S = schedule.num_stages
    cuts = [CutBytes(costs[k].activation_send_bytes, costs[k + 1].grad_send_bytes) for k in range(S - 1)]
    return predict_traffic(schedule, cuts, [costs[k].parameter_bytes for k in range(S)], tied=costs.tied)


def simulated_samples(schedule: Schedule, costs: StageCosts) -> float | None:
    """Samples the schedule trains: its units x samples per unit (``batch_size / units`` from
    :meth:`StageCosts.from_plan`), or ``None`` when the costs carry no batch size."""
    batch, units = costs.extra.get("batch_size"), costs.extra.get("units")
    if not batch or not units:
        return None
    return schedule_units(schedule) * batch / units


def traffic_summary(schedule: Schedule, traffic: dict[int, Traffic], samples: float | None) -> dict[str, Any]:
    """:func:`~pipetrain.schedule.traffic.traffic_report`: ``traffic`` per rank, ``bytes_per_sample``
    (``None`` without ``samples``) and ``bytes_per_minibatch`` by kind and ``"total"``."""
    return traffic_report(traffic, samples, schedule.steps or None)
