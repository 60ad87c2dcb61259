"""Timed regions: the clock, the timer's own cost, robust statistics and how often to repeat.

Every time the profiler reports is a *timed region*: ``perf_counter`` around a forward or
around ``torch.autograd.backward`` (the device synchronized at both ends on CUDA). A region
costs something even when it computes nothing: the clock reads, the synchronization, and
for a backward the autograd engine's start. :class:`TimerCost` measures that cost on an
empty region (a forward that runs nothing, the backward of a bare leaf) and
:meth:`TimerCost.net` subtracts it, so a node or segment is charged only its own work.

Repeats are summarised by :func:`robust_seconds`: the median of up to four runs, the mean
of the middle 60% (a fifth trimmed at each end) of five or more. One run slowed by another
process on the core moves neither.

:class:`RepeatBudget` bounds the time spent repeating one region: after the first timed run
it keeps going only while the timed runs so far are under its budget, so a region that takes
a second is timed once or twice, a millisecond region ``repeats`` times.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Clock", "TimerCost", "RepeatBudget", "robust_seconds", "EMPTY_REGION_RUNS"]

#: Runs of the empty region whose median is the timer's cost.
EMPTY_REGION_RUNS = 51


def robust_seconds(samples: Sequence[float]) -> float:
    """The median of up to four samples; of five or more, the mean of the middle 60%
    (``len // 5`` dropped at each end). 0 for no samples."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    if len(ordered) < 5:
        return float(statistics.median(ordered))
    cut = len(ordered) // 5
    middle = ordered[cut:len(ordered) - cut]
    return math.fsum(middle) / len(middle)


class Clock:
    """``perf_counter`` with the device synchronized first (CUDA; nothing to wait for on a CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.sync: Callable[[], None] = (
            (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None))

    def now(self) -> float:
        self.sync()
        return time.perf_counter()


@dataclass(frozen=True)
class TimerCost:
    """Seconds an empty forward region and an empty backward region take (the timer's own cost)."""

    forward: float
    backward: float

    @staticmethod
    def measure(clock: Clock, device: torch.device, runs: int = EMPTY_REGION_RUNS) -> TimerCost:
        """Median of ``runs`` empty regions: two clock reads, and a backward of a bare leaf
        (the engine's start and one gradient accumulation, no operator)."""
        fwd: list[float] = []
        bwd: list[float] = []
        leaf = torch.zeros(1, device=device, requires_grad=True)
        grad = torch.ones(1, device=device)
        for _ in range(runs):
            t0 = clock.now()
            fwd.append(clock.now() - t0)
            t1 = clock.now()
            torch.autograd.backward([leaf], [grad])
            bwd.append(clock.now() - t1)
        return TimerCost(float(statistics.median(fwd)), float(statistics.median(bwd)))

    def net(self, forward: float, backward: float | None) -> tuple[float, float]:
        """``(forward, backward)`` less the empty regions' cost, at least 0 (a region that
        never ran, ``backward=None``, costs 0)."""
        return max(0.0, forward - self.forward), 0.0 if backward is None else max(0.0, backward - self.backward)


@dataclass(frozen=True)
class RepeatBudget:
    """How many times to run a region: ``warmup`` untimed runs (skipped when one run takes
    ``long`` seconds or more, judged by ``estimate``), then at least one timed run and at
    most ``repeats``, stopping once the timed runs add up to ``seconds``."""

    warmup: int
    repeats: int
    seconds: float
    long: float

    def warmups(self, estimate: float) -> int:
        return 0 if estimate >= self.long else self.warmup

    def more(self, timed: Sequence[float]) -> bool:
        """Whether to time another run after ``timed`` (seconds of each run so far)."""
        return not timed or (len(timed) < self.repeats and math.fsum(timed) < self.seconds)
