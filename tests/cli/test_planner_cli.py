"""`pipetrain plan`: JSON keys, human table, output file, errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.plan.types import Plan

#: The published PipeDream profiles, carried by the tests (MIT; see data/profiles/NOTICE).
PROFILES = Path(__file__).resolve().parents[1] / "data" / "profiles"


def test_json_keys(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", str(PROFILES / "vgg16.txt"), "--workers", "16", "--bandwidth", "10Gbit",
               "--cost-model", "pipedream", "--json", "--compare"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("stages", "config", "predicted_time", "data_parallel_time", "speedup_over_data_parallel",
                "solve_seconds", "baselines"):
        assert key in d, key
    assert d["config"] == "15-1"
    assert all(set(s) >= {"nodes", "replicas"} for s in d["stages"])
    assert d["stages"][0]["nodes"][0] == "node1" and d["stages"][0]["replicas"] == 15
    assert set(d["baselines"]) == {"data_parallel", "uniform", "parameters", "time"}
    assert d["speedup_over_data_parallel"] == pytest.approx(d["data_parallel_time"] / d["predicted_time"])


def test_table_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    rc = main(["plan", str(PROFILES / "resnet50.txt"), "--workers", "4,4", "--bandwidth", "300e9,1.25e9",
               "--compare", "--output", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for word in ("config:", "predicted time per minibatch", "samples/s", "speedup", "solved in", "data_parallel"):
        assert word in text
    saved = Plan.load(out)
    assert saved.num_workers <= 16 and saved.topology is not None and len(saved.topology.levels) == 2


def test_no_output_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "m.txt"
    prof.write_text("node1 -- Input -- forward_compute_time=0, backward_compute_time=0, activation_size=64, "
                    "parameter_size=0\n"
                    "node2 -- Linear -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=64, "
                    "parameter_size=1024\n"
                    "node3 -- Linear -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=64, "
                    "parameter_size=1024\n"
                    "\tnode1 -- node2\n\tnode2 -- node3\n")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(prof), "--workers", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert sorted(n for s in d["stages"] for n in s["nodes"]) == ["node1", "node2", "node3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.txt"]


@pytest.mark.parametrize("argv,match", [
    (["--workers", "4,4"], "give --bandwidth"),
    (["--workers", "0"], "positive integer"),
    (["--workers", "2", "--bandwidth", "-5"], "positive"),
    (["--workers", "2", "--stages", "9"], "more stages than layers"),
])
def test_errors_exit_2(tmp_path: Path, argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "m.txt"
    prof.write_text("node1 -- Input -- forward_compute_time=0, backward_compute_time=0, activation_size=64, "
                    "parameter_size=0\n"
                    "node2 -- Linear -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=64, "
                    "parameter_size=1024\n"
                    "\tnode1 -- node2\n")
    assert main(["plan", str(prof)] + argv) == 2
    assert match in capsys.readouterr().err


def test_missing_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "/nonexistent/p.json"]) == 2
    assert "does not exist" in capsys.readouterr().err
