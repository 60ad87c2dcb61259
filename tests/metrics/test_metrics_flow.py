"""The metrics pieces together, as a driving process uses them: a small model trained to a
target accuracy in one process, with evaluation, logs, progress, tracker, table and plots."""
from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipetrain.metrics import (
    CompareRow,
    EvalAccumulator,
    EvalResult,
    MetricsLogger,
    Progress,
    TargetTracker,
    TrainClock,
    TrainPoint,
    format_table,
    read_metrics,
    rows_to_json,
    write_run_files,
)
from pipetrain.metrics.plots import write_plots


def _train(log_dir: Path, target_accuracy: float, epochs: int, eval_every: int) -> tuple[TargetTracker, float]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    w_true = torch.randn(8, 3, generator=g)
    x = torch.randn(480, 8, generator=g)
    y = (x @ w_true).argmax(-1)
    train_x, train_y, eval_x, eval_y = x[:384], y[:384], x[384:], y[384:]
    model = torch.nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    batch, steps_per_epoch = 32, 384 // 32
    total = epochs * steps_per_epoch
    tracker = TargetTracker(target_accuracy=target_accuracy)
    clock = TrainClock()
    write_run_files(log_dir, {"model": "linear", "lr": 0.5}, {"stages": 1}, "one process")
    with MetricsLogger(log_dir) as mlog, Progress(total, steps_per_epoch=steps_per_epoch, batch_size=batch,
                                                  stream=io.StringIO(), log_every=6) as bar:
        for step in range(1, total + 1):
            i = (step - 1) % steps_per_epoch * batch
            loss = F.cross_entropy(model(train_x[i:i + batch]), train_y[i:i + batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
            epoch, samples = step / steps_per_epoch, step * batch
            bar.update(step, loss=loss.item())
            mlog.log_train(TrainPoint(step, epoch, samples, loss.item(), bar.samples_per_second, clock.elapsed()))
            if step % eval_every == 0:
                with clock.paused(), torch.no_grad():
                    acc = EvalAccumulator()
                    for j in range(0, 96, 40):  # eval batches of any size: the sums are exact
                        acc.update(model(eval_x[j:j + 40]), eval_y[j:j + 40])
                result = acc.result(step, epoch, samples, clock.elapsed())
                mlog.log_eval(result, samples_per_second=bar.samples_per_second)
                bar.eval(result)
                if tracker.update(result):
                    break
        mlog.log_event("end", **tracker.to_dict())
    return tracker, bar.samples_per_second or 0.0


def test_a_run_to_a_target_leaves_consistent_records(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pipetrain"):
        tracker, sps = _train(tmp_path / "reach", target_accuracy=0.9, epochs=20, eval_every=6)
    assert tracker.reached, tracker.summary()
    r = tracker.reached_at
    assert r is not None and r.accuracy is not None and r.accuracy >= 0.9
    assert tracker.history[-1] is r  # the run stopped at the first crossing
    assert all(h.accuracy is not None and h.accuracy < 0.9 for h in tracker.history[:-1])
    assert tracker.epochs_to_target == r.step / 12 and r.step % 6 == 0  # fractional epochs (every half epoch)

    lines = read_metrics(tmp_path / "reach")
    evals = [EvalResult.from_dict(d) for d in lines if d["kind"] == "eval"]
    assert evals == tracker.history
    trains = [d for d in lines if d["kind"] == "train"]
    assert [d["step"] for d in trains] == list(range(1, r.step + 1))
    assert lines[-1]["kind"] == "end" and lines[-1]["time_to_accuracy"] == r.wall_time
    written = {p.name for p in (tmp_path / "reach").iterdir()}
    assert {"config.json", "plan.json", "schedule.txt", "metrics.jsonl"} <= written
    assert any(m.getMessage().startswith("eval at epoch") for m in caplog.records)

    missed, sps2 = _train(tmp_path / "miss", target_accuracy=1.0, epochs=2, eval_every=12)
    assert not missed.reached and len(missed.history) == 2
    assert missed.summary().startswith("target accuracy 1 not reached in 2 epochs (best ")

    rows = [CompareRow.from_tracker("dp", tracker, sps, 0.0), CompareRow.from_tracker("flush", missed, sps2, 128.0)]
    table = format_table(rows, target=tracker.describe_target())
    assert table.splitlines()[2].startswith("dp") and table.splitlines()[3].startswith("flush")
    doc = json.loads(json.dumps(rows_to_json(rows)))
    assert [row["reached"] for row in doc["rows"]] == [True, False]
    paths = write_plots(rows, tmp_path / "plots", target_accuracy=0.9)
    assert all(p.stat().st_size > 0 for p in paths)
