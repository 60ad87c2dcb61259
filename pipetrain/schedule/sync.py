"""The skeleton shared by the flushed (synchronous) schedules: flush, gpipe, dp, zerobubble.

Every minibatch ``t`` is split into ``m`` microbatches (global units ``t*m .. t*m+m-1``).
Each replica runs its microbatches in the order a per-replica rule gives (1F1B, all-forward-
all-backward...), then the pipeline flushes and every stage steps once (replicated stages
all-reduce first; the comm pass inserts it). No staleness: every forward and backward of
minibatch ``t`` uses version ``t``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .action import Action, Op, Schedule
from .layout import check_replicas, check_sync_counts, stage_ranks_of, sync_units, warmup_depth

#: ``order(units, depth, stage, num_stages) -> [(op name, unit), ...]`` for one replica.
ReplicaOrder = Callable[[list[int], int, int, int], list[tuple[str, int]]]


def build_flushed(name: str, replicas: Sequence[int], microbatches: int, steps: int,
                  order: ReplicaOrder, options: dict[str, Any] | None = None) -> Schedule:
    """Compute-only schedule: per minibatch, each replica's ``order``, then one STEP per stage."""
    reps = check_replicas(replicas)
    check_sync_counts(name, reps, microbatches, steps)
    stage_ranks = stage_ranks_of(reps)
    workers: list[list[Action]] = [[] for _ in range(sum(reps))]
    for t in range(steps):
        for k, ranks in enumerate(stage_ranks):
            depth = warmup_depth(reps, k)
            for j, rank in enumerate(ranks):
                units = sync_units(microbatches, reps[k], j, t)
                for op, u in order(units, depth, k, len(reps)):
                    workers[rank].append(Action(k, Op(op), u, version=t))
                workers[rank].append(Action(k, Op.STEP, t))
    return Schedule(name, workers, stage_ranks, microbatches=microbatches, steps=steps, options=dict(options or {}))
