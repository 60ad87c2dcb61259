"""Where units run: the rank layout, round-robin routing and 1F1B warm-up depths.

Ranks are laid out stage by stage (``replicas=[2,1,1]``: stage 0 on ranks 0 and 1, stage 1
on rank 2, stage 2 on rank 3). Unit ``u`` at a stage with ``r`` replicas runs on replica
``u mod r`` (PipeDream's 1F1B-RR); synchronous schedules route by the microbatch index
within its minibatch, ``(u mod m) mod r``, so that every minibatch spreads the same way.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from functools import reduce

from ..errors import ScheduleError


def check_replicas(replicas: Sequence[int]) -> list[int]:
    """Return ``replicas`` as a list of ints, or raise if it is not a non-empty list of counts >= 1."""
    def as_count(r: object) -> int:
        # Integral numbers only: 2.5 or True must not silently become 2 or 1.
        if isinstance(r, numbers.Integral) and not isinstance(r, bool):
            return int(r)
        if isinstance(r, float) and r.is_integer():
            return int(r)
        raise TypeError

    try:
        if isinstance(replicas, (str, bytes)):
            raise TypeError  # "21" would otherwise read as [2, 1]
        out = [as_count(r) for r in replicas]
    except (TypeError, ValueError, OverflowError):
        raise ScheduleError(
            f"replicas must be a list of integer replica counts per stage, e.g. [2,1,1]; got {replicas!r}"
        ) from None
    if not out:
        raise ScheduleError("replicas is empty: give one replica count per stage, e.g. [1,1] for two stages")
    bad = [r for r in out if r < 1]
    if bad:
        raise ScheduleError(f"every stage needs at least one replica; got replicas={out}; use counts >= 1")
    return out


def lcm(values: Iterable[int]) -> int:
    """Least common multiple of positive counts (``1`` for none): ``lcm([2, 3, 1]) == 6``.

    A PipeDream stage with ``r`` replicas steps once per ``r`` minibatches, so the routing of
    a replicated pipeline repeats every ``lcm(replicas)`` minibatches.
    """
    return reduce(lambda a, b: a * b // math.gcd(a, b), (int(v) for v in values), 1)


def stage_ranks_of(replicas: Sequence[int]) -> list[list[int]]:
    """Ranks of each stage, laid out stage by stage: ``[2,1] -> [[0,1],[2]]``."""
    out: list[list[int]] = []
    start = 0
    for r in replicas:
        out.append(list(range(start, start + r)))
        start += r
    return out


def warmup_depth(replicas: Sequence[int], stage: int) -> int:
    """Units a replica of ``stage`` admits before its first backward in 1F1B.

    PipeDream admits NOAM = ceil(workers / replicas of the input stage) minibatches per
    input-stage replica (SOSP'19, section 3.2). Applied to the sub-pipeline that starts at
    ``stage``: ``ceil(sum(replicas[stage:]) / replicas[stage])``. Without replication this
    is ``P - stage``, the classic 1F1B depth (warm-up ``P - stage - 1`` forwards plus the
    first forward of the steady state).
    """
    return math.ceil(sum(replicas[stage:]) / replicas[stage])


def one_f_one_b(units: Sequence[int], depth: int) -> list[tuple[str, int]]:
    """The 1F1B order of one replica over its ``units`` with ``depth`` units admitted first.

    ``depth`` forwards, then alternately one backward and one forward, then the remaining
    backwards (the drain). Example, depth 2 over units 0..3: ``F0 F1 B0 F2 B1 F3 B2 B3``.
    Returns ``("F"|"B", unit)`` pairs.
    """
    n = len(units)
    w = max(1, min(depth, n))
    out: list[tuple[str, int]] = [("F", u) for u in units[:w]]
    for i in range(n):
        out.append(("B", units[i]))
        if i + w < n:
            out.append(("F", units[i + w]))
    return out


def all_f_all_b(units: Sequence[int]) -> list[tuple[str, int]]:
    """GPipe's order of one replica: every forward, then every backward (same unit order)."""
    return [("F", u) for u in units] + [("B", u) for u in units]


def sync_units(microbatches: int, replicas: int, replica: int, step: int) -> list[int]:
    """Global unit numbers replica ``replica`` of an ``replicas``-way stage runs in minibatch ``step``."""
    return [step * microbatches + i for i in range(microbatches) if i % replicas == replica]


def check_sync_counts(name: str, replicas: Sequence[int], microbatches: int, steps: int) -> None:
    """Common argument checks of the microbatched schedules."""
    if microbatches < 1:
        raise ScheduleError(f"{name} needs microbatches >= 1 (got {microbatches}); pass microbatches=1 or more")
    if steps < 1:
        raise ScheduleError(f"{name} needs steps >= 1 (got {steps}); pass steps=1 or more")
    rmax = max(replicas)
    if microbatches < rmax:
        raise ScheduleError(
            f"{name} routes the microbatches of a minibatch round-robin over a stage's replicas, so every "
            f"replica needs one: microbatches={microbatches} < {rmax} replicas of a stage (replicas={list(replicas)}); "
            f"use microbatches >= {rmax}"
        )
