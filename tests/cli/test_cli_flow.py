"""The whole command-line flow on one model: profile -> plan -> simulate -> train.

Node names must agree from end to end: the plan names the profile's nodes, the simulator
finds the profile through the plan file, and the runtime cuts the captured graph at the
plan's stages.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipetrain.cli import main

pytestmark = pytest.mark.timeout(180)

TINY = ["--model", "mlp", "--option", "depth=4", "--option", "width=32", "--option", "in_features=16",
        "--option", "num_classes=4"]
CLI = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "pipetrain")


def test_profile_plan_simulate_train(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof, plan = tmp_path / "p.json", tmp_path / "sub" / "plan.json"
    plan.parent.mkdir()
    assert main(["profile", *TINY, "--batch-size", "8", "--repeats", "2", "--warmup", "1", "-o", str(prof)]) == 0
    assert main(["plan", str(prof), "--workers", "2", "--bandwidth", "1Gbit", "--stages", "2", "--straight",
                 "--output", str(plan), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert planned["config"] == "1-1"
    profile_nodes = [n["name"] for n in json.loads(prof.read_text())["nodes"]]
    assert [n for s in planned["stages"] for n in s["nodes"]] == profile_nodes

    # the plan file leads the simulator to its profile (relative to the plan's folder)
    assert main(["simulate", str(plan), "--schedule", "pipedream", "--minibatches", "6", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["peak_in_flight"] == [2, 1] and sim["time_per_minibatch"] > 0

    # the runtime cuts the model where the plan says and trains it on two processes
    out = subprocess.run([CLI, "train", *TINY, "--plan", str(plan), "--schedule", "pipedream", "--batch-size", "8",
                          "--steps", "4", "--json", "--timeout", "60"],
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["config"] == "1-1" and res["workers"] == 2 and res["steps"] == 4
    assert all(isinstance(x, float) for x in res["losses"])
