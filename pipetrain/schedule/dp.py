"""Data parallelism as a one-stage schedule: ``replicas=[N]``.

The ``m`` microbatches of each minibatch go round-robin over the ``N`` replicas; each runs
forward then backward for each of its microbatches, then the replicas all-reduce and step.
Versions: minibatch ``t`` uses version ``t``.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..errors import ScheduleError
from .action import Schedule
from .layout import check_replicas, one_f_one_b
from .sync import build_flushed


def _order(units: list[int], depth: int, stage: int, num_stages: int) -> list[tuple[str, int]]:
    return one_f_one_b(units, 1)


def check_one_stage(name: str, replicas: list[int]) -> None:
    """``replicas`` must be ``[N]``: one stage on ``N`` replicas."""
    if len(replicas) != 1:
        raise ScheduleError(
            f"{name} runs one stage on N replicas: replicas must have one entry, got {replicas}; "
            f"use replicas=[{sum(replicas)}]"
        )


def build_dp(replicas: Sequence[int], microbatches: int, steps: int) -> Schedule:
    """Compute-only data-parallel schedule."""
    reps = check_replicas(replicas)
    check_one_stage("dp", reps)
    return build_flushed("dp", reps, microbatches, steps, _order)
