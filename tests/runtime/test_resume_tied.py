"""Tied parameters in checkpoints: a tensor held under several names (``emb.weight`` and
``head.weight``, as GPT-2's ``transformer.wte.weight`` and ``lm_head.weight``) is saved with
its weights, optimizer state and step count under EVERY name (checkpointing.every_name), so a
layout that holds it under another name resumes with its optimizer state.

Adam is used: a dropped ``exp_avg``/``exp_avg_sq`` of the tied tensor changes the next step,
so the losses after resuming would differ from a run that never stopped.

- saved on 2 stages (embedding on stage 0, head on stage 1: each copy under its own name),
  resumed on 1 stage (2 replicas, ``dp``: one name for both readers);
- saved on 1 stage (one name), resumed on 3 stages (the head's copy under ``head.weight``,
  which the 1-stage checkpoint holds only as an alias).
Both continue with the losses of a 2-stage flush run that never stopped (1e-5).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from restart_cases import wait_no_children
from test_tied import NODES, cfg, plan_file

from pipetrain.checkpoint import latest_checkpoint, read_manifest
from pipetrain.run import train

pytestmark = pytest.mark.timeout(400)

STEPS = 4
SAVED_AT = 2


def _train(workers: int, plan: str, **kw: Any) -> Any:
    out = train(cfg(workers, plan, **kw))
    assert out is not None
    return out


def test_tied_checkpoint_resumes_on_another_number_of_stages(tmp_path: Path) -> None:
    two = plan_file(tmp_path, [NODES[:3], NODES[3:]])
    one = plan_file(tmp_path, [NODES], (2,))
    three = plan_file(tmp_path, [NODES[:2], NODES[2:5], NODES[5:]])
    never_stopped = _train(2, two, steps=STEPS)

    # 2 stages -> 1 stage
    ck = tmp_path / "ck2"
    _train(2, two, steps=SAVED_AT, checkpoint_dir=str(ck))
    man = read_manifest(latest_checkpoint(ck))  # type: ignore[arg-type]
    for key in ("emb.weight", "head.weight"):  # every name, with its optimizer state and steps
        assert key in man.model and "exp_avg" in man.optimizer[key] and man.stage_steps[key] == SAVED_AT
    resumed = _train(2, one, steps=STEPS, schedule="dp", checkpoint_dir=str(ck))
    assert resumed.losses == pytest.approx(never_stopped.losses[SAVED_AT:], rel=1e-5, abs=1e-6)

    # 1 stage -> 3 stages
    ck = tmp_path / "ck1"
    _train(2, one, steps=SAVED_AT, schedule="dp", checkpoint_dir=str(ck))
    man = read_manifest(latest_checkpoint(ck))  # type: ignore[arg-type]
    assert {"emb.weight", "head.weight"} <= set(man.optimizer)
    resumed = _train(3, three, steps=STEPS, checkpoint_dir=str(ck))
    assert resumed.losses == pytest.approx(never_stopped.losses[SAVED_AT:], rel=1e-5, abs=1e-6)
    assert wait_no_children() == []
