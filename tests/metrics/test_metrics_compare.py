"""CompareRow, the comparison table, its JSON and the plots."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from pipetrain.metrics import CompareRow, EvalResult, TargetTracker, format_table, rows_to_json
from pipetrain.metrics.plots import write_plots

REQUIRED = {"schedule", "reached", "time_to_accuracy", "epochs_to_accuracy", "final_accuracy", "samples_per_second",
            "bytes_per_sample"}


def _history(accs: list[float], sec_per_epoch: float) -> list[EvalResult]:
    return [EvalResult(step=e * 50, epoch=float(e), samples=e * 1600, loss=1.0 - a, accuracy=a, perplexity=None,
                       wall_time=e * sec_per_epoch) for e, a in enumerate(accs, start=1)]


def _rows() -> list[CompareRow]:
    rows = []
    for name, accs, spe, sps, bps in [("dp", [0.7, 0.86, 0.93, 0.95], 10.0, 160.0, 10650.0),
                                      ("pipedream", [0.68, 0.85, 0.92, 0.95], 6.0, 266.7, 4096.0),
                                      ("pipedream (no stashing)", [0.5, 0.7, 0.8, 0.84], 6.0, 270.1, 4096.0)]:
        tr = TargetTracker(target_accuracy=0.9)
        for r in _history(accs, spe):
            tr.update(r)
        rows.append(CompareRow.from_tracker(name, tr, sps, bps))
    return rows


def test_rows_from_trackers() -> None:
    dp, pd, nostash = _rows()
    assert (dp.reached, dp.time_to_accuracy, dp.epochs_to_accuracy, dp.steps_to_accuracy) == (True, 30.0, 3.0, 150)
    assert (pd.time_to_accuracy, pd.epochs_to_accuracy) == (18.0, 3.0)
    assert not nostash.reached and nostash.time_to_accuracy is None and nostash.final_accuracy == 0.84
    assert len(dp.history) == 4 and dp.final_loss == dp.history[-1].loss


def test_json_has_the_keys_and_is_strict_json() -> None:
    rows = _rows()
    rows[2].final_loss = math.nan
    out = rows_to_json(rows, target_accuracy=0.9)
    text = json.dumps(out, allow_nan=False)  # raises on NaN/inf
    back = json.loads(text)
    assert back["target_accuracy"] == 0.9 and len(back["rows"]) == 3
    for row in back["rows"]:
        assert set(row) >= REQUIRED
    assert back["rows"][1]["schedule"] == "pipedream" and back["rows"][1]["time_to_accuracy"] == 18.0
    assert back["rows"][2]["reached"] is False and back["rows"][2]["epochs_to_accuracy"] is None
    assert back["rows"][2]["final_loss"] is None
    assert [h["accuracy"] for h in back["rows"][0]["history"]] == [0.7, 0.86, 0.93, 0.95]
    assert "history" not in rows_to_json(rows, history=False)["rows"][0]


def test_table_is_aligned_and_marks_unreached_rows() -> None:
    text = format_table(_rows(), target="target accuracy 0.9")
    lines = text.splitlines()
    assert lines[0] == "target accuracy 0.9"
    header, *body = lines[1:]
    assert header.split("  ")[0] == "schedule"
    assert len({len(line) for line in lines[1:]}) == 1  # figures right-aligned to one width
    assert body[0].startswith("dp ") and "30.0 s" in body[0] and "10.4 KB" in body[0] and "0.9500" in body[0]
    nostash = body[2]
    assert nostash.startswith("pipedream (no stashing)") and " no " in nostash
    # the time and epochs cells of the unreached row are "-", under their headers' right edges
    for col in ("time to target", "epochs to target"):
        end = header.index(col) + len(col)
        assert nostash[end - 1] == "-"
    assert "final ppl" not in header


def test_language_table_shows_perplexity() -> None:
    r = EvalResult(step=10, epoch=1.0, samples=100, loss=1.5, accuracy=0.4, perplexity=math.exp(1.5), wall_time=2.0,
                   task="language")
    tr = TargetTracker(target_loss=1.0)
    tr.update(r)
    text = format_table([CompareRow.from_tracker("flush", tr, 50.0, None)])
    assert "final ppl" in text and "4.482" in text and text.splitlines()[-1].endswith("-")  # bytes not measured


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_plots_are_written(tmp_path: Path) -> None:
    paths = write_plots(_rows(), tmp_path / "plots", target_accuracy=0.9)
    assert [p.name for p in paths] == ["accuracy_vs_time.png", "accuracy_vs_epochs.png"]
    for p in paths:
        assert p.stat().st_size > 10_000
        assert _png_size(p) == (840, 540)


def test_language_plots_use_perplexity_and_the_loss_target(tmp_path: Path) -> None:
    rows = []
    for name, losses in [("flush", [3.0, 2.2, 1.8, 1.6]), ("pipedream", [3.1, 2.3, 1.9, 1.7])]:
        tr = TargetTracker(target_loss=1.75)
        for e, loss in enumerate(losses, start=1):
            tr.update(EvalResult(step=e * 20, epoch=float(e), samples=e * 640, loss=loss, accuracy=0.3,
                                 perplexity=math.exp(loss), wall_time=e * 3.0, task="language"))
        rows.append(CompareRow.from_tracker(name, tr, 200.0, 1024.0))
    paths = write_plots(rows, tmp_path, target_loss=1.75)
    assert [p.name for p in paths] == ["perplexity_vs_time.png", "perplexity_vs_epochs.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
