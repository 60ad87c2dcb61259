"""``pipetrain compare``: entries, configurations per schedule, rows, failures, the CLI end to end.

The end-to-end test trains a small MLP on ``digits`` for at most one epoch on 2 workers with
two schedules plus the no-stashing row (each stops at its target, evaluated 10 times an
epoch), and checks the JSON keys, one row per configuration and the PNGs of ``--plot``.
"""
from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from pipetrain.cli import main
from pipetrain.errors import RuntimeConfigError, ScheduleError
from pipetrain.job import TrainConfig
from pipetrain.job.result import RunResult
from pipetrain.metrics import ROW_KEYS
from pipetrain.run.compare import CompareEntry, compare, compare_entries, entry_config, row_of

pytestmark = pytest.mark.timeout(240)


# --------------------------------------------------------------------------- entries and configs


def test_entries_in_order_with_the_no_stashing_row() -> None:
    entries = compare_entries(["dp", "pipedream", "flush"], no_stashing=True)
    assert [e.label for e in entries] == ["dp", "pipedream", "pipedream (no stashing)", "flush"]
    assert entries[2] == CompareEntry("pipedream (no stashing)", "pipedream", {"stashing": False})
    # no schedule that stashes among them: the row comes at the end, with pipedream
    assert [e.label for e in compare_entries(["dp", "2bw"], no_stashing=True)] == ["dp", "2bw",
                                                                                    "pipedream (no stashing)"]
    assert [e.label for e in compare_entries(["DP", " gpipe"])] == ["dp", "gpipe"]


@pytest.mark.parametrize("schedules,error,match", [
    (["dp", "pipe"], ScheduleError, r"unknown schedule 'pipe'; valid names: pipedream"),
    ([], RuntimeConfigError, r"--schedules needs at least one schedule"),
    (["dp", "flush", "dp"], RuntimeConfigError, r"--schedules names dp twice"),
])
def test_bad_schedules(schedules: list[str], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        compare_entries(schedules)


def test_each_schedule_gets_a_valid_config_for_n_workers() -> None:
    base = TrainConfig.of(model="mlp", workers=3, batch_size=12)
    dp = entry_config(base, CompareEntry("dp", "dp"), microbatches=3)
    assert dp.parallel.schedule == "dp" and dp.parallel.config is None and dp.parallel.workers == 3
    assert dp.parallel.microbatches == 3
    pd = entry_config(base, CompareEntry("pipedream (no stashing)", "pipedream", {"stashing": False}),
                      microbatches=3)
    assert pd.parallel.config == "1-1-1" and pd.parallel.microbatches is None
    assert pd.parallel.schedule_options == {"vertical_sync": False, "stashing": False}
    fl = entry_config(base, CompareEntry("flush", "flush"), {"vertical_sync": True, "virtual_stages": 3},
                      microbatches=3)
    assert fl.parallel.config == "1-1-1" and fl.parallel.microbatches == 3 and fl.parallel.schedule_options == {}
    il = entry_config(base, CompareEntry("interleaved", "interleaved"), {"virtual_stages": 3})
    assert il.parallel.config is None and il.parallel.schedule_options == {"virtual_stages": 3}
    # a given layout is kept for pipelines, dropped for dp; auto_plan leaves it to the planner
    given = base.replace(config="2-1")
    assert entry_config(given, CompareEntry("2bw", "2bw")).parallel.config == "2-1"
    assert entry_config(given, CompareEntry("dp", "dp")).parallel.config is None
    assert entry_config(base, CompareEntry("gpipe", "gpipe"), auto_plan=True).parallel.config is None
    with pytest.raises(RuntimeConfigError, match=r"compare needs --workers N"):
        entry_config(TrainConfig.of(model="mlp"), CompareEntry("dp", "dp"))


def _result(schedule: str, **kw: Any) -> RunResult:
    base: dict[str, Any] = dict(
        steps=10, samples_per_second=100.0, final_loss=0.5, losses=[], config="1-1", schedule=schedule, workers=2,
        batch_size=8, microbatches=1, seconds=1.0, warmup_steps=0, warmup_losses=[], start_step=0,
        plan_source="test", stages=2, device="cpu", peak_rss_mib=[], peak_rss_scope="training", rss_setup_mib=[],
        rss_end_mib=[], peak_rss_life_mib=[], bytes_sent=[400, 400])
    base.update(kw)
    r = RunResult(**base)
    for k, v in dict(eval_accuracy=0.9, eval_loss=0.3, reached=True, time_to_accuracy=0.8, epochs_to_accuracy=2.0,
                     steps_to_accuracy=8, eval_history=[
                         {"step": 4, "epoch": 1.0, "samples": 32, "loss": 0.6, "accuracy": 0.7, "perplexity": None,
                          "wall_time": 0.4},
                         {"step": 8, "epoch": 2.0, "samples": 64, "loss": 0.3, "accuracy": 0.9, "perplexity": None,
                          "wall_time": 0.8}]).items():
        if hasattr(r, k):
            setattr(r, k, v)
    return r


def test_row_of_a_result_counts_bytes_over_all_ranks() -> None:
    row = row_of("pipedream", _result("pipedream"))
    assert row.bytes_per_sample == pytest.approx(800 / 80)  # (400 + 400) bytes / (10 steps * 8 samples)
    assert row.samples_per_second == 100.0


def test_a_failing_entry_is_one_line_and_keeps_the_other_rows() -> None:
    calls: list[str] = []

    def fake_train(cfg: TrainConfig) -> RunResult:
        calls.append(cfg.parallel.schedule)
        if cfg.parallel.schedule == "2bw":
            raise ScheduleError("2bw needs microbatches >= 2 (got 1); use 2")
        if cfg.parallel.schedule == "gpipe":
            raise RuntimeError("boom\nsecond line")
        return _result(cfg.parallel.schedule)

    base = TrainConfig.of(model="mlp", workers=2)
    out = compare(base, ["dp", "2bw", "gpipe", "flush"], train=fake_train)
    assert calls == ["dp", "2bw", "gpipe", "flush"]
    assert [r.schedule for r in out.rows] == ["dp", "flush"]
    assert [(f.label, f.message) for f in out.failures] == [
        ("2bw", "2bw needs microbatches >= 2 (got 1); use 2"), ("gpipe", "RuntimeError: boom")]
    js = out.to_json()
    assert [r["schedule"] for r in js["rows"]] == ["dp", "flush"] and js["rows"][0]["config"] == "1-1"
    assert js["failed"] == [{"schedule": "2bw", "error": "2bw needs microbatches >= 2 (got 1); use 2"},
                            {"schedule": "gpipe", "error": "RuntimeError: boom"}]


def test_cli_refuses_a_single_schedule_and_save(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--model", "mlp", "--workers", "2", "--schedule", "flush"]) == 2
    assert "compare runs every schedule of --schedules; drop --schedule flush" in capsys.readouterr().err
    assert main(["compare", "--model", "mlp", "--workers", "2", "--save", "x.pt"]) == 2
    assert "--save names the files of one run" in capsys.readouterr().err


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def digits_json(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("compare")
    out = io.StringIO()
    argv = ["compare", "--model", "mlp", "--option", "depth=2", "--option", "width=32", "--data", "digits",
            "--workers", "2", "--schedules", "dp,pipedream", "--no-stashing", "--epochs", "1", "--batch-size", "32",
            "--lr", "0.1", "--momentum", "0.9", "--target-accuracy", "0.5", "--json", "--plot", str(tmp / "plots"),
            "--timeout", "60"]
    with redirect_stdout(out):
        code = main(argv)
    return {"code": code, "json": json.loads(out.getvalue()), "plots": tmp / "plots"}


def test_compare_json_has_one_row_per_configuration(digits_json: dict[str, Any]) -> None:
    assert digits_json["code"] == 0, digits_json["json"].get("failed")
    rows = digits_json["json"]["rows"]
    assert [r["schedule"] for r in rows] == ["dp", "pipedream", "pipedream (no stashing)"]
    for r in rows:
        assert set(ROW_KEYS) <= set(r)
        assert 0.0 <= r["final_accuracy"] <= 1.0
        assert r["samples_per_second"] > 0 and r["bytes_per_sample"] > 0
        assert r["reached"] == (r["time_to_accuracy"] is not None)
        # evaluated 10 times an epoch (every round(44 / 10) = 4 steps); the last is the target's, or the epoch's end
        assert r["history"] and r["history"][-1]["epoch"] == pytest.approx(r["epochs_to_accuracy"] if r["reached"]
                                                                           else 1.0)
        assert [h["step"] for h in r["history"]] == list(range(4, r["history"][-1]["step"] + 1, 4))
        assert r["evaluations"] == len(r["history"]) and r["stopped_by"] in ("target", "length")
    assert [r["config"] for r in rows] == ["2", "1-1", "1-1"]
    assert digits_json["json"]["failed"] == []


def test_plot_writes_the_pngs(digits_json: dict[str, Any]) -> None:
    plots: Path = digits_json["plots"]
    for name in ("accuracy_vs_time.png", "accuracy_vs_epochs.png"):
        data = (plots / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert sorted(digits_json["json"]["plots"]) == sorted(str(plots / n) for n in
                                                          ("accuracy_vs_time.png", "accuracy_vs_epochs.png"))
