"""Starting the workers of a resolved run on this machine through torchrun's launcher API.

:func:`launch_local` starts ``world_size`` local processes with
``torch.distributed.launcher.api.elastic_launch`` (the launcher ``torchrun`` itself uses:
c10d rendezvous on ``127.0.0.1:<free port>``, ``max_restarts`` from ``--max-restarts``), forked
from a server that has imported torch and the worker once
(:mod:`pipetrain.runtime.process.forkserver`), hands
each the resolved runs (pickled with the entry point's arguments), and returns rank 0's
results. A worker's failure surfaces as one :class:`~pipetrain.runtime.process.failures.WorkerFailure`,
built from the structured :class:`~pipetrain.runtime.process.failures.FailureRecord` the failing rank posted in a
store this launcher hosts for the run (no error text is parsed). Ctrl-C (SIGINT) or SIGTERM
stops every worker and surfaces as :class:`~pipetrain.runtime.process.signals.RunInterrupted`
(:mod:`pipetrain.runtime.process.signals`).

The library entry point that resolves a configuration first is :func:`pipetrain.run.train`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import RuntimeConfigError
from ..job.resolved import ResolvedRun
from ..job.result import RunResult
from .process.failures import BoardAddress, FailureBoard, WorkerFailure
from .process.forkserver import StdStreams, forked_entry, reopen_closed_std_fds, start_method, start_server
from .process.peers import killed_rank
from .process.signals import STOP_SIGNALS, RunInterrupted, interrupted_exit

__all__ = ["WorkerFailure", "launch_local", "free_port", "reopen_closed_std_fds"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _quiet_launcher() -> Iterator[None]:
    """Silence torchelastic's own logging (tracebacks of failed workers, SIGTERM notices) and
    keep this process's signal handlers (the agent replaces those of SIGINT and SIGTERM while
    it runs): the failure is reported once, as a WorkerFailure or RunInterrupted."""
    names = [n for n in list(logging.root.manager.loggerDict)
             if n.startswith(("torch.distributed.elastic", "torch.multiprocessing", "torch.distributed.launcher"))]
    names += ["torch.distributed.elastic", "torch.multiprocessing", "torch.distributed.launcher"]
    saved = {n: logging.getLogger(n).level for n in names}
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for n in names:
        logging.getLogger(n).setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for n, lv in saved.items():
            logging.getLogger(n).setLevel(lv)
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


def _failure_text(f: Any) -> str:
    """The first line torchelastic recorded for a process that left no record (killed, or
    failed before it could reach the store)."""
    msg = f.message
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    text = str(msg or "").strip()
    return text.splitlines()[0] if text else f"exit code {f.exitcode}"


def _worker_failure(e: Any, board: FailureBoard) -> BaseException:
    """The run's failure from torchelastic's ``ChildFailedError`` and the board of the attempt
    that failed last: a rank killed by a signal (it posts nothing), else the root record,
    else workers that all exited on a stop signal (:class:`RunInterrupted`), else the
    first process torchelastic saw fail."""
    dead = killed_rank(e.failures, board)
    if dead is not None:
        return dead
    root = board.root()
    if root is not None:
        return WorkerFailure.of(root)
    signum = interrupted_exit(int(f.exitcode) for f in e.failures.values())
    if signum is not None:
        return RunInterrupted(signum)
    rank, failure = min(e.failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    return WorkerFailure(rank, _failure_text(failure))


def launch_local(runs: Sequence[ResolvedRun], timeout: float = 120.0, max_restarts: int = 0) -> list[RunResult]:
    """Run ``runs`` one after the other in ``world_size`` fresh local processes (one launch).

    Every run must have the same ``world_size`` (> 1). Returns rank 0's result of each run.
    Raises :class:`WorkerFailure` if a worker fails (with the first failing rank, not the
    ranks it brought down). ``max_restarts``: torchelastic restarts every worker up to that
    many times after a failure (``--max-restarts``; the workers resume from the latest
    checkpoint in ``--checkpoint-dir``, :mod:`pipetrain.runtime.checkpoints.periodic`).
    """
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .worker.main import worker_main

    sizes = sorted({r.world_size for r in runs})
    if len(sizes) != 1 or sizes[0] < 2:
        raise RuntimeConfigError(f"launch_local runs resolved runs of one world size > 1, got sizes {sizes}")
    workers = sizes[0]
    reopen_closed_std_fds()
    # The failure board: workers post structured records here; read after they exit.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    board = FailureBoard(store)
    port = free_port()
    saved_omp = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the children's default (torch threads are set per worker)
    # One agent on this machine: torchrun's static rendezvous (a TCP store at the endpoint).
    # The dynamic c10d one records each of its steps with inspect.stack(), about 2 CPU
    # seconds per launch with torch imported.
    lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=workers, rdzv_backend="static",
                      rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"rank": 0}, max_restarts=max_restarts,
                      run_id=f"pipetrain-{uuid.uuid4().hex[:8]}",
                      monitor_interval=0.05, start_method=start_method(), rdzv_timeout=int(max(30, timeout)))
    start_server()  # forked workers (process/forkserver.py): no import of torch each
    try:
        with _quiet_launcher():
            out = elastic_launch(lc, forked_entry)(worker_main, dict(os.environ), StdStreams(), os.getpid(), list(runs),
                                                   BoardAddress("127.0.0.1", int(store.port), os.getpid()))
    except SignalException as e:  # the agent stopped the workers and waited for them
        raise RunInterrupted(int(e.sigval)) from None
    except KeyboardInterrupt:  # Ctrl-C before the agent took the signal: it stops the workers on its way out
        raise RunInterrupted(int(signal.SIGINT)) from None
    except ChildFailedError as e:
        raise _worker_failure(e, FailureBoard.latest(store, max_restarts + 1, workers)) from None
    finally:
        if saved_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        del board, store
    return [r for r in out[0] if r is not None]
