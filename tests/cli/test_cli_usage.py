"""Subcommand parsers: an unknown flag prints that subcommand's usage and one error line, and
``pipetrain plan -o`` saves the plan as ``--output`` does (as ``profile -o`` saves a profile)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.plan.types import Plan

VGG16 = Path(__file__).resolve().parents[1] / "data" / "profiles" / "vgg16.txt"


def _exit_code(argv: list[str]) -> int:
    """``main``'s exit status, whether it returns it or argparse raises SystemExit."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


@pytest.mark.parametrize("argv, command", [
    (["plan", str(VGG16), "--workers", "16", "--bogus", "1"], "plan"),
    (["profile", "--model", "mlp", "--bogus"], "profile"),
    (["train", "--model", "mlp", "--bogus"], "train"),
    (["simulate", "--stages", "2", "--bogus"], "simulate"),
    (["cluster", "run", "--bogus"], "cluster run"),
])
def test_unknown_flag_prints_the_subcommands_usage_and_one_error_line(
        argv: list[str], command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(argv) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert captured.out == ""
    assert err.startswith(f"usage: pipetrain {command} [-h]")
    errors = [line for line in err.splitlines() if "error:" in line]
    bad = argv[argv.index("--bogus"):]
    assert errors == [f"pipetrain {command}: error: unrecognized arguments: {' '.join(bad)}"]
    assert "usage: pipetrain [-h] COMMAND" not in err


def test_top_level_unknown_flag_keeps_the_top_level_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pipetrain [-h] COMMAND")
    assert err.splitlines()[-1] == "pipetrain: error: unrecognized arguments: --bogus"


def test_plan_dash_o_saves_what_output_saves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", str(VGG16), "--workers", "16", "--bandwidth", "10Gbit", "--cost-model", "pipedream"]
    assert main([*args, "-o", str(tmp_path / "short.json")]) == 0
    short_out = capsys.readouterr().out
    assert main([*args, "--output", str(tmp_path / "long.json")]) == 0
    long_out = capsys.readouterr().out
    assert f"plan written to {tmp_path / 'short.json'}" in short_out
    assert f"plan written to {tmp_path / 'long.json'}" in long_out
    short, long = (json.loads((tmp_path / n).read_text()) for n in ("short.json", "long.json"))
    short.pop("solve_seconds"), long.pop("solve_seconds")
    assert short == long
    assert Plan.load(tmp_path / "short.json").config == "15-1"
