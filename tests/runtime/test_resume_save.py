"""``--save PATH`` of a distributed run writes per rank (no gather to rank 0): every rank
writes its part of ``PATH.parts/step_S`` (layout-free, DCP), rank 0 exports the plain
``PATH`` from it and writes ``PATH.trainer`` (version 2, naming the parts). ``--resume PATH``
reads it in one process or on another layout; a tied tensor's optimizer state is found under
the name the resuming layout uses (one process: the first name, ``emb.weight``; the 2-stage
run saved the head's copy as ``head.weight`` and, with every_name, also as ``emb.weight``).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from restart_cases import wait_no_children
from test_tied import NODES, TiedLM, cfg, plan_file

from pipetrain.checkpoint import latest_checkpoint, read_manifest
from pipetrain.run import train
from pipetrain.runtime.checkpoints.export import load_checkpoint, parts_dir, trainer_path

pytestmark = pytest.mark.timeout(300)


def test_save_writes_parts_and_resumes_in_one_process_with_tied_optimizer_state(tmp_path: Path) -> None:
    two = plan_file(tmp_path, [NODES[:3], NODES[3:]])
    path = tmp_path / "model.pt"
    never_stopped = train(cfg(2, two, steps=4))
    first = train(cfg(2, two, steps=2, save=str(path)))
    assert first is not None and never_stopped is not None and first.saved == str(path)
    ck = latest_checkpoint(parts_dir(path))
    assert ck is not None and read_manifest(ck).world_size == 2 and read_manifest(ck).step == 2
    raw = torch.load(trainer_path(path), weights_only=False)
    assert raw["version"] == 2 and "optimizer_state" not in raw
    state, trainer = load_checkpoint(path)
    model = TiedLM()
    assert list(state) == list(model.state_dict())  # exactly the model's keys, in order
    model.load_state_dict(state)
    assert trainer.step == 2 and {"emb.weight", "head.weight"} <= set(trainer.optimizer_state)
    resumed = train(cfg(1, None, steps=2, resume=str(path)))  # type: ignore[arg-type]
    assert resumed is not None and resumed.start_step == 2
    assert resumed.losses == pytest.approx(never_stopped.losses[2:], rel=1e-5, abs=1e-6)
    assert wait_no_children() == []
