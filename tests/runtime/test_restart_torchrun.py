"""Restarts under an outer ``torchrun``: the workers resume from ``--checkpoint-dir``.

1. ``torchrun --standalone --nnodes 1 --nproc-per-node 2 --max-restarts 1 -m pipetrain train
   ... --checkpoint-dir D --checkpoint-every 2 --debug-fail 1:3:kill --save A``: rank 1
   SIGKILLs itself at step 3 of the first attempt; torchrun restarts both workers, which
   resume from D's checkpoint of step 2 and finish step 6. ``A`` (the final model) equals an
   uninterrupted run's parameters (1e-5).
2. The same command with ``--steps 8 --checkpoint-every 4`` on D (latest: step 6, not a
   boundary of every 4): rank 0's resolve path cuts the run at step 6 (``cut_at``, as the
   local launcher does) and the run continues to step 8, equal to an uninterrupted 8-step run.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from restart_cases import MLP, cfg, max_rel_err, wait_no_children

from pipetrain.checkpoint import latest_checkpoint, read_manifest
from pipetrain.run import train

pytestmark = pytest.mark.timeout(400)


def torchrun(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    options = [x for k, v in MLP.items() for x in ("--option", f"{k}={v}")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           "--max-restarts", "1", "-m", "pipetrain", "train", "--model", "mlp", *options, "--config", "1-1",
           "--schedule", "flush", "--batch-size", "8", "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9",
           "--timeout", "30", "--checkpoint-dir", str(tmp / "ck"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


def test_torchrun_restart_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    killed = torchrun(tmp_path, "--steps", "6", "--checkpoint-every", "2", "--debug-fail", "1:3:kill",
                      "--save", str(tmp_path / "a.pt"))
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "exitcode: -9" in killed.stderr  # rank 1 was killed, and the group restarted
    assert "trained 4 steps" in killed.stdout  # the restarted attempt resumed at step 2
    straight = train(cfg("flush", 2, "1-1", steps=6))
    assert straight is not None and straight.state is not None
    assert max_rel_err(torch.load(tmp_path / "a.pt", weights_only=True), straight.state) <= 1e-5

    more = torchrun(tmp_path, "--steps", "8", "--checkpoint-every", "4", "--save", str(tmp_path / "b.pt"))
    assert more.returncode == 0, more.stderr[-3000:]
    assert "trained 2 steps" in more.stdout  # resumed at 6, cut there
    last = latest_checkpoint(tmp_path / "ck")
    assert last is not None and read_manifest(last).step == 8
    longer = train(cfg("flush", 2, "1-1", steps=8))
    assert longer is not None and longer.state is not None
    assert max_rel_err(torch.load(tmp_path / "b.pt", weights_only=True), longer.state) <= 1e-5
    assert wait_no_children() == []
