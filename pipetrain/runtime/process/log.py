"""Progress lines through the ``logging`` module (the ``pipetrain`` logger).

Progress (``step 10: loss 0.123456``) is logged at INFO on ``pipetrain.progress``. The
command line configures the ``pipetrain`` logger once (:func:`setup_logging`): messages
alone, on stdout, or on stderr when stdout carries ``--json``. Worker processes started by
the launcher do the same from the run's output section; a library caller who configured
``pipetrain`` logging itself keeps its own handlers.
"""
from __future__ import annotations

import logging
import sys

__all__ = ["logger", "progress", "setup_logging"]

logger = logging.getLogger("pipetrain")
progress = logging.getLogger("pipetrain.progress")


class _StdHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the *current* ``sys.stdout`` / ``sys.stderr`` (they may be replaced after
    the handler is made, e.g. by pytest's capture)."""

    def __init__(self, to_stderr: bool) -> None:
        super().__init__()
        self.to_stderr = to_stderr

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr if self.to_stderr else sys.stdout

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def setup_logging(to_stderr: bool = False, force: bool = False) -> None:
    """Log ``pipetrain`` messages (INFO and up) as bare lines on stdout, or stderr.

    Leaves a logger that already has handlers alone unless ``force`` (or the handler is
    this module's own, which is then pointed at the requested stream).
    """
    own = [h for h in logger.handlers if isinstance(h, _StdHandler)]
    if own:
        for h in own:
            h.to_stderr = to_stderr
        return
    if logger.handlers and not force:
        return
    handler = _StdHandler(to_stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
