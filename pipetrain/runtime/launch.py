"""Starting a run: torchrun's launcher API locally, or one worker under an outer torchrun.

:func:`train` is the library entry point behind ``pipetrain train``:

- under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) this process *is* one
  worker: it runs :func:`~pipetrain.runtime.worker.run_rank` and rank 0 returns the summary;
- with ``workers == 1`` it trains in this process (:mod:`pipetrain.runtime.single`);
- otherwise it starts ``workers`` local processes with
  ``torch.distributed.launcher.api.elastic_launch`` (the launcher ``torchrun`` itself uses:
  c10d rendezvous on ``127.0.0.1:<free port>``, ``max_restarts=0``), and returns rank 0's
  result. A worker's failure surfaces as one :class:`WorkerFailure` naming the rank.

Several machines: run on each ::

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m pipetrain train --model vgg16 --config 3-1 --schedule pipedream --steps 100
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import uuid
from typing import Any, Iterator, Sequence

from ..errors import PipetrainError, RuntimeConfigError
from .config import TrainConfig
from .worker import STOPPED_MARK

__all__ = ["WorkerFailure", "train", "launch_local", "under_torchrun", "free_port"]


class WorkerFailure(RuntimeError):
    """A worker process failed; ``rank`` is the one that failed first, ``message`` its error."""

    def __init__(self, rank: int, message: str, user_error: bool = False) -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank
        self.message = message
        self.user_error = user_error


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another elastic agent) as a worker."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _quiet_launcher() -> Iterator[None]:
    """Silence torchelastic's own logging (tracebacks of failed workers, SIGTERM notices):
    the failure is reported once, as a WorkerFailure."""
    names = [n for n in list(logging.root.manager.loggerDict)
             if n.startswith(("torch.distributed.elastic", "torch.multiprocessing", "torch.distributed.launcher"))]
    names += ["torch.distributed.elastic", "torch.multiprocessing", "torch.distributed.launcher"]
    saved = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for n, lv in saved.items():
            logging.getLogger(n).setLevel(lv)


def _failure_text(f: Any) -> str:
    msg = f.message
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    text = str(msg or "").strip()
    if not text or text.startswith("Signal"):
        text = text or f"exit code {f.exitcode}"
    return text.splitlines()[0] if text else f"exit code {f.exitcode}"


def _user_error_names() -> set[str]:
    """Class names of every PipetrainError subclass (a worker's error arrives as text)."""
    names, todo = {"PipetrainError"}, list(PipetrainError.__subclasses__())
    while todo:
        c = todo.pop()
        names.add(c.__name__)
        todo.extend(c.__subclasses__())
    return names


def _originating_failure(failures: dict[int, Any]) -> tuple[int, str]:
    """(rank, ``Type: message``) of the failure that started it all.

    A worker whose peer failed first reports ``rank R stopped because rank Q failed: Type:
    message`` (the first failure recorded in the rendezvous store), so that text names the
    origin even when rank Q's own record is missing or uninformative (killed, no message).
    Otherwise the earliest failure with a message of its own is the origin.
    """
    fails = sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    texts = {r: _failure_text(f) for r, f in fails}

    def informative(t: str) -> bool:
        return STOPPED_MARK not in t and not t.startswith(("Signal", "exit code"))

    roots = [r for r, t in texts.items() if informative(t)]
    if roots:
        return roots[0], texts[roots[0]]
    for t in texts.values():
        if STOPPED_MARK in t:
            origin = t.split(STOPPED_MARK, 1)[1].strip()       # "Q failed: Type: message"
            q, sep, rest = origin.partition(" failed: ")
            if sep and q.strip().isdigit():
                return int(q), rest.strip()
    return fails[0][0], texts[fails[0][0]]


def reopen_closed_std_fds() -> None:
    """Give closed standard descriptors /dev/null (CI jobs and daemons may start us without stdin).

    Otherwise the launcher's next socket takes descriptor 0 and is inherited as the stdin of
    every worker process, which made torchrun's rendezvous stall or fail at shutdown.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one


def launch_local(cfgs: Sequence[TrainConfig], workers: int, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Run ``cfgs`` one after the other in ``workers`` fresh local processes (one launch).

    Returns rank 0's result of each config. Raises :class:`WorkerFailure` if a worker fails
    (with the first failing rank, not the ranks it brought down).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .worker import worker_main

    reopen_closed_std_fds()
    port = free_port()
    saved_omp = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the children's default (torch threads are set per worker)
    lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=workers, rdzv_backend="c10d",
                      rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=0, run_id=f"pipetrain-{uuid.uuid4().hex[:8]}",
                      monitor_interval=0.05, start_method="spawn", rdzv_timeout=int(max(30, timeout)))
    try:
        with _quiet_launcher():
            out = elastic_launch(lc, worker_main)(list(cfgs))
    except ChildFailedError as e:
        rank, text = _originating_failure(e.failures)
        user = text.split(":", 1)[0] in _user_error_names()
        if user:
            text = text.split(": ", 1)[-1]
        raise WorkerFailure(rank, text, user_error=user) from None
    finally:
        if saved_omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
    return list(out[0])


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run one training run described by ``cfg`` (see the module docstring); returns the
    summary (rank 0's; other ranks under torchrun get ``{"rank": r}``)."""
    if under_torchrun():
        from .worker import run_rank

        world = int(os.environ["WORLD_SIZE"])
        if cfg.workers is not None and cfg.workers != world:
            raise RuntimeConfigError(
                f"--workers {cfg.workers} but torchrun started {world} processes; pass --workers {world} or omit it")
        return run_rank(cfg)
    workers = cfg.workers
    if workers is None:
        from .resolve import config_workers

        workers = config_workers(cfg) or 1
    from .preflight import preflight

    preflight(cfg, workers)  # everything decidable before any process starts
    if workers == 1:
        from .single import train_one_process

        return train_one_process(cfg)
    from dataclasses import replace

    return launch_local([replace(cfg, workers=workers)], workers, cfg.timeout)[0]
