"""The typed configuration: sections, flat keys, the command line derived from the fields,
and the layering rule that the runtime executes a resolved run without planning."""
from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

import pytest

from pipetrain.cli.train_cmd import add_config_arguments, config_from_args
from pipetrain.errors import RuntimeConfigError
from pipetrain.job import (
    DEBUG_FAIL_MODES,
    SECTIONS,
    LRSchedule,
    OptimizerConfig,
    TrainConfig,
    parse_debug_fail,
    settings,
)
from pipetrain.schedule import get_schedule

pytestmark = pytest.mark.timeout(60)
RUNTIME = Path(__file__).resolve().parents[2] / "pipetrain" / "runtime"


def parse(argv: list[str]) -> TrainConfig:
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    return config_from_args(p.parse_args(argv))


def test_every_field_is_documented_and_keys_are_unique() -> None:
    keys: list[str] = []
    for cls in SECTIONS.values():
        for f, fl in settings(cls):
            assert fl.help, f"{cls.__name__}.{f.name} has no documentation"
            keys.append(fl.key)
    assert len(keys) == len(set(keys))
    assert {"model", "model_options", "schedule", "steps", "lr", "optimizer", "save", "trace", "threads",
            "debug_fail", "return_state"} <= set(keys)


def test_command_line_is_derived_from_the_fields() -> None:
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    flags = {s for a in p._actions for s in a.option_strings} - {"-h", "--help"}
    declared = {fl.flag for cls in SECTIONS.values() for _, fl in settings(cls) if fl.flag is not None}
    assert flags == declared
    # the flags of the original hand-written parser are all still there
    assert {"--model", "--option", "--workers", "--plan", "--config", "--cut", "--schedule", "--batch-size",
            "--microbatches", "--steps", "--warmup-steps", "--lr", "--optimizer", "--momentum", "--nesterov",
            "--weight-decay", "--betas", "--eps", "--lr-schedule", "--clip-grad-norm", "--seed", "--vertical-sync",
            "--virtual-stages", "--device", "--save", "--resume", "--trace", "--timeout", "--threads",
            "--log-every", "--json", "--no-malloc-tuning", "--no-fused-grads", "--lookahead",
            "--debug-fail"} <= flags
    help_text = p.format_help()
    assert "--debug-fail" not in help_text and "--lookahead" not in help_text  # hidden test hooks


def test_parsed_arguments_fill_the_sections() -> None:
    cfg = parse(["--model", "gpt", "--option", "depth=3", "--option", "name=x", "--schedule", "FLUSH",
                 "--workers", "2", "--config", "1-1", "--microbatches", "4", "--lr", "0.5", "--betas", "0.8,0.9",
                 "--optimizer", "adam", "--threads", "0", "--no-fused-grads", "--json", "--lr-schedule",
                 "cosine:warmup=2", "--steps", "7"])
    assert cfg.model.name == "gpt" and dict(cfg.model.options) == {"depth": 3, "name": "x"}
    assert (cfg.parallel.schedule, cfg.parallel.workers, cfg.parallel.microbatches) == ("flush", 2, 4)
    assert cfg.optimizer == OptimizerConfig("adam", lr=0.5, betas=(0.8, 0.9))
    assert cfg.performance.threads is None and not cfg.performance.fused_grads and cfg.performance.tune_malloc
    assert cfg.output.json and cfg.output.progress_to_stderr
    assert cfg.training.lr_schedule == LRSchedule("cosine", warmup=2) and cfg.training.steps == 7
    defaults = parse([])
    assert defaults == TrainConfig()  # no flag given: every dataclass default
    assert defaults.parallel.schedule == "pipedream" and defaults.performance.threads == 1


def test_flat_keys_and_replace() -> None:
    cfg = TrainConfig.of(steps=3, lr=0.1, schedule="flush", model_options={"depth": 2}, save="x.pt")
    assert (cfg.training.steps, cfg.optimizer.lr, cfg.checkpoint.save) == (3, 0.1, "x.pt")
    again = cfg.replace(save=None, resume="x.pt", optimizer=OptimizerConfig("adamw", lr=0.2))
    assert again.checkpoint == type(cfg.checkpoint)(save=None, resume="x.pt")
    assert again.optimizer.name == "adamw" and cfg.optimizer.name == "sgd"  # a copy; the original is frozen
    assert again.get("lr") == 0.2
    with pytest.raises(RuntimeConfigError, match="unknown training setting 'stpes'"):
        TrainConfig.of(stpes=3)
    json.dumps(cfg.to_dict())  # JSON-friendly (run.json)


@pytest.mark.parametrize("kw, message", [
    (dict(schedule="flush", vertical_sync=True), r"--vertical-sync applies to the pipedream schedule only"),
    (dict(schedule="gpipe", virtual_stages=3), r"--virtual-stages applies to the interleaved schedule only"),
    (dict(schedule="pipedream", microbatches=2), r"pipedream moves whole minibatches, so --microbatches must be 1"),
    (dict(schedule="dp", cut="a"), r"--cut splits a model into pipeline stages; the dp schedule has one stage"),
    (dict(plan="p.json", config="1-1"), r"give either --plan or --config, not both"),
    (dict(steps=0), r"--steps must be an integer >= 1, got 0"),
    (dict(timeout=0.0), r"timeout must be > 0 seconds"),
    (dict(log_every=-1), r"--log-every must be an integer >= 0"),
    (dict(debug_fail="x"), r"--debug-fail takes RANK:STEP\[:hang\] \(or :raise, :kill, :kill-save\), got 'x'"),
    (dict(debug_fail="1:2:boom"), r"--debug-fail takes RANK:STEP\[:hang\] \(or :raise, :kill, :kill-save\)"),
    (dict(virtual_stages=0, schedule="interleaved"), r"--virtual-stages must be an integer >= 1, got 0"),
])
def test_sections_validate(kw: dict[str, object], message: str) -> None:
    with pytest.raises(RuntimeConfigError, match=message):
        TrainConfig.of(**kw)


def test_debug_fail_modes() -> None:
    assert [parse_debug_fail(f"1:3:{m}") for m in DEBUG_FAIL_MODES] == [(1, 3, m) for m in DEBUG_FAIL_MODES]
    assert parse_debug_fail("0:2") == (0, 2, "raise")
    assert {"kill", "kill-save"} <= set(DEBUG_FAIL_MODES)
    assert TrainConfig.of(debug_fail="1:2:kill-save").debug.debug_fail == "1:2:kill-save"


def test_schedule_options_come_from_the_spec() -> None:
    assert TrainConfig.of(schedule="interleaved").parallel.schedule_options == {"virtual_stages": 2}
    assert TrainConfig.of(schedule="interleaved", virtual_stages=3).parallel.schedule_options == {"virtual_stages": 3}
    # the defaults come from the spec (whatever options it has); the given value overrides its own
    pipedream = get_schedule("pipedream")
    got = TrainConfig.of(schedule="pipedream", vertical_sync=True).parallel.schedule_options
    assert got == {**pipedream.option_defaults, "vertical_sync": True} and set(got) == set(pipedream.options)
    assert TrainConfig.of(schedule="pipedream").parallel.schedule_options["vertical_sync"] is False
    flush = TrainConfig.of(schedule="flush").parallel.schedule_options
    assert flush == dict(get_schedule("flush").option_defaults) == {}
    assert TrainConfig.of(schedule="2bw").synchronous is False and TrainConfig.of(schedule="dp").synchronous


def _imports(path: Path) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mods.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
    return mods


def test_runtime_executes_plans_without_planning() -> None:
    """pipetrain.runtime imports nothing from the profiler and no planner (it may read
    plan types and the fx-node helpers of plan.cuts), and no module of it compares a
    schedule's name to a literal."""
    names = ("pipedream", "2bw", "flush", "gpipe", "dp", "interleaved", "zerobubble")
    for path in sorted(RUNTIME.glob("*.py")):
        for mod in _imports(path):
            assert "profile" not in mod, (path.name, mod)
            assert not mod.endswith(("plan.api", "plan.partition", "plan.quick", "plan.baselines", "..run",
                                     "..run.resolve")), (path.name, mod)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                consts = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]
                assert not consts, f"{path.name}:{node.lineno} compares a schedule name"
