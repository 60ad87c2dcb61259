"""Shared launcher of tests/runtime/test_checkpoint_dist.py and tests/runtime/test_traffic_dist.py (not a test module).

:func:`launch` runs a worker function on ``world`` gloo ranks (127.0.0.1, a free port), each
a child of a ``forkserver`` (one clean process imports torch and the modules it is told to
preload once, then forks every child: fast, and fork-safe since that process runs no threads
of its own). It fails, never hangs: a rank still alive at the deadline is killed, and every
rank's traceback (``error_RANK.txt`` in the output folder) is in the assertion's message.
"""
from __future__ import annotations

import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def context(preload: Sequence[str]) -> Any:
    """The ``forkserver`` context, preloading ``preload`` (modules) in the server."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def join_or_kill(procs: Sequence[Any], timeout_s: float = TIMEOUT_S) -> list[int]:
    """Wait for ``procs`` up to ``timeout_s`` in all; kill those still alive. Returns their indices."""
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return hung


def _entry(fn: Callable[..., None], rank: int, world: int, port: int, out: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        try:
            fn(rank, world, Path(out), *args)
        finally:
            dist.destroy_process_group()
    except BaseException:
        Path(out, f"error_{rank}.txt").write_text(traceback.format_exc())
        raise


def launch(fn: Callable[..., None], world: int, out: Path, *args: Any, preload: Sequence[str]) -> None:
    """Run ``fn(rank, world, out, *args)`` on ``world`` gloo ranks; fail (never hang) on error."""
    ctx = context(preload)
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, str(out), args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    hung = join_or_kill(procs)
    errors = [f.read_text() for f in sorted(out.glob("error_*.txt"))]
    assert not hung, f"ranks {hung} did not finish in {TIMEOUT_S} s; errors: {errors}"
    assert all(p.exitcode == 0 for p in procs), f"exit codes {[p.exitcode for p in procs]}; errors: {errors}"
