"""Progress of a long profile: a tqdm bar on a terminal, log lines otherwise.

The bar (on stderr when it is a terminal) appears only once a profile has run for
:data:`SHOW_AFTER` seconds, so short profiles print nothing; elsewhere one line every
:data:`LOG_EVERY` seconds goes to the ``pipetrain.profile`` logger at INFO level::

    profile: 120/274 nodes (44%), 12 s, about 15 s left
"""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["ProfileProgress", "SHOW_AFTER", "LOG_EVERY"]

log = logging.getLogger("pipetrain.profile")

#: Seconds before the bar appears (tqdm's ``delay``).
SHOW_AFTER = 2.0
#: Seconds between log lines where there is no bar.
LOG_EVERY = 10.0


class ProfileProgress:
    """Steps of a profile done so far (one per node, one for the whole-model check).

    Args:
        total: steps the profile takes.
        enabled: False: nothing is shown (library calls, tests).
        stream: where the bar goes (stderr by default); no bar unless it is a terminal.
        clock: the time source (tests pass a fake).
    """

    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, desc: str = "profile") -> None:
        self.total, self.done, self.enabled, self.desc = int(total), 0, enabled, desc
        self._clock = clock
        self._t0 = self._last = clock()
        self._bar: Any = None
        out = stream if stream is not None else sys.stderr
        if enabled and _isatty(out):
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=desc, unit="node", file=out, delay=SHOW_AFTER,
                             dynamic_ncols=True, mininterval=0.25, leave=False)

    def advance(self, steps: int = 1) -> None:
        self.done += steps
        if self._bar is not None:
            self._bar.update(steps)
            return
        now = self._clock()
        if self.enabled and now - self._last >= LOG_EVERY:
            self._last = now
            log.info(self.line())

    def line(self) -> str:
        elapsed = self._clock() - self._t0
        left = (self.total - self.done) * elapsed / self.done if self.done else None
        share = 100 * self.done / self.total if self.total else 100.0
        return (f"{self.desc}: {self.done}/{self.total} nodes ({share:.0f}%), {elapsed:.0f} s"
                + (f", about {left:.0f} s left" if left is not None else ""))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
