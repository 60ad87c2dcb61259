"""Training on real data through the pipeline: accuracy after a few epochs, logs, stopping at a
target. Factories, shards and evaluation: test_train_data_eval.py; bad input:
test_train_data_errors.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.metrics import read_metrics

pytestmark = pytest.mark.timeout(180)

SMALL = ["--model", "mlp", "--option", "depth=4", "--option", "width=64"]
ADAM = ["--optimizer", "adam", "--lr", "0.003", "--batch-size", "32"]


def _json(capsys: pytest.CaptureFixture[str]) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


def test_digits_pipedream_reaches_accuracy(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """mlp on digits, 2 stages, pipedream, 3 epochs: evaluated every epoch through the pipeline.
    (Measured 0.944 at seed 0; a chance classifier scores 0.1.)"""
    logs = tmp_path / "logs"
    rc = main(["train", *SMALL, *ADAM, "--data", "digits", "--workers", "2", "--config", "1-1", "--schedule",
               "pipedream", "--epochs", "3", "--json", "--log-dir", str(logs)])
    assert rc == 0
    res = _json(capsys)
    assert res["data"] == "digits" and res["steps"] == 3 * (1437 // 32)
    assert [h["epoch"] for h in res["eval_history"]] == [1.0, 2.0, 3.0]
    assert all(h["eval_samples"] == 360 for h in res["eval_history"])
    assert res["eval_accuracy"] > 0.8
    assert res["eval_accuracy"] == res["eval_history"][-1]["accuracy"]
    assert res["reached"] is None and res["epochs"] == 3.0 and res["time_excludes_eval"] is True
    # --log-dir: the run's files before training, every evaluation and train points after
    for name in ("config.json", "plan.json", "schedule.txt", "metrics.jsonl"):
        assert (logs / name).is_file(), name
    lines = read_metrics(logs)
    assert [ln["step"] for ln in lines if ln["kind"] == "eval"] == [44, 88, 132]
    assert any(ln["kind"] == "train" for ln in lines)
    assert lines[-1]["kind"] == "target"


def test_stops_at_target(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["train", *SMALL, *ADAM, "--data", "digits", "--workers", "2", "--config", "1-1", "--schedule",
               "flush", "--microbatches", "2", "--epochs", "5", "--eval-every", "10", "--target-accuracy", "0.5",
               "--json"])
    assert rc == 0
    res = _json(capsys)
    assert res["reached"] is True
    total = 5 * (1437 // 32)
    assert res["steps_to_accuracy"] is not None and res["steps_to_accuracy"] < total
    assert res["steps"] == res["steps_to_accuracy"]                  # stopped there, on every rank
    assert res["eval_history"][-1]["accuracy"] >= 0.5
    assert all(h["accuracy"] < 0.5 for h in res["eval_history"][:-1])
    assert res["time_to_accuracy"] > 0 and res["epochs_to_accuracy"] == res["steps_to_accuracy"] / 44
    assert "reached at epoch" in res["target_summary"]


