"""Resume a 4-worker checkpoint on 2 workers with another plan and schedule: the continued run
has the losses and final parameters of a run that never stopped (synchronous schedules, 1e-5).

Run A: flush on 4 workers (one layer group per worker), steps 0..1, checkpoint at step 2.
Run B: gpipe on 2 workers (--cut elsewhere), --steps 4, the same --checkpoint-dir: every rank
loads only its own parameters by name from A's checkpoint, trains steps 2..3.
Reference: gpipe on 2 workers, steps 0..3, never stopped. The loaded checkpoint also loads into
the plain model (``load_into_model``), for inference or export.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from restart_cases import MLP, cfg, max_rel_err, wait_no_children

from pipetrain.checkpoint import export_state_dict, latest_checkpoint, load_into_model, read_manifest
from pipetrain.models import get_model
from pipetrain.run import train

pytestmark = pytest.mark.timeout(400)


def test_resume_on_two_workers_with_another_plan_and_schedule(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    first = train(cfg("flush", 4, "1-1-1-1", steps=2, checkpoint_dir=ck))
    assert first is not None
    man = read_manifest(latest_checkpoint(ck))  # type: ignore[arg-type]
    assert man.step == 2 and man.world_size == 4 and man.info["schedule"] == "flush"
    resumed = train(cfg("gpipe", 2, "1-1", steps=4, checkpoint_dir=ck))
    never_stopped = train(cfg("gpipe", 2, "1-1", steps=4))
    assert resumed is not None and never_stopped is not None
    assert resumed.state is not None and never_stopped.state is not None
    assert len(resumed.losses) == 2
    assert resumed.losses == pytest.approx(never_stopped.losses[2:], rel=1e-5, abs=1e-6)
    assert max_rel_err(resumed.state, never_stopped.state) <= 1e-5
    final = latest_checkpoint(ck)
    assert final is not None and read_manifest(final).step == 4 and read_manifest(final).world_size == 2
    # the final checkpoint into the plain model (inference/export)
    model = get_model("mlp", batch_size=8, **MLP).model
    load_into_model(final, model)
    assert max_rel_err({k: v for k, v in model.state_dict().items()}, never_stopped.state) <= 1e-5
    out = export_state_dict(final, tmp_path / "model.pt")
    assert max_rel_err(torch.load(out, weights_only=True), never_stopped.state) <= 1e-5
    assert wait_no_children() == []
