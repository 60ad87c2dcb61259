"""MetricsLogger and write_run_files: lines on disk after every write, TensorBoard events."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipetrain.errors import RuntimeConfigError
from pipetrain.metrics import EvalResult, MetricsLogger, TrainPoint, read_metrics, write_run_files
from pipetrain.metrics import logger as logger_mod

REQUIRED = {"kind", "step", "epoch", "samples", "loss", "accuracy", "samples_per_second", "wall_time"}


def _eval(step: int, acc: float) -> EvalResult:
    return EvalResult(step=step, epoch=step / 10, samples=step * 8, loss=1.0 - acc, accuracy=acc, perplexity=None,
                      wall_time=step * 0.1, eval_samples=100, eval_targets=100)


def test_every_line_is_on_disk_right_after_its_write(tmp_path: Path) -> None:
    mlog = MetricsLogger(tmp_path, tensorboard=False)
    for step in range(1, 4):
        mlog.log_train(TrainPoint(step=step, epoch=step / 10, samples=step * 8, loss=0.5 / step,
                                  samples_per_second=100.0, wall_time=step * 0.1, lr=0.01))
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2 * step - 1  # not closed yet
        mlog.log_eval(_eval(step, 0.5 + step / 10), samples_per_second=99.0)
        assert len(read_metrics(tmp_path)) == 2 * step
    lines = read_metrics(tmp_path)
    assert [line["kind"] for line in lines] == ["train", "eval"] * 3
    assert all(set(line) >= REQUIRED for line in lines)
    assert lines[1]["accuracy"] == pytest.approx(0.6) and lines[1]["samples_per_second"] == 99.0
    assert lines[0]["loss"] == 0.5 and lines[0]["lr"] == 0.01 and lines[0]["accuracy"] is None
    assert EvalResult.from_dict(lines[5]) == _eval(3, 0.8)
    assert TrainPoint.from_dict(lines[4]) == TrainPoint(3, 0.3, 24, 0.5 / 3, 100.0, 3 * 0.1, lr=0.01)
    mlog.close()
    mlog.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        mlog.log_event("late")


def test_lines_survive_a_process_that_dies_without_closing(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os
        from pipetrain.metrics import MetricsLogger, TrainPoint
        mlog = MetricsLogger({str(tmp_path)!r}, tensorboard=False)
        for step in (1, 2, 3):
            mlog.log_train(TrainPoint(step, step / 3, step * 4, 1.0 / step, 10.0, float(step)))
        os._exit(3)  # no close, no atexit, no buffer flush by Python
    """)
    proc = subprocess.run([sys.executable, "-c", script], timeout=120, capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    lines = read_metrics(tmp_path)
    assert [line["step"] for line in lines] == [1, 2, 3]


def test_non_finite_values_are_written_as_null(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as mlog:
        mlog.log_train(TrainPoint(1, 0.1, 8, float("nan"), float("inf"), 0.1))
        mlog.log_event("target", reached=False, time_to_accuracy=float("nan"), nested={"x": [1.0, float("-inf")]})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    first, second = (json.loads(s) for s in text.splitlines())
    assert first["loss"] is None and first["samples_per_second"] is None
    assert second == {**second, "kind": "target", "reached": False, "time_to_accuracy": None,
                      "nested": {"x": [1.0, None]}}


def test_append_keeps_earlier_lines(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as mlog:
        mlog.log_event("a")
    with MetricsLogger(tmp_path, tensorboard=False, append=True) as mlog:
        mlog.log_event("b")
    assert [line["kind"] for line in read_metrics(tmp_path)] == ["a", "b"]
    with MetricsLogger(tmp_path, tensorboard=False) as mlog:
        mlog.log_event("c")
    assert [line["kind"] for line in read_metrics(tmp_path)] == ["c"]


def test_tensorboard_event_file_holds_the_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path / "run") as mlog:
        assert mlog.tensorboard
        mlog.log_train(TrainPoint(5, 0.5, 40, 0.75, 123.0, 1.0))
        mlog.log_eval(_eval(10, 0.875))
        events = list((tmp_path / "run").glob("events.out.tfevents.*"))
        assert len(events) == 1 and events[0].stat().st_size > 0  # flushed before close
    ea = EventAccumulator(str(tmp_path / "run"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"train/loss", "train/samples_per_second", "eval/loss", "eval/accuracy", "eval/epoch"} <= tags
    assert "eval/perplexity" not in tags and "train/lr" not in tags  # None values are not written
    (acc,) = ea.Scalars("eval/accuracy")
    assert acc.step == 10 and acc.value == pytest.approx(0.875)


def test_missing_tensorboard_warns_once_and_keeps_json_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    monkeypatch.setattr(logger_mod, "_warned_no_tensorboard", False)
    with caplog.at_level(logging.WARNING, logger="pipetrain"):
        for sub in ("a", "b"):
            with MetricsLogger(tmp_path / sub) as mlog:
                assert not mlog.tensorboard
                mlog.log_eval(_eval(1, 0.5))
    warnings = [r for r in caplog.records if "TensorBoard event files not written" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert len(read_metrics(tmp_path / "a")) == len(read_metrics(tmp_path / "b")) == 1
    assert not list((tmp_path / "a").glob("events.out.tfevents.*"))


def test_write_run_files(tmp_path: Path) -> None:
    config = {"model": "mlp", "lr": 0.1, "path": tmp_path}  # a Path is not JSON: written as str
    plan = {"stages": [{"nodes": ["fc1"], "replicas": 2}, {"nodes": ["fc2"], "replicas": 1}]}
    paths = write_run_files(tmp_path / "logs", config, plan, "worker 0: 0F0 0B0\nworker 1: 1F0 1B0")
    assert [p.name for p in paths] == ["config.json", "plan.json", "schedule.txt"]
    assert json.loads(paths[0].read_text()) == {"model": "mlp", "lr": 0.1, "path": str(tmp_path)}
    assert json.loads(paths[1].read_text()) == plan
    assert paths[2].read_text() == "worker 0: 0F0 0B0\nworker 1: 1F0 1B0\n"


def test_a_log_dir_that_is_a_file_is_a_user_error(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(RuntimeConfigError, match=r"--log-dir .*file is a file; pass a directory"):
        MetricsLogger(f)
    with pytest.raises(RuntimeConfigError, match="is a file"):
        write_run_files(f, {}, {}, "")


def test_write_run_files_without_a_plan(tmp_path: Path) -> None:
    paths = write_run_files(tmp_path, {"workers": 1}, None, "one process")
    assert [p.name for p in paths] == ["config.json", "schedule.txt"]
    assert not (tmp_path / "plan.json").exists()
