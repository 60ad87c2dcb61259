"""A launcher killed by a signal it cannot handle (SIGKILL) leaves no worker behind: each
local worker watches its launcher's process and ends itself (runtime/process/orphans.py).
Before, the workers trained on and then waited for the dead launcher forever."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pipetrain.runtime.process.failures import FailureBoard, FailureRecord
from pipetrain.runtime.process.orphans import POLL_SECONDS, process_alive

pytestmark = pytest.mark.timeout(120)

#: Seconds the processes of a killed launch may take to end (the watch's poll, a worker's exit).
GONE_WITHIN = 15.0


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (the launch and everything it started)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getsid(int(name)) == sid:
                    out.append(int(name))
            except OSError:
                pass
    return out


def test_the_workers_of_a_killed_launcher_end_themselves() -> None:
    cmd = [sys.executable, "-m", "pipetrain", "train", "--model", "mlp", "--option", "depth=2", "--option", "width=16",
           "--workers", "2", "--config", "1-1", "--schedule", "flush", "--steps", "20000", "--log-every", "1",
           "--threads", "1", "--timeout", "60"]
    launch = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    sid = launch.pid
    lines: list[str] = []
    stepped = threading.Event()

    def read() -> None:
        assert launch.stdout is not None
        for line in launch.stdout:
            lines.append(line)
            if line.startswith("step "):
                stepped.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert stepped.wait(90), "".join(lines[-20:])
        workers = [p for p in _session(sid) if p != sid]
        assert len(workers) >= 2, workers  # the fork server and the two workers
        os.kill(launch.pid, signal.SIGKILL)
        launch.wait(10)
        deadline = time.monotonic() + GONE_WITHIN
        while _session(sid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _session(sid) == [], f"left behind: {_session(sid)}"
        reader.join(5)
        assert sum("its launcher (pid" in line and "is gone" in line for line in lines) == 2, "".join(lines[-10:])
    finally:
        for pid in _session(sid):  # never leave a process behind, even when the test fails
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if launch.poll() is None:
            launch.kill()
            launch.wait(10)


def test_a_process_ended_but_not_yet_reaped_counts_as_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while process_alive(child.pid) and time.monotonic() < deadline:  # a zombie until waited for
        time.sleep(0.05)
    assert not process_alive(child.pid)
    child.wait()
    assert process_alive(os.getpid()) and not process_alive(child.pid)


def test_the_watch_ends_its_process_once_the_watched_one_has_ended() -> None:
    code = ("import subprocess, sys, time\n"
            "from pipetrain.runtime.process.orphans import exit_with_launcher\n"
            "watched = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1)'])\n"
            "exit_with_launcher(watched.pid)\n"
            "time.sleep(60)\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 129 and "is gone" in done.stderr
    assert time.monotonic() - start < 30 + POLL_SECONDS


def test_a_worker_failing_after_its_launcher_ended_exits_as_the_watch_does() -> None:
    # The race the end-to-end test met on CI: the watch ended one worker first; the other's
    # transfers broke before its own watch looked, and it reported a failure (with torch's C++
    # stack from the launcher's dead store) instead of the launcher's end. Here the watch polls
    # too slowly to act, so only the failure path can end the process as the watch would.
    code = ("import os, subprocess, sys, time\n"
            "from pipetrain.runtime.process import orphans\n"
            "from pipetrain.runtime.process.forkserver import forked_entry\n"
            "orphans.POLL_SECONDS = 600.0\n"
            "watched = subprocess.Popen([sys.executable, '-c', 'pass'])\n"
            "def entry(pid):\n"
            "    watched.wait()\n"
            "    raise ConnectionError('Connection closed by peer')\n"
            "forked_entry(entry, dict(os.environ), None, watched.pid, watched.pid)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 129, done.stderr
    assert "is gone" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_board_whose_host_has_ended_is_not_asked() -> None:
    class DeadStore:  # torch prints a C++ stack for each request to a store that is gone
        asked: list[str] = []

        def __getattr__(self, name: str) -> object:
            self.asked.append(name)
            raise ConnectionError("store gone")

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    store = DeadStore()
    board = FailureBoard(store, host_pid=ended.pid)
    assert board.host_gone()
    board.post(FailureRecord(1, "RuntimeError", False, "broken"))
    assert board.root(wait_s=0.5) is None and board.of_rank(1) is None
    assert store.asked == []
    assert not FailureBoard(store, host_pid=os.getpid()).host_gone()
    assert not FailureBoard(store).host_gone()
