"""Local workers forked from a server that has imported torch and the worker once.

``launch_local`` starts its workers with torchelastic's ``forkserver`` start method where the
platform has it (``spawn`` elsewhere). Python's fork server is one process, started from a
fresh interpreter (never a fork of the launcher, which may hold threads and a captured
model), that imports :data:`PRELOAD` once; every worker is then a ``fork`` of it. Against
``spawn`` this saves each worker its own import of torch and of the runtime (about 2 CPU
seconds each, four of them contending for a 2-core machine's cores), and a worker ends with
``os._exit`` after its result is handed over instead of a full interpreter teardown.

Invariant: a worker sees the launcher's environment and standard streams as they are at the
launch, as under ``spawn``. The server's own are the launcher's when the server started, so
:func:`worker_environment` rebuilds the environment in the worker (the launcher's, handed
over with the worker's arguments, plus the variables torchelastic set for this worker: those
that differ from the server's, :data:`SERVER_ENV`), and :class:`StdStreams` hands the
launcher's descriptors 1 and 2 over (passed through the server's socket, as
``multiprocessing`` passes any descriptor) for the worker to write to.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.context import ForkServerContext
from typing import Any

from .orphans import exit_launcher_gone, exit_with_launcher, process_alive

__all__ = ["PRELOAD", "SERVER_ENV", "StdStreams", "forked_entry", "reopen_closed_std_fds", "server_processes",
           "start_method", "start_server", "wants_local_workers", "worker_environment"]

#: What the fork server imports before it forks any worker.
PRELOAD = ["torch", "torch.distributed", "pipetrain.runtime.process.forkserver", "pipetrain.runtime.worker.main"]

#: The environment of the process that imported this module first: in the fork server, the
#: launcher's environment when the server started (every forked worker inherits it).
SERVER_ENV: dict[str, str] = dict(os.environ)


def start_method() -> str:
    """``forkserver`` where this platform has it, else ``spawn``."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def start_server() -> None:
    """Start the fork server now (idempotent; it lives as long as this process), so that its
    imports overlap this process's own work. ``OMP_NUM_THREADS`` defaults to 1 in it, as in
    every worker (torch's threads are then set per worker)."""
    if start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(PRELOAD)
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)


def server_processes() -> ForkServerContext | None:
    """The fork server's ``multiprocessing`` context, the server started now if it is not
    yet, for short-lived processes that need torch beside the workers (a calibration's ranks,
    :func:`pipetrain.cluster.measure.calibrate`); None where this platform has no fork server.
    Such a process inherits the server's environment, not the launcher's (module docstring):
    it sets what it needs itself."""
    if start_method() != "forkserver":
        return None
    start_server()
    return multiprocessing.get_context("forkserver")


def worker_environment(launcher: Mapping[str, str]) -> None:
    """Make this worker's environment the launcher's ``launcher`` plus what torchelastic set
    for it (module docstring)."""
    own = {k: v for k, v in os.environ.items() if SERVER_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update(launcher)
    os.environ.update(own)


class StdStreams:
    """The launcher's standard output and error at the launch, for a forked worker: pickled
    (when the worker is started) as the two descriptors, which the worker then writes to."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing import reduction

        return _adopt_streams, (reduction.DupFd(1), reduction.DupFd(2))


def _adopt_streams(out: Any, err: Any) -> None:
    """In the worker: make descriptors 1 and 2 the launcher's (``DupFd`` wrappers)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    for wrapper, fd in ((out, 1), (err, 2)):
        got = wrapper.detach()
        if got != fd:
            os.dup2(got, fd)
            os.close(got)


def forked_entry(entry: Callable[..., Any], launcher: Mapping[str, str], streams: Any, launcher_pid: int,
                 *args: Any) -> Any:
    """A worker's entry point: the launcher's environment first (``streams``, the unpickled
    :class:`StdStreams`, has already made its descriptors the worker's), a watch that ends this
    worker when the launcher ``launcher_pid`` has ended (:mod:`.orphans`), then ``entry(*args)``.
    Whatever ``entry`` raises after the launcher has ended, the worker ends as the watch ends it:
    a peer the watch ended first breaks this worker's transfers before its own watch looks."""
    worker_environment(launcher)
    exit_with_launcher(launcher_pid)
    try:
        return entry(*args)
    except BaseException:
        if not process_alive(launcher_pid):
            exit_launcher_gone(launcher_pid)
        raise


def reopen_closed_std_fds() -> None:
    """Give closed standard descriptors /dev/null (CI jobs and daemons may start us without stdin).

    Otherwise the launcher's next socket takes descriptor 0 and is inherited as the stdin of
    every worker process, which makes torchrun's rendezvous stall or fail at shutdown.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one


def wants_local_workers(argv: Sequence[str]) -> bool:
    """Whether a command line will launch local workers (``train`` or ``compare`` with
    ``--workers N``, N > 1, ``--config`` or ``--plan``; not under torchrun), read from the
    words alone so that the fork server can start before the command imports torch."""
    if not argv or argv[0] not in ("train", "compare") or "LOCAL_RANK" in os.environ:
        return False
    for i, word in enumerate(argv):
        key, eq, value = word.partition("=")
        if key in ("--config", "--plan"):
            return True
        if key == "--workers":
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if not value.isdigit() or int(value) > 1:
                return True
    return False
