"""Shared helpers of tests/test_restart*.py and tests/test_resume*.py (not a test module).

Small models on gloo (127.0.0.1, free ports chosen by the launcher), one thread per rank,
a process-group timeout on every wait; :func:`children` lists this process's descendants
from /proc so that tests can check that no worker is left behind.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from pipetrain.job import OptimizerConfig, TrainConfig
from pipetrain.models import TINY_OPTIONS

MLP = dict(TINY_OPTIONS["mlp"], depth=6)
SGD = OptimizerConfig("sgd", lr=0.1, momentum=0.9)
TIMEOUT = 30  # seconds any receive, collective or rendezvous may wait


def cfg(schedule: str, workers: int, config: str, **kw: Any) -> TrainConfig:
    """A small run: mlp of depth 6, batch 8, SGD with momentum, state returned."""
    base: dict[str, Any] = dict(model="mlp", model_options=MLP, batch_size=8, steps=4, optimizer=SGD,
                                return_state=True, timeout=TIMEOUT, quiet=True)
    base.update(kw)
    return TrainConfig.of(schedule=schedule, workers=workers, config=config, **base)


def max_rel_err(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Largest difference over all tensors, relative to each tensor's largest magnitude."""
    assert set(state) == set(ref), sorted(set(state) ^ set(ref))[:4]
    return max(float((state[k].float() - ref[k].float()).abs().max() / (ref[k].float().abs().max() + 1e-6))
               for k in ref)


def children(pid: int | None = None) -> list[int]:
    """Live descendants of ``pid`` (default: this process), from /proc; zombies excluded."""
    root = os.getpid() if pid is None else pid
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parent[int(d.name)] = int(fields[1])
    out, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def workers_left() -> list[str]:
    """Command lines of this process's live descendants, except multiprocessing's own helpers:
    the resource tracker (one per parent process, started by the first ``spawn``) and the
    forkserver (started by tests that use the ``forkserver`` context, e.g.
    test_checkpoint_dist.py): both belong to the test process, not to a run, and exit with it."""
    own = ("resource_tracker", "multiprocessing.forkserver")
    return [c for c in (_cmdline(p) for p in children()) if c and not any(o in c for o in own)]


def wait_no_children(deadline_s: float = 30.0) -> list[str]:
    """Wait until no worker process of ours is alive (or the deadline); returns those left."""
    end = time.monotonic() + deadline_s
    left = workers_left()
    while left and time.monotonic() < end:
        time.sleep(0.2)
        left = workers_left()
    return left
