"""Measuring the current hosts' communication costs with gloo (``pipetrain calibrate``).

:func:`calibrate` starts one process per rank, on loopback (a fresh interpreter each, or
forked from the caller's fork server, which has imported torch once) or one per host of an
:class:`~pipetrain.cluster.netns.EmulatedCluster` (gloo bound to the host's interface), each
running :mod:`pipetrain.cluster.gloo_probe` (ping-pong and all-reduce timings of
growing sizes; see there), and fits :class:`~pipetrain.cluster.calibration.Calibration` to
rank 0's samples with :func:`~pipetrain.cluster.calibration.fit_samples` (their means). A run takes a few
seconds whatever the link speed: sizes stop growing once one message takes longer than
``max_message_seconds``.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from multiprocessing.context import ForkServerContext, SpawnContext
from pathlib import Path
from typing import Any

from . import gloo_probe
from .calibration import Calibration, Sample, fit_samples
from .errors import CalibrationError, ClusterError
from .netns import EmulatedCluster

__all__ = ["calibrate", "CALIBRATION_PORT", "RankProcesses"]

#: A ``multiprocessing`` context that loopback ranks can be started with (the runtime's fork
#: server, or ``spawn`` where a platform has no fork server).
RankProcesses = ForkServerContext | SpawnContext

CALIBRATION_PORT = 29510  # the store's port inside an emulated host (each host has its own port space)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_argv(rank: int, world: int, master: str, max_message_seconds: float, timeout: float,
                 threads: int = 1) -> list[str]:
    return [sys.executable, os.path.abspath(gloo_probe.__file__), "--rank", str(rank), "--world", str(world),
            "--master", master, "--max-message-seconds", str(max_message_seconds), "--timeout", str(timeout),
            "--threads", str(threads)]


def calibrate(cluster: EmulatedCluster | None = None, ranks: int = 2, max_message_seconds: float = 0.1,
              timeout: float = 60.0, threads: int = 1, processes: RankProcesses | None = None) -> Calibration:
    """Measure point-to-point and all-reduce costs of the current hosts and fit them.

    Args:
        cluster: an emulated cluster that is up: one rank per host, gloo on the hosts'
            interfaces. None: ``ranks`` local processes on loopback (``lo``).
        ranks: ranks on loopback (>= 2; ignored with a cluster, which needs >= 2 hosts).
        max_message_seconds: stop growing message sizes once one takes longer than this.
        timeout: seconds for the whole measurement; every process is killed after it.
        threads: torch threads per rank for the compute probe (the workers' ``--threads``).
        processes: on loopback, the ``multiprocessing`` context to start the ranks with (the
            runtime's fork server, which has imported torch once: no rank imports it again,
            about 1 s of the 2-core machine's time per rank); None: a fresh interpreter each.
    """
    if cluster is not None:
        ranks = cluster.hosts
        if ranks < 2:
            raise ClusterError(f"calibration needs 2 or more hosts, the cluster has {ranks}; use --hosts 2")
    elif ranks < 2:
        raise ClusterError(f"calibration needs 2 or more ranks, got {ranks}; use --ranks 2")
    if not max_message_seconds > 0 or not timeout > 0:
        raise ClusterError(f"max_message_seconds and timeout must be > 0, got {max_message_seconds} and {timeout}")
    t0 = time.monotonic()
    master = f"127.0.0.1:{_free_port()}" if cluster is None else f"{cluster.address(0)}:{CALIBRATION_PORT}"
    if cluster is None and processes is not None:
        out = _run_forked(processes, ranks, master, max_message_seconds, timeout, threads)
    else:
        out = _run_scripts(cluster, ranks, master, max_message_seconds, timeout, threads)
    result = json.loads(out.strip().splitlines()[-1])
    samples = [Sample(**s) for s in result["samples"]]
    compute = result["compute"]  # below 1: the machine's load fell between the phases
    slowdown = max(1.0, compute["together_seconds"] / compute["alone_seconds"])
    return Calibration(
        p2p=fit_samples(samples, "p2p"), allreduce=fit_samples(samples, "allreduce"),
        allreduce_ranks=ranks, hosts=1 if cluster is None else cluster.hosts, ranks=ranks,
        where="loopback" if cluster is None else "emulated",
        bandwidth_limit_bits_per_second=None if cluster is None else cluster.bandwidth_bits,
        samples=tuple(samples), measured_at=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        seconds=time.monotonic() - t0, compute_slowdown=slowdown)


def _timed_out(timeout: float) -> CalibrationError:
    return CalibrationError(f"calibration did not finish within {timeout:g} s; pass a larger timeout "
                            "or a smaller max_message_seconds")


def _failed(rank: int, code: int | None, err: str) -> RuntimeError:
    tail = " | ".join(err.strip().splitlines()[-3:])
    return RuntimeError(f"calibration rank {rank} failed (exit {code}): {tail}")


def _run_scripts(cluster: EmulatedCluster | None, ranks: int, master: str, max_message_seconds: float,
                 timeout: float, threads: int) -> str:
    """Every rank a fresh interpreter running :mod:`.gloo_probe` as a script; rank 0's output."""
    deadline = time.monotonic() + timeout
    procs: list[subprocess.Popen[str]] = []
    try:
        for r in range(ranks):
            argv = _worker_argv(r, ranks, master, max_message_seconds, timeout, threads)
            kw: dict[str, Any] = {"stdout": subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                                  "stderr": subprocess.PIPE, "text": True}
            if cluster is None:  # gloo on loopback
                env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
                procs.append(subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                                              start_new_session=True, **kw))
            else:  # rank r on host r, gloo on its veth
                env = {"GLOO_SOCKET_IFNAME": cluster.interface(r), "OMP_NUM_THREADS": "1"}
                procs.append(cluster.popen(r, argv, env=env, **kw))
        try:
            out, err0 = procs[0].communicate(timeout=max(1.0, deadline - time.monotonic()))
            errs = [err0]
            for p in procs[1:]:
                errs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[1])
        except subprocess.TimeoutExpired:
            raise _timed_out(timeout) from None
        bad = [(r, p.returncode, e) for r, (p, e) in enumerate(zip(procs, errs)) if p.returncode != 0]
        if bad:
            raise _failed(*bad[0])
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=5)


def _run_forked(processes: RankProcesses, ranks: int, master: str, max_message_seconds: float, timeout: float,
                threads: int) -> str:
    """Every rank on loopback a process of ``processes`` (:func:`.gloo_probe.forked_rank`);
    rank 0's output."""
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="pipetrain-calibrate-") as tmp:
        logs = [os.path.join(tmp, f"rank{r}.log") for r in range(ranks)]
        result = os.path.join(tmp, "result.json")
        procs = [processes.Process(target=gloo_probe.forked_rank, daemon=True,
                                   args=(r, ranks, master, max_message_seconds, timeout, threads, logs[r], result))
                 for r in range(ranks)]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(max(1.0, deadline - time.monotonic()))
                if p.exitcode is None:
                    raise _timed_out(timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        for r, p in enumerate(procs):
            if p.exitcode != 0:
                raise _failed(r, p.exitcode, Path(logs[r]).read_text(errors="replace"))
        return Path(result).read_text()
