"""benchmarks/time_to_accuracy.py's table, plot and rendering on made-up compare rows (no
cluster, no process is launched; speed is never asserted)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import time_to_accuracy as tta  # noqa: E402


def _history(accs: list[float], dt: float) -> list[dict[str, Any]]:
    return [{"step": 2 * i, "epoch": 0.1 * i, "wall_time": dt * (i + 1), "accuracy": a, "loss": 1.0 - a,
             "perplexity": None} for i, a in enumerate(accs)]


def _rows() -> list[dict[str, Any]]:
    return [
        {"schedule": "dp", "reached": True, "time_to_accuracy": 9.0, "epochs_to_accuracy": 2.5,
         "bytes_per_sample": 2_000_000.0, "history": _history([0.5, 0.8, 0.91], 3.0)},
        {"schedule": "pipedream", "reached": True, "time_to_accuracy": 3.0, "epochs_to_accuracy": 2.75,
         "bytes_per_sample": 8_000.0, "history": _history([0.5, 0.8, 0.9], 1.0)},
        {"schedule": "flush", "reached": False, "time_to_accuracy": None, "epochs_to_accuracy": None,
         "bytes_per_sample": 8_000.0, "history": _history([0.5, 0.8, 0.91], 3.0)},
    ]


def test_table_rows_speedup_and_bytes_fraction_are_relative_to_dp() -> None:
    t = {r["schedule"]: r for r in tta.table_rows(_rows())}
    assert t["dp"]["speedup_over_dp"] == 1.0 and t["dp"]["bytes_vs_dp"] == 1.0
    assert t["pipedream"]["speedup_over_dp"] == 3.0
    assert t["pipedream"]["bytes_vs_dp"] == 8_000.0 / 2_000_000.0
    assert t["flush"]["speedup_over_dp"] is None and t["flush"]["reached"] is False


def test_markdown_table_has_one_line_per_row_and_the_figures() -> None:
    md = tta.markdown_table(tta.table_rows(_rows()), "0.9").splitlines()
    assert md[0].startswith("| schedule | reached | time to 0.9 | epochs to 0.9 | bytes/sample")
    assert len(md) == 2 + 3
    assert md[3] == "| pipedream | yes | 3.0 s | 2.75 | 7.8 KB | 3.00x | 0.40% |"
    assert md[4] == "| flush | no | - | - | 7.8 KB | - | 0.40% |"


def test_write_plot_writes_a_png_and_render_uses_saved_json(tmp_path: Path) -> None:
    png = tta.write_plot(_rows(), "accuracy", 0.9, tmp_path / "img" / "a.png", "title")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = {"hosts": 2, "bandwidth": "1Gbit", "cases": {"image": {
        "title": "MLP", "metric": "accuracy", "target": 0.9, "command": "pipetrain cluster run -- compare",
        "rows": _rows()}}}
    src = tmp_path / "saved.json"
    src.write_text(json.dumps(saved))
    md_path = tmp_path / "out.md"
    assert tta.main(["--from-json", str(src), "--plot-dir", str(tmp_path / "plots"), "--markdown", str(md_path)]) == 0
    md = md_path.read_text()
    assert "pipetrain cluster run -- compare" in md and "| dp | yes | 9.0 s | 2.50 | 1.9 MB | 1.00x | 100.00% |" in md
    assert (tmp_path / "plots" / "image_2hosts_vs_time.png").exists()


def test_command_runs_compare_on_the_cluster_with_the_target_and_no_stashing_row() -> None:
    argv = tta.compare_command(tta.CASES["image"], 2, "1Gbit", "dp,pipedream", 20, 600.0)
    line = tta.display_command(argv)
    assert line.startswith("pipetrain cluster run --hosts 2 --bandwidth 1Gbit --timeout 600 -- compare ")
    assert "--target-accuracy 0.9" in line and "--no-stashing" in line and "--workers 2" in line
    text = tta.compare_command(tta.CASES["text"], 2, "1Gbit", "dp", 20, 600.0)
    assert "--target-loss" in text
