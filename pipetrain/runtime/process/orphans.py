"""A local worker whose launcher is gone exits instead of waiting for it forever.

torchelastic's worker wrapper, once the entry point has returned, waits for its agent (the
launcher, ``launch_local``) to take the return value; the agent also stops every worker when
one fails. A launcher killed by a signal it cannot handle (SIGKILL, the out-of-memory killer)
does neither: its workers trained on and then waited for it forever (four workers of two
killed launches still alive 15 minutes later, 2026-12-07). So every worker of a local launch
watches its launcher's process (:func:`exit_with_launcher`) and ends itself, with one line on
stderr, within :data:`POLL_SECONDS` of the launcher's end. Workers started by an outer
torchrun are torchrun's to stop and are not watched.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import NoReturn

__all__ = ["LAUNCHER_GONE_STATUS", "POLL_SECONDS", "exit_launcher_gone", "exit_with_launcher", "process_alive"]

#: Seconds between two looks at the launcher's process.
POLL_SECONDS = 0.5

#: A worker's exit status when its launcher is gone (nobody reads it; 128 + SIGHUP, the
#: hang-up of a process that lost its controlling process).
LAUNCHER_GONE_STATUS = 129


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie, killed and not yet reaped, is not)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or the number is another user's now
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc here: the signal test alone
    return state not in (b"Z", b"X")


def exit_launcher_gone(pid: int) -> NoReturn:
    """End this worker at once with one line on stderr: its launcher, process ``pid``, is gone.

    Also called on a worker's failure path: a peer whose watch ended it first breaks this
    worker's transfers, and the launcher's stores are gone with the launcher, so the failure
    is the launcher's end, not an error of this worker to report."""
    sys.stderr.write(f"pipetrain: worker process {os.getpid()} exits: its launcher (pid {pid}) is gone\n")
    sys.stderr.flush()
    os._exit(LAUNCHER_GONE_STATUS)


def exit_with_launcher(pid: int) -> threading.Thread:
    """Start a daemon thread ending this process (:func:`exit_launcher_gone`) once process
    ``pid`` has ended."""
    def watch() -> None:
        while process_alive(pid):
            time.sleep(POLL_SECONDS)
        exit_launcher_gone(pid)

    thread = threading.Thread(target=watch, name="pipetrain-launcher-watch", daemon=True)
    thread.start()
    return thread
