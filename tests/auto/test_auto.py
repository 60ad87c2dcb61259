"""``--schedule auto`` (pipetrain.auto.choose): the planner chooses schedule, microbatches and stages.

- the choice is the fastest runnable prediction, over every schedule the registry marks
  ``auto``, each candidate using exactly the run's ranks;
- on a very slow link data parallelism (all-reduce of every weight) is not chosen for a
  weight-heavy model, and its prediction is far slower than the chosen pipeline's;
- candidates the run cannot use (the caller's ``accept``) are reported, and no runnable
  candidate is one clear error;
- ``--microbatches`` limits the counts tried; ``--schedule auto`` with fixed stages or a
  schedule option is refused in one line; ``pipetrain train`` leaves the schedule open
  (auto) only when the user names no schedule, stages or schedule option on 2+ workers;
- end to end: a run with ``schedule="auto"`` trains the chosen configuration and reports
  the choice and its predicted time per minibatch.
"""
from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from test_calibrated import MBIT, make_cal

from pipetrain.auto.choose import (
    TIE_TOLERANCE,
    AutoChoice,
    Candidate,
    choose,
    compared,
    microbatch_candidates,
    pick,
)
from pipetrain.errors import PlanError, RuntimeConfigError
from pipetrain.graph import capture
from pipetrain.job import OptimizerConfig, TrainConfig
from pipetrain.models import TINY_OPTIONS, get_model
from pipetrain.run import train
from pipetrain.schedule import SCHEDULES, get_schedule

pytestmark = pytest.mark.timeout(240)

#: an MLP whose weights dominate (wide layers, few samples): all-reducing them is costly
OPTIONS = dict(TINY_OPTIONS["mlp"], depth=4, width=256)


def model_at(samples: int) -> tuple[Any, tuple[Any, ...]]:
    torch.manual_seed(0)
    b = get_model("mlp", batch_size=samples, **OPTIONS)
    return capture(b.model, b.example_inputs), tuple(b.make_batch(samples, torch.Generator().manual_seed(0))[0])


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def test_the_choice_is_the_fastest_runnable_prediction_over_every_auto_schedule() -> None:
    choice = choose(model_at, batch_size=16, workers=2, model_name="mlp", calibration=make_cal(1000 * MBIT),
                    repeats=1)
    runnable = choice.runnable
    assert runnable and choice.best in runnable
    assert choice.best == pick(runnable)
    fastest = min(c.predicted_time for c in runnable if c.predicted_time is not None)
    assert choice.best.predicted_time is not None
    assert choice.best.predicted_time <= fastest * (1 + TIE_TOLERANCE)
    assert {c.schedule for c in choice.candidates} == {n for n, s in SCHEDULES.items() if s.auto}
    for c in runnable:
        assert c.plan is not None
        assert get_schedule(c.schedule).ranks_needed(c.plan.replicas, {}) == 2
    assert choice.to_json()["predicted_time_per_minibatch"] == choice.best.predicted_time
    assert choice.note().startswith(f"auto: {choice.best.schedule} m={choice.best.microbatches}")


def fake(schedule: str, t: float) -> Candidate:
    return Candidate(schedule, 1 if schedule == "pipedream" else 4, None, t)


def test_predictions_within_the_tolerance_tie_and_go_to_the_simpler_semantics() -> None:
    """Below the simulator's error a faster prediction says nothing: data parallelism, then a
    synchronous pipeline, then an asynchronous one; outside the band the fastest wins."""
    assert TIE_TOLERANCE == 0.05
    assert pick([fake("2bw", 0.700), fake("dp", 0.730), fake("pipedream", 0.705)]).schedule == "dp"
    assert pick([fake("2bw", 0.700), fake("dp", 0.740), fake("pipedream", 0.705)]).schedule == "2bw"
    assert pick([fake("2bw", 0.700), fake("flush", 0.720), fake("zerobubble", 0.710)]).schedule == "zerobubble"
    assert pick([fake("pipedream", 0.100), fake("2bw", 0.120), fake("dp", 0.300)]).schedule == "pipedream"
    only = [fake("flush", 0.5)]
    assert pick(only) is only[0]
    choice = AutoChoice(pick([fake("2bw", 0.700), fake("dp", 0.730)]), [fake("2bw", 0.700), fake("dp", 0.730)],
                        "test costs")
    assert "within 5% of the fastest of 2 configurations, 2bw m=4 at 700.00 ms" in choice.note()


def test_the_plan_line_compares_the_choice_with_the_candidates_it_was_picked_from() -> None:
    """A candidate whose rehearsal failed keeps its profile's (low) prediction but is not
    compared; the line says the choice is the fastest of those compared, not 'within 5%' of it."""
    failed = replace(fake("pipedream", 0.043), rehearsal_note="its rehearsal failed: NonFiniteError: ...",
                     rehearsal_failed=True)
    ran = replace(fake("2bw", 0.054), rehearsed=True)
    choice = AutoChoice(pick(compared([failed, ran])), [failed, ran], "test costs")
    assert choice.best is ran
    assert "(fastest of the 1 compared of 2 configurations;" in choice.note()
    assert "within" not in choice.note()


def test_the_choice_times_everything_at_the_workers_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Profiles, stages timed as a whole and optimizer steps run at ``threads`` (the workers'),
    whatever the launcher's own setting; the launcher's is restored after."""
    st = importlib.import_module("pipetrain.auto.stage_timing")  # pipetrain.plan is also a function

    seen: list[int] = []
    real = st.stage_seconds

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(st, "stage_seconds", spy)
    torch.set_num_threads(2)
    try:
        choose(model_at, batch_size=16, workers=2, model_name="mlp", calibration=make_cal(1000 * MBIT), repeats=1,
               threads=1, schedules=["flush"], microbatches=2)
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)


def test_a_slow_link_keeps_data_parallelism_out_for_a_weight_heavy_model() -> None:
    """1024-wide layers on 16 samples: 16 MiB of weights to all-reduce against 64 KiB of
    activations per minibatch; at 100 Mbit/s data parallelism is two orders slower."""
    options = dict(OPTIONS, width=1024)

    def wide_at(samples: int) -> tuple[Any, tuple[Any, ...]]:
        torch.manual_seed(0)
        b = get_model("mlp", batch_size=samples, **options)
        return capture(b.model, b.example_inputs), tuple(b.make_batch(samples, torch.Generator().manual_seed(0))[0])

    choice = choose(wide_at, batch_size=16, workers=2, model_name="mlp", calibration=make_cal(100 * MBIT),
                    repeats=1)
    assert not get_schedule(choice.best.schedule).one_stage
    (dp,) = [c for c in choice.candidates if get_schedule(c.schedule).one_stage]
    assert dp.predicted_time is not None and choice.best.predicted_time is not None
    assert dp.predicted_time > 5 * choice.best.predicted_time


def test_refused_candidates_say_why_and_none_left_is_one_error() -> None:
    with pytest.raises(PlanError, match=r"no configuration could be planned for --schedule auto: .*not this one"):
        choose(model_at, batch_size=16, workers=2, model_name="mlp", calibration=make_cal(1000 * MBIT), repeats=1,
               accept=lambda c, captured: "not this one")
    only_sync = choose(model_at, batch_size=16, workers=2, model_name="mlp", calibration=make_cal(1000 * MBIT),
                       repeats=1, accept=lambda c, g: None if get_schedule(c.schedule).synchronous else "async")
    assert get_schedule(only_sync.best.schedule).synchronous
    assert any(c.why_not == "async" for c in only_sync.candidates)


def test_given_microbatches_are_the_only_count_tried() -> None:
    flush, pipedream, dp = get_schedule("flush"), get_schedule("pipedream"), get_schedule("dp")
    assert microbatch_candidates(flush, 2, 64, None) == [2, 4, 8]
    assert microbatch_candidates(flush, 2, 12, None) == [2, 4]          # 8 does not divide 12
    assert microbatch_candidates(flush, 2, 64, 4) == [4]
    assert microbatch_candidates(pipedream, 2, 64, 4) == []             # whole minibatches only
    assert microbatch_candidates(pipedream, 2, 64, None) == [1]
    assert microbatch_candidates(dp, 2, 64, None) == [2]


def test_auto_with_fixed_stages_or_a_schedule_option_is_refused() -> None:
    with pytest.raises(RuntimeConfigError, match=r"--schedule auto chooses the stages itself, but --config fixes "
                                                 r"them; drop --config"):
        TrainConfig.of(schedule="auto", workers=2, config="1-1")
    with pytest.raises(RuntimeConfigError, match=r"--schedule auto tries each schedule with its default options, "
                                                 r"but --vertical-sync was given"):
        TrainConfig.of(schedule="auto", workers=2, vertical_sync=True)
    cfg = TrainConfig.of(schedule="AUTO", workers=2)
    assert cfg.parallel.auto


def test_the_train_command_leaves_the_schedule_open_only_when_nothing_fixes_it() -> None:
    from pipetrain.cli.train_cmd import add_config_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_config_arguments(p)

    def auto(*argv: str) -> bool:
        return config_from_args(p.parse_args(list(argv)), open_schedule=True).parallel.auto

    assert auto("--workers", "2")
    assert auto("--workers", "2", "--microbatches", "4")
    assert not auto("--workers", "2", "--schedule", "flush")
    assert not auto("--workers", "2", "--config", "1-1")
    assert not auto("--workers", "2", "--vertical-sync")
    assert not auto()                                   # one worker: nothing to choose
    assert auto("--schedule", "auto", "--workers", "2")
    # other commands sharing the parser (compare sets each row's schedule) keep the default
    assert not config_from_args(p.parse_args(["--workers", "2"])).parallel.auto


def test_a_short_run_that_names_nothing_trains_a_straight_pipeline_without_measuring(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import pipetrain.auto.choose as choose_module
    import pipetrain.auto.quick as quick_module
    from pipetrain.cli.train_cmd import CHOSEN_FROM_STEPS, add_config_arguments, config_from_args
    from pipetrain.job.config import DEFAULT_SCHEDULE
    from pipetrain.run.resolve import resolve_run

    p = argparse.ArgumentParser()
    add_config_arguments(p)

    def cfg(*argv: str) -> TrainConfig:
        return config_from_args(p.parse_args(["--model", "mlp", "--batch-size", "16", *argv]), open_schedule=True)

    def measured(*a: Any, **k: Any) -> Any:
        raise AssertionError("a run this short measured before it trained")

    monkeypatch.setattr(choose_module, "choose", measured)
    monkeypatch.setattr(quick_module, "quick_plan", measured)
    short = str(CHOSEN_FROM_STEPS - 1)
    smoke = cfg("--workers", "4", "--steps", short)
    assert smoke.parallel.auto and smoke.parallel.auto_from_steps == CHOSEN_FROM_STEPS
    with caplog.at_level("INFO", logger="pipetrain"):
        run = resolve_run(smoke)
    assert run.plan is not None and run.plan.replicas == [1, 1, 1, 1]
    assert run.config.parallel.schedule == DEFAULT_SCHEDULE and not run.config.parallel.auto
    assert "split by estimated compute" in run.plan_note
    assert f"{DEFAULT_SCHEDULE} on 4 stages split by estimated compute, nothing measured" in caplog.text
    # long enough to choose, or asked for: the choice measures (the stand-in above says so)
    for argv in (("--steps", str(CHOSEN_FROM_STEPS)), ("--steps", short, "--schedule", "auto"), ()):
        with pytest.raises(AssertionError, match="measured before it trained"):
            resolve_run(cfg("--workers", "4", *argv))
    assert TrainConfig.of(schedule="auto", workers=4).parallel.auto_from_steps == 0  # the API always chooses


def test_a_run_with_schedule_auto_trains_the_choice_and_reports_it(tmp_path: Path) -> None:
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(make_cal(1000 * MBIT).to_dict()))
    cfg = TrainConfig.of(model="mlp", model_options=OPTIONS, workers=2, schedule="auto", batch_size=16, steps=4,
                         calibration=str(cal), timeout=60, quiet=True, optimizer=OptimizerConfig("sgd", lr=0.05))
    result = train(cfg)
    assert result is not None and result.auto is not None
    assert result.schedule == result.auto["schedule"] and result.microbatches == result.auto["microbatches"]
    assert result.config == result.auto["config"]
    assert result.predicted_time_per_minibatch == result.auto["predicted_time_per_minibatch"] > 0
    assert result.plan_source.startswith(f"auto: {result.schedule} m={result.microbatches}")
    assert len(result.auto["candidates"]) >= 5 and result.final_loss is not None
