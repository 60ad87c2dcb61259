"""Launching measured processes: environment, free ports, a group supervisor, result lines.

Every configuration runs as fresh process trees started together by :func:`run_group`,
each in its own session so that it and whatever it starts (a launcher's workers) can be
killed together. A harness worker reports by printing one ``RESULT_TAG {json}`` line last
(:func:`emit_result`); :meth:`ProcResult.result_json` reads it back.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rss import TreeMemory

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
RESULT_TAG = "BENCH_RESULT "  # a worker's last stdout line: RESULT_TAG + one JSON object


def emit_result(payload: dict[str, Any]) -> None:
    """Print a worker's result as its last stdout line."""
    sys.stdout.write(RESULT_TAG + json.dumps(payload) + "\n")
    sys.stdout.flush()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bench_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of every measured process: one intra-op thread, benchmarks/ importable."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    path = [BENCH_DIR, REPO_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.update(extra or {})
    return env


@dataclass
class ProcResult:
    """The end of one launched process: exit status, outputs, its tree's peak memory."""

    returncode: int | None  # None: killed by the harness (timeout or a failed peer)
    stdout: str
    stderr: str
    tree_peaks_mib: list[float]  # sampled VmHWM of the process and each descendant, pid order
    timed_out: bool = False
    wall_s: float = 0.0

    @property
    def peak_rss_mib(self) -> float:
        """The largest peak RSS of any process of the tree (0 if none was sampled)."""
        return max(self.tree_peaks_mib, default=0.0)

    def result_json(self) -> dict[str, Any] | None:
        """The ``RESULT_TAG`` object a harness worker printed, if any."""
        for line in reversed(self.stdout.splitlines()):
            if line.startswith(RESULT_TAG):
                obj = json.loads(line[len(RESULT_TAG):])
                return obj if isinstance(obj, dict) else None
        return None

    def error_line(self) -> str:
        """One line saying why the process failed (the last informative stderr line)."""
        if self.timed_out:
            return f"timed out after {self.wall_s:.0f} s (killed)"
        lines = [ln.strip() for ln in self.stderr.splitlines() if ln.strip()]
        for ln in reversed(lines):
            if ln.startswith("error:") or "Error" in ln or "error" in ln:
                return ln[:300]
        return (lines[-1][:300] if lines else f"exit status {self.returncode}")


def _kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (each launched process leads its own)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_group(commands: Sequence[Sequence[str]], timeout_s: float,
              env: dict[str, str] | None = None, sample_s: float = 0.25) -> list[ProcResult]:
    """Start ``commands`` at once, wait for all of them at most ``timeout_s`` seconds.

    When one process fails, the others are killed right away (they would otherwise wait on
    a collective until gloo's timeout); past the deadline every survivor is killed. Every
    ``sample_s`` seconds the peak RSS of each process of each tree is sampled
    (:class:`rss.TreeMemory`).
    """
    with contextlib.ExitStack() as files:  # the captured output, closed however this ends
        outs = [files.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in commands]
        errs = [files.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in commands]
        procs = [subprocess.Popen(list(cmd), stdout=o, stderr=e, env=env or bench_env(),
                                  cwd=REPO_ROOT, start_new_session=True)
                 for cmd, o, e in zip(commands, outs, errs)]
        t0 = time.monotonic()
        mem = TreeMemory()
        members: list[set[int]] = [{p.pid} for p in procs]  # every pid seen in each tree
        status: dict[int, tuple[int | None, bool]] = {}
        failed = False
        last_sample = -math.inf

        def sample_all() -> None:
            for i, p in enumerate(procs):
                if i not in status:
                    before = set(mem.peaks)
                    mem.sample(p.pid)
                    members[i] |= set(mem.peaks) - before

        try:
            while len(status) < len(procs):
                if time.monotonic() - last_sample >= sample_s:
                    sample_all()
                    last_sample = time.monotonic()
                for i, p in enumerate(procs):
                    if i in status or p.poll() is None:
                        continue
                    status[i] = (p.returncode, False)
                    _kill_group(p.pid)  # leftovers of a launcher that exited
                    failed = failed or p.returncode != 0
                timed_out = time.monotonic() - t0 > timeout_s
                if (failed or timed_out) and len(status) < len(procs):
                    sample_all()
                    for i, p in enumerate(procs):
                        if i not in status:
                            _kill_group(p.pid)
                            p.wait()
                            status[i] = (None, timed_out)
                    break
                time.sleep(0.05)
        finally:
            for i, p in enumerate(procs):
                if i not in status:  # interrupted: leave nothing behind
                    _kill_group(p.pid)
                    try:
                        p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass
        wall = time.monotonic() - t0
        results: list[ProcResult] = []
        for i, (o, e) in enumerate(zip(outs, errs)):
            o.seek(0)
            e.seek(0)
            rc, to = status.get(i, (None, False))
            results.append(ProcResult(rc, o.read(), e.read(), mem.of_tree(members[i]), to, wall))
    return results
