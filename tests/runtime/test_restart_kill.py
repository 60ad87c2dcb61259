"""Elastic restarts: SIGKILL one worker of a 4-worker run with ``--max-restarts 1``; the run
resumes from the last complete checkpoint and ends with the parameters of an uninterrupted run.

``--debug-fail 2:3:kill`` makes rank 2 SIGKILL itself at the first forward of step 3 on the
first attempt only (checkpoints are at steps 2 and 4). The uninterrupted run to compare with
has no checkpoints: ``pipedream``'s checkpoint of step 2 is cut inside the pipeline without a
drain, and the restart resumes it exactly (runtime/checkpoints/periodic.py, ``CutCheckpoints``).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from restart_cases import cfg, max_rel_err, wait_no_children

from pipetrain.checkpoint import latest_checkpoint, read_manifest
from pipetrain.run import train

pytestmark = pytest.mark.timeout(400)


@pytest.mark.parametrize("schedule", ["flush", "pipedream"])
def test_sigkill_with_restart_equals_uninterrupted(tmp_path: Path, schedule: str) -> None:
    straight = train(cfg(schedule, 4, "1-1-1-1", steps=4))
    assert straight is not None and straight.state is not None
    killed = train(cfg(schedule, 4, "1-1-1-1", checkpoint_dir=str(tmp_path / "killed"), max_restarts=1,
                       debug_fail="2:3:kill", steps=4, checkpoint_every=2))
    assert killed is not None and killed.state is not None
    assert max_rel_err(killed.state, straight.state) <= 1e-5
    # the restarted attempt trained steps 2..3 only: its losses are the uninterrupted run's last two
    assert killed.losses == pytest.approx(straight.losses[2:], rel=1e-5)
    last = latest_checkpoint(tmp_path / "killed")
    assert last is not None and read_manifest(last).step == 4
    assert wait_no_children() == []
