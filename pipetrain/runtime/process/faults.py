"""Injected failures (the hidden ``--debug-fail RANK:STEP[:MODE]`` test hook).

Modes (:data:`~pipetrain.job.parse.DEBUG_FAIL_MODES`):

    raise      RANK raises a RuntimeError at the first forward of minibatch STEP
    hang       RANK blocks forever there (the others must time out, not hang)
    kill       RANK sends itself SIGKILL there: no exception, no record, no cleanup, as a
               machine that dies (first attempt only, see below)
    kill-save  RANK sends itself SIGKILL inside the checkpoint write at step >= STEP
               (:mod:`pipetrain.runtime.checkpoints.periodic`; first attempt only)

``kill`` and ``kill-save`` act only on the first attempt of an elastic run
(``TORCHELASTIC_RESTART_COUNT`` unset or 0), so that a run with ``--max-restarts`` goes
through after the restart: the tests of restarts compare it with an uninterrupted run.
"""
from __future__ import annotations

import os
import signal
import time

__all__ = ["first_attempt", "kill_self", "inject_forward_failure", "KILL_STAMP_ENV"]


def first_attempt() -> bool:
    """Whether this worker is in the elastic agent's first attempt (no restart yet)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0


#: Environment variable naming a file where :func:`kill_self` appends ``RANK TIME`` first
#: (tests measure how long the other workers take to exit after the kill).
KILL_STAMP_ENV = "PIPETRAIN_DEBUG_KILL_STAMP"


def kill_self() -> None:
    """SIGKILL this process: it ends without running any handler, as a dead machine does."""
    stamp = os.environ.get(KILL_STAMP_ENV)
    if stamp:
        with open(stamp, "a") as f:
            f.write(f"{os.environ.get('RANK', '?')} {time.time()}\n")
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # the signal is delivered asynchronously; never return


def inject_forward_failure(mode: str, rank: int, step: int) -> None:
    """The ``--debug-fail`` action of ``mode`` at a forward of ``step`` (module docstring)."""
    if mode == "kill-save":
        return  # acts in the checkpoint write, not here
    if mode == "kill":
        if first_attempt():
            kill_self()
        return
    if mode == "hang":  # a stuck worker: the others must time out, not hang
        while True:
            time.sleep(3600)
    raise RuntimeError(f"debug failure injected on rank {rank} at step {step} (--debug-fail)")
