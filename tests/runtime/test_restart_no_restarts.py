"""A worker killed (SIGKILL) without restarts: the run fails with a clear error naming the dead
rank, every other worker exits well within 60 seconds of the kill, and no process is left."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from restart_cases import cfg, wait_no_children

from pipetrain.checkpoint import latest_checkpoint, read_manifest
from pipetrain.run import train
from pipetrain.runtime import WorkerFailure
from pipetrain.runtime.process.faults import KILL_STAMP_ENV

pytestmark = pytest.mark.timeout(300)


def test_killed_worker_is_named_and_everyone_exits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stamp = tmp_path / "killed_at"
    monkeypatch.setenv(KILL_STAMP_ENV, str(stamp))  # the workers inherit it: rank 2 writes its kill time
    with pytest.raises(WorkerFailure, match=r"rank 2 failed: .*signal SIGKILL") as e:
        train(cfg("flush", 4, "1-1-1-1", steps=4, checkpoint_every=2, checkpoint_dir=str(tmp_path / "ck"),
                  debug_fail="2:3:kill"))
    ended = time.time()
    assert e.value.rank == 2
    rank, killed_at = stamp.read_text().split()
    assert rank == "2"
    assert wait_no_children() == []
    # every worker is gone (the launcher returned after the agent reaped them), bounded well under 60 s
    assert ended - float(killed_at) < 60
    # the checkpoint of step 2 stays the latest complete one
    last = latest_checkpoint(tmp_path / "ck")
    assert last is not None and read_manifest(last).step == 2
    assert os.environ.get(KILL_STAMP_ENV) == str(stamp)
