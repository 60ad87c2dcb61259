"""A checkpoint write interrupted halfway (SIGKILL inside it) is never used: the previous one is.

``--debug-fail 0:4:kill-save`` makes rank 0 SIGKILL itself inside the write of step 4's
checkpoint, after every rank's tensor files and DCP's metadata are on disk and before the
manifest: ``step_00000004.tmp/`` stays behind, ``latest_checkpoint`` returns step 2, and a run
started again with the same directory resumes from step 2 and ends as an uninterrupted run.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from restart_cases import cfg, max_rel_err, wait_no_children

from pipetrain.checkpoint import latest_checkpoint, read_manifest
from pipetrain.run import train
from pipetrain.runtime import WorkerFailure

pytestmark = pytest.mark.timeout(400)


def test_kill_during_checkpoint_write_keeps_the_previous_one(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    kw = dict(steps=6, checkpoint_every=2)
    with pytest.raises(WorkerFailure, match=r"rank 0 failed: .*signal SIGKILL"):
        train(cfg("flush", 2, "1-1", checkpoint_dir=str(ck), debug_fail="0:4:kill-save", **kw))
    assert wait_no_children() == []
    partial = ck / "step_00000004.tmp"
    assert partial.is_dir() and any(f.suffix == ".distcp" for f in partial.iterdir())
    assert not (partial / "manifest.json").exists() and not (ck / "step_00000004").exists()
    last = latest_checkpoint(ck)
    assert last is not None and read_manifest(last).step == 2
    again = train(cfg("flush", 2, "1-1", checkpoint_dir=str(ck), **kw))
    straight = train(cfg("flush", 2, "1-1", steps=6))  # flush: draining changes nothing
    assert again is not None and straight is not None and again.state is not None and straight.state is not None
    assert again.losses == pytest.approx(straight.losses[2:], rel=1e-5)
    assert max_rel_err(again.state, straight.state) <= 1e-5
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000002", "step_00000004", "step_00000006"]
