"""User errors: every bad input gets one line that states the rule, the values and the fix.

CLI cases check exit code 2 and a single ``error: ...`` line on stderr (no traceback);
library cases check the :class:`~pipetrain.errors.PipetrainError` subclass and its message.
Everything here is file handling and argument checking: no model is trained.
"""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pipetrain as pt
from pipetrain.cli import main
from pipetrain.errors import (
    ModelError,
    PipetrainError,
    PlanError,
    ProfileError,
    ScheduleError,
)
from pipetrain.plan.types import Level, Plan, Topology
from pipetrain.profile.io import load_profile, save_profile
from pipetrain.profile.pipedream_txt import parse_pipedream_txt


def _profile_dict(n: int = 4) -> dict[str, Any]:
    """A chain ``x -> l0 -> ... -> l{n-1}`` as profile JSON (version 1)."""
    nodes: list[dict[str, Any]] = [{"name": "x", "op": "Input", "kind": "input", "forward_time": 0.0,
                                    "backward_time": 0.0, "activation_bytes": 64, "parameter_bytes": 0,
                                    "inputs": []}]
    for i in range(n):
        nodes.append({"name": f"l{i}", "op": "Linear", "kind": "module", "forward_time": 1e-3,
                      "backward_time": 2e-3, "activation_bytes": 64, "parameter_bytes": 1024,
                      "inputs": [nodes[-1]["name"]]})
    return {"version": 1, "model": "chain", "batch_size": 4, "device": "cpu", "optimizer": "sgd",
            "optimizer_state_bytes_per_parameter_byte": 1.0, "nodes": nodes}


@pytest.fixture
def files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Path]:
    """A good profile and plan, plus a directory, an empty file, malformed JSON and a JSON list."""
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps(_profile_dict()))
    plan = tmp_path / "plan.json"
    assert main(["plan", str(prof), "--workers", "2", "--straight", "--output", str(plan)]) == 0
    capsys.readouterr()
    (tmp_path / "adir").mkdir()
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.json").write_text("{bad")
    (tmp_path / "list.json").write_text("[1, 2]")
    return {"prof": prof, "plan": plan, "dir": tmp_path / "adir", "empty": tmp_path / "empty.json",
            "empty_txt": tmp_path / "empty.txt", "bad": tmp_path / "bad.json", "list": tmp_path / "list.json",
            "tmp": tmp_path}


def cli_error(argv: list[str], capsys: pytest.CaptureFixture[str], match: str) -> str:
    """Run the CLI, expect exit code 2 and exactly one ``error:`` line matching ``match``."""
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert re.search(match, lines[0]), lines[0]
    return lines[0]


# -- files of the wrong kind ---------------------------------------------------------------------
@pytest.mark.parametrize("cmd", ["profile", "plan"])
@pytest.mark.parametrize("key,match", [
    ("dir", "is a directory"),
    ("empty", "is not JSON"),
    ("bad", "is not JSON"),
    ("list", "must be a JSON object, got list"),
    ("plan", "is a plan, not a profile"),
    ("empty_txt", "no node lines found"),
])
def test_bad_profile_files(cmd: str, key: str, match: str, files: dict[str, Path],
                           capsys: pytest.CaptureFixture[str]) -> None:
    cli_error([cmd, files[key]], capsys, match)


@pytest.mark.parametrize("key,match", [
    ("dir", "is a directory"),
    ("empty", "is not JSON"),
    ("bad", "is not JSON"),
    ("list", "a plan must be a JSON object, got list"),
    ("prof", "is a profile, not a plan.*pipetrain plan"),
])
def test_bad_plan_files(key: str, match: str, files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    cli_error(["simulate", files[key], "--minibatches", "2"], capsys, match)


def test_profile_given_as_plan_profile(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    cli_error(["simulate", files["plan"], "--minibatches", "2", "--profile", files["plan"]], capsys,
              "is a plan, not a profile")


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(stages=[]), "non-empty list of stages"),
    (lambda d: d.update(stages="abc"), "non-empty list of stages"),
    (lambda d: d["stages"][0].update(replicas=0), r"replicas=0.*integer >= 1"),
    (lambda d: d["stages"][0].update(replicas=1.5), r"replicas=1.5"),
    (lambda d: d["stages"][0].update(nodes="x"), "non-empty list of node names"),
    (lambda d: d["stages"][0].update(colour="red"), "unknown field 'colour'"),
    (lambda d: d.update(version=7), "plan version 7 is not supported"),
    (lambda d: d.update(topology={"levels": [{"workers": 2}]}), "'topology' is malformed"),
])
def test_malformed_plan(mutate: Any, match: str, files: dict[str, Path]) -> None:
    d = json.loads(files["plan"].read_text())
    mutate(d)
    bad = files["tmp"] / "mutated.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=match):
        Plan.load(bad)


def test_plan_round_trip_still_loads(files: dict[str, Path]) -> None:
    p = Plan.load(files["plan"])
    assert Plan.from_dict(p.to_dict()).to_dict() == p.to_dict()


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d["nodes"][2].update(name=5), r"node 2 has name=5; node names must be non-empty strings"),
    (lambda d: d["nodes"][2].update(kind="weird"), r"kind='weird'; kind must be one of input, module, function"),
    (lambda d: d.update(optimizer_state_bytes_per_parameter_byte=math.nan), "finite number >= 0"),
    (lambda d: d.update(nodes=[]), "the profile has no nodes"),
    (lambda d: d["nodes"][1]["inputs"].append("l2"), "cycle through node"),
])
def test_malformed_profile(mutate: Any, match: str, tmp_path: Path) -> None:
    d = _profile_dict()
    mutate(d)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError, match=match):
        load_profile(path)


def test_load_profile_rejects_non_path() -> None:
    with pytest.raises(ProfileError, match="must be a non-empty str or Path, got None"):
        load_profile(None)  # type: ignore[arg-type]


def test_pipedream_txt_garbage_line_names_line() -> None:
    text = ("node1 -- Input -- forward_compute_time=0, backward_compute_time=0, activation_size=64, parameter_size=0\n"
            "this is not a profile line\n")
    with pytest.raises(ProfileError, match=r"g\.txt:2: cannot parse line 'this is not a profile line'"):
        parse_pipedream_txt(text, source="g.txt")


# -- output paths -------------------------------------------------------------------------------
@pytest.mark.parametrize("where,match", [("dir", "Is a directory"), ("missing", "No such file or directory")])
def test_plan_output_unwritable(where: str, match: str, files: dict[str, Path],
                                capsys: pytest.CaptureFixture[str]) -> None:
    out = files["dir"] if where == "dir" else files["tmp"] / "no" / "such" / "plan.json"
    cli_error(["plan", files["prof"], "--workers", "2", "--output", out], capsys, f"cannot write plan .*{match}")


@pytest.mark.parametrize("where,match", [("dir", "is a directory"), ("missing", "does not exist")])
def test_profile_output_checked_before_profiling(where: str, match: str, files: dict[str, Path],
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import pipetrain.models

    def no_build(*a: Any, **k: Any) -> None:
        raise AssertionError("the model was built before the output path was checked")

    monkeypatch.setattr(pipetrain.models, "load_model", no_build)
    out = files["dir"] if where == "dir" else files["tmp"] / "no" / "p.json"
    cli_error(["profile", "--model", "mlp", "-o", out], capsys, f"--output .*{match}")


def test_save_profile_unwritable(files: dict[str, Path]) -> None:
    with pytest.raises(ProfileError, match="cannot write profile .*choose a writable file path"):
        save_profile(load_profile(files["prof"]), files["dir"])


# -- numbers on the command line -----------------------------------------------------------------
@pytest.mark.parametrize("argv,match", [
    (["--repeats", "0"], r"--repeats must be an integer >= 1, got 0"),
    (["--warmup", "-1"], r"--warmup must be an integer >= 0, got -1"),
    (["--batch-size", "0"], r"--batch-size must be an integer >= 1, got 0"),
    (["--threads", "0"], r"--threads must be an integer >= 1, got 0"),
    (["--momentum", "-1"], r"momentum must be a finite number >= 0, got -1.0"),
    (["--check-memory", "0"], r"--check-memory must be > 0 GiB, got 0; pass e.g. --check-memory 1"),
    (["--check-seconds", "-1"], r"--check-seconds must be >= 0, got -1; pass e.g. --check-seconds 4"),
])
def test_profile_numbers(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    cli_error(["profile", "--model", "mlp", *argv], capsys, match)


@pytest.mark.parametrize("argv,match", [
    (["--stages", "0"], r"--stages\) must be an integer >= 1 or None, got 0"),
    (["--microbatches", "0"], r"--microbatches\) must be an integer >= 1, got 0"),
    (["--max-states", "1"], r"--max-states\) must be an integer >= 3, got 1"),
    (["--memory", "inf"], "cannot read memory 'inf'"),
])
def test_plan_numbers(argv: list[str], match: str, files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    cli_error(["plan", files["prof"], "--workers", "2", *argv], capsys, match)


@pytest.mark.parametrize("argv,match", [
    (["--step-time", "-1"], r"--step-time must be a finite number of seconds >= 0, got -1.0"),
    (["--latency", "nan"], r"--latency must be a finite number of seconds >= 0, got nan"),
    (["--minibatches", "100000000"], r"100,000,000 units .* at most 500,000 .* lower --minibatches"),
])
def test_simulate_plan_numbers(argv: list[str], match: str, files: dict[str, Path],
                               capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--minibatches", "4", *argv] if "--minibatches" not in argv else argv
    cli_error(["simulate", files["plan"], *argv], capsys, match)


@pytest.mark.parametrize("argv,match", [
    (["--forward-time", "inf"], r"--forward-time must be a finite number"),
    (["--microbatches", "8", "--minibatches", "100000", "--schedule", "flush"],
     r"3,200,000 stage-units.*lower --microbatches or --minibatches"),
])
def test_simulate_synthetic_numbers(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = {"--stages": "4", "--microbatches": "4", "--forward-time": "1", "--backward-time": "2"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    cli_error(["simulate", *[x for kv in base.items() for x in kv]], capsys, match)


# -- the Python API -----------------------------------------------------------------------------
def test_plan_api_argument_types(files: dict[str, Path]) -> None:
    prof = load_profile(files["prof"])
    topo = pt.parse_topology("2")
    with pytest.raises(PlanError, match="needs a Profile as its first argument, got dict"):
        pt.plan({"nodes": []}, topo)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="topology must be a Topology, got str"):
        pt.plan(prof, "4")  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="options must be a PlanOptions, got dict"):
        pt.plan(prof, topo, {"straight": True})  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="level 0 has 0 workers"):
        pt.plan(prof, Topology((Level(0, 1e9),)))


@pytest.mark.parametrize("kwargs,match", [
    ({"workers": None}, "workers must be a number, a string like '4,4'"),
    ({"workers": True}, "workers must be a number"),
    ({"workers": "2", "memory": math.inf}, "memory per worker inf must be positive finite bytes"),
    ({"workers": "2", "bandwidth": object()}, "bandwidth must be a number, a string like"),
    ({"workers": "2", "bandwidth": [object()]}, "bandwidth must be a number or a string such as .10Gbit."),
])
def test_parse_topology_rejects(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        pt.parse_topology(**kwargs)


@pytest.mark.parametrize("replicas,match", [
    ([], "replicas is empty"),
    ([0], r"at least one replica; got replicas=\[0\]"),
    ([-1, 1], "at least one replica"),
    ("21", "list of integer replica counts"),
    ([2.5], "list of integer replica counts"),
    ([True], "list of integer replica counts"),
    (None, "list of integer replica counts"),
])
def test_build_schedule_replicas(replicas: Any, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        pt.build_schedule("flush", replicas, microbatches=2)


def test_build_schedule_accepts_integral_counts() -> None:
    import numpy as np

    a = pt.build_schedule("flush", [np.int64(2), 1.0], microbatches=2)
    assert a.grid() == pt.build_schedule("flush", [2, 1], microbatches=2).grid()
    with pytest.raises(ScheduleError, match="steps must be an integer >= 1"):
        pt.build_schedule("flush", [1, 1], 2, True)


def test_simulate_api_misuse() -> None:
    s = pt.build_schedule("flush", [1, 1], 2)
    with pytest.raises(ScheduleError, match="needs StageCosts, got NoneType"):
        pt.simulate(s, None)  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="needs a Schedule, got dict"):
        pt.simulate({}, pt.StageCosts.synthetic(2, 1.0, 2.0))  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="costs cover 3 stages but schedule 'flush' has 2"):
        pt.simulate(s, pt.StageCosts.synthetic(3, 1.0, 2.0))
    with pytest.raises(ScheduleError, match="num_stages must be an integer >= 1, got 0"):
        pt.StageCosts.synthetic(0, 1.0, 2.0)
    with pytest.raises(ScheduleError, match="forward_time must be finite"):
        pt.StageCosts.synthetic(2, math.nan, 2.0)
    with pytest.raises(ScheduleError, match="step_time must be a finite number of seconds >= 0, got -1"):
        pt.StageCosts.synthetic(2, 1.0, 2.0, step_time=-1)


def test_costs_from_plan_misuse(files: dict[str, Path]) -> None:
    plan, prof = Plan.load(files["plan"]), load_profile(files["prof"])
    with pytest.raises(PlanError, match="units must be an integer >= 1"):
        pt.StageCosts.from_plan(plan, prof, units=0)
    with pytest.raises(ScheduleError, match="latency must be a finite number"):
        pt.StageCosts.from_plan(plan, prof, latency=-1.0)
    with pytest.raises(ProfileError, match="needs a Profile, got Plan"):
        pt.StageCosts.from_plan(plan, plan)  # type: ignore[arg-type]


def test_capture_and_profile_misuse() -> None:
    with pytest.raises(pt.errors.CaptureError, match="capture needs an nn.Module, got str"):
        pt.capture("hello", (torch.randn(2),))  # type: ignore[arg-type]
    with pytest.raises(pt.errors.CaptureError, match=r"raised on the example batch \(inputs: \[2, 5\]"):
        pt.capture(nn.Linear(4, 2), (torch.randn(2, 5),))
    with pytest.raises(ProfileError, match="momentum must be a finite number >= 0, got -1"):
        pt.profile_model(nn.Linear(4, 2), torch.randn(2, 4), repeats=1, momentum=-1)


def test_first_backward_not_charged_with_startup_costs() -> None:
    """With warmup=0 the first layer's backward once absorbed ~0.3 s of BLAS/autograd start-up."""
    prof = pt.profile_model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), torch.randn(4, 4),
                            warmup=0, repeats=1)
    assert prof["_0"].backward_time < 0.05, prof["_0"].backward_time


def test_model_too_big_is_a_model_error() -> None:
    with pytest.raises(ModelError, match="does not fit in memory .*choose smaller options"):
        pt.get_model("mlp", depth=2, width=10**7, in_features=10**7)


def test_factory_module_in_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`pipetrain profile --model mymodel:make` finds mymodel.py in the current directory."""
    (tmp_path / "qa_cwd_model.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def make():\n    return nn.Sequential(nn.Linear(4, 3)), torch.randn(2, 4)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "qa_cwd_model", raising=False)
    assert main(["profile", "--model", "qa_cwd_model:make", "--repeats", "1", "--warmup", "0"]) == 0
    assert "total: 2 nodes" in capsys.readouterr().out
    cli_error(["profile", "--model", "qa_no_such_module:make"], capsys, "cannot import module 'qa_no_such_module'")


def test_errors_are_value_errors() -> None:
    assert issubclass(PipetrainError, ValueError)


def test_simulate_virtual_stages_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    cli_error(["simulate", "--stages", "2", "--microbatches", "4", "--forward-time", "1", "--backward-time", "2",
               "--schedule", "interleaved", "--virtual-stages", "0"],
              capsys, r"--virtual-stages must be >= 1 \(got 0\)")
