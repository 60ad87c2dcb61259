"""Timed windows and their results: the loop every harness configuration runs, and one run's
:class:`Measurement` (throughput and memory, or why it failed)."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


def timed_loop(step: Callable[[], Any], warmup: int, steps: int,
               sync: Callable[[], None] | None = None) -> tuple[float, list[float]]:
    """Run ``warmup`` untimed steps, ``sync()``, then ``steps`` timed ones.

    Returns the wall time of the timed steps (seconds) and each step's duration.
    ``sync`` is a barrier in multi-process configurations, so that every rank starts the
    timed window together (the warm-up is where gloo connects and buffers get allocated).
    """
    for _ in range(warmup):
        step()
    if sync is not None:
        sync()
    times: list[float] = []
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return time.perf_counter() - t0, times


def median_or_none(values: Sequence[float]) -> float | None:
    """The median of ``values`` or ``None`` when there are none."""
    return statistics.median(values) if values else None


@dataclass
class Measurement:
    """One configuration run once (one round): throughput and memory, or why it failed."""

    samples_per_second: float | None
    status: str  # "ok" or "failed"
    error: str = ""
    peak_rss_mib: list[float] = field(default_factory=list)  # per worker (or per launch)
    extra: dict[str, Any] = field(default_factory=dict)
