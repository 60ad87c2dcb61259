"""The training clock: :class:`TrainClock`, wall time since the start that can pause.

Time to accuracy (the paper's figure) counts training; the time spent evaluating is the same
for every schedule and would blur the comparison, so the driving process pauses the clock
around each evaluation:

    clock = TrainClock()              # starts now
    ...train an epoch...
    with clock.paused():
        result = evaluate(...)        # not counted
    result_time = clock.elapsed()
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class TrainClock:
    """Seconds of wall time since :meth:`start` (or construction), excluding paused spans.

    Args:
        now: the time source (``time.perf_counter`` by default; tests pass a fake).
        start: start running at once (default True).
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter, start: bool = True) -> None:
        self._now = now
        self._started: float | None = None
        self._paused_at: float | None = None
        self._paused_total = 0.0
        if start:
            self.start()

    def start(self) -> None:
        """(Re)start from zero."""
        self._started = self._now()
        self._paused_at = None
        self._paused_total = 0.0

    def elapsed(self) -> float:
        """Seconds counted so far (0.0 before :meth:`start`)."""
        if self._started is None:
            return 0.0
        end = self._paused_at if self._paused_at is not None else self._now()
        return max(0.0, end - self._started - self._paused_total)

    def pause(self) -> None:
        """Stop counting (no-op if already paused)."""
        if self._paused_at is None:
            self._paused_at = self._now()

    def resume(self) -> None:
        """Count again (no-op if running)."""
        if self._paused_at is not None:
            self._paused_total += self._now() - self._paused_at
            self._paused_at = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Pause for the duration of a ``with`` block (e.g. an evaluation)."""
        was_paused = self._paused_at is not None
        self.pause()
        try:
            yield
        finally:
            if not was_paused:
                self.resume()
