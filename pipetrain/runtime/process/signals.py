"""Stopping a local run on Ctrl-C (SIGINT) or SIGTERM: quietly, within seconds, nothing half written.

Ctrl-C in a terminal sends SIGINT to every process of the foreground group: the launcher
and each of its workers. The two sides act as follows:

- a worker (:func:`exit_on_signal`, installed first thing in the local launcher's worker
  entry) ends at once with exit code ``128 + signal`` (130 for SIGINT), without a
  traceback, without flushing or tearing anything down: whatever it was writing is left
  half written, and the launcher removes it;
- the launcher's elastic agent turns the signal into its ``SignalException``, stops the
  workers it still sees and waits for them (:func:`pipetrain.runtime.launch.launch_local`
  raises :class:`RunInterrupted`); :func:`pipetrain.run.launcher.train` then removes the
  partial checkpoint directories and reports, in one line, the last complete checkpoint.

A worker whose peers exited this way reads as interrupted too (:func:`interrupted_exit`),
so a signal that reached only the workers ends the run the same way.
"""
from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from types import FrameType

__all__ = ["RunInterrupted", "exit_on_signal", "interrupted_exit", "STOP_SIGNALS"]

#: The signals that stop a run.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(KeyboardInterrupt):
    """The run was stopped by ``signum`` (SIGINT: Ctrl-C, or SIGTERM) before it ended.

    ``message``: one line for the user (the launcher adds the last complete checkpoint);
    :attr:`exit_code` is ``128 + signum`` (130 for Ctrl-C)."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message or f"stopped by {signal.Signals(signum).name}")
        self.signum = int(signum)
        self.message = message or f"stopped by {signal.Signals(signum).name}"

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _exit_now(signum: int, frame: FrameType | None) -> None:
    os._exit(128 + signum)


def exit_on_signal() -> None:
    """In a worker: SIGINT and SIGTERM end the process at once, with exit code ``128 + signal``."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _exit_now)


def interrupted_exit(exit_codes: Iterable[int]) -> int | None:
    """The signal that stopped the workers when every exit code in ``exit_codes`` is one of a
    stop signal's (``128 + signal`` from :func:`exit_on_signal`, or ``-signal`` for a process
    that had not installed it yet), else ``None``. SIGINT wins over SIGTERM (the agent sends
    SIGTERM to the workers left once one has exited)."""
    found: set[int] = set()
    codes = list(exit_codes)
    for code in codes:
        sig = code - 128 if code > 128 else -code
        if sig not in [int(s) for s in STOP_SIGNALS]:
            return None
        found.add(sig)
    if not codes:
        return None
    return int(signal.SIGINT) if int(signal.SIGINT) in found else int(signal.SIGTERM)
