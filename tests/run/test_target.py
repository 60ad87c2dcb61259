"""A target without a length: the run trains until it, at most ``--max-epochs``; compare
evaluates 10 times an epoch, so epochs and seconds to the target are fractional.

The resolution tests start no process: the length (:func:`resolve_length`) and the segments of
the documented ``compare --model mlp --data digits --workers 2 --schedules dp,pipedream,flush
--target-accuracy 0.9`` (50 epochs of 22 steps, an evaluation every 2 steps: 550 segments
sharing one schedule). The real runs: the documented command with one schedule (it reaches the
target at a fraction of an epoch; the three rows take three times as long, too long for the
suite), one process on ``digits`` with a target it cannot reach in ``--max-epochs 1`` (the
one-line notice), and ``train`` without a length (it stops at the first epoch that meets the
target).
"""
from __future__ import annotations

import io
import json
import pickle
import re
from contextlib import redirect_stdout
from typing import Any

import pytest

from pipetrain.cli import main
from pipetrain.errors import RuntimeConfigError
from pipetrain.job import TrainConfig
from pipetrain.job.config import DEFAULT_MAX_EPOCHS, DEFAULT_STEPS
from pipetrain.job.result import RunResult
from pipetrain.metrics import EvalResult, format_table
from pipetrain.run import resolve_run
from pipetrain.run.compare import EVALS_PER_EPOCH, CompareEntry, compare, entry_config
from pipetrain.run.resolve import resolve_data, resolve_length

pytestmark = pytest.mark.timeout(240)

DIGITS_TRAIN = 1437       # samples in digits' train split
MLP_BATCH = 64            # the mlp's default batch size
SPE = DIGITS_TRAIN // MLP_BATCH   # 22 steps an epoch


def _documented(schedule: str, **kw: Any) -> TrainConfig:
    """The configuration compare trains for ``schedule`` in the documented command."""
    base = TrainConfig.of(model="mlp", data="digits", workers=2, target_accuracy=0.9, quiet=True, **kw)
    return entry_config(base, CompareEntry(schedule, schedule))


# --------------------------------------------------------------------------- the length


@pytest.mark.parametrize("kw, steps, max_epochs", [
    (dict(target_accuracy=0.9), DEFAULT_MAX_EPOCHS * SPE, DEFAULT_MAX_EPOCHS),   # until the target
    (dict(target_loss=0.2, max_epochs=3), 3 * SPE, 3),
    (dict(target_accuracy=0.9, epochs=2), 2 * SPE, None),                     # a fixed length wins
    (dict(target_accuracy=0.9, steps=7), 7, None),
    (dict(steps=7, epochs=2), 2 * SPE, None),                                  # the library's both: epochs
    (dict(), DEFAULT_STEPS, None),                                             # no target: the default
])
def test_the_length_of_a_run(kw: dict[str, Any], steps: int, max_epochs: int | None) -> None:
    cfg = resolve_length(TrainConfig.of(model="mlp", **kw), SPE)
    assert (cfg.training.steps, cfg.training.max_epochs) == (steps, max_epochs)


def test_synthetic_data_keeps_the_default_steps() -> None:
    cfg, source = resolve_data(TrainConfig.of(model="mlp"))
    assert source is None and cfg.training.steps == DEFAULT_STEPS and cfg.training.max_epochs is None


@pytest.mark.parametrize("kw, message", [
    (dict(data="digits", max_epochs=2, steps=5),
     "--max-epochs 2 bounds a run that trains until its target, but --steps 5 fixes the length; drop --max-epochs "
     "or --steps"),
    (dict(data="digits", max_epochs=2, epochs=3, target_accuracy=0.9),
     "--max-epochs 2 bounds a run that trains until its target, but --epochs 3 fixes the length; drop --max-epochs "
     "or --epochs"),
    (dict(data="digits", max_epochs=2),
     "--max-epochs 2 bounds a run that trains until --target-accuracy or --target-loss, and none is given; pass a "
     "target, or --epochs 2 for a fixed length"),
    (dict(max_epochs=2),
     "--max-epochs needs real data with an eval split, but the run trains on synthetic batches; pass --data digits "
     "(or fashion-mnist, shakespeare, text:PATH, package.module:function)"),
    (dict(evals_per_epoch=4),
     "--evals-per-epoch needs real data with an eval split, but the run trains on synthetic batches; pass --data "
     "digits (or fashion-mnist, shakespeare, text:PATH, package.module:function)"),
])
def test_max_epochs_refused_where_it_bounds_nothing(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(RuntimeConfigError) as e:
        resolve_data(TrainConfig.of(model="mlp", **kw))
    assert str(e.value) == message


def test_eval_every_and_evals_per_epoch_are_one_choice() -> None:
    with pytest.raises(RuntimeConfigError) as e:
        TrainConfig.of(eval_every=4, evals_per_epoch=10)
    assert str(e.value) == "--eval-every 4 and --evals-per-epoch 10 both set how often to evaluate; pass one of them"


# --------------------------------------------------------------------------- the resolved run


@pytest.mark.parametrize("schedule", ["dp", "pipedream", "flush"])
def test_the_documented_compare_resolves_until_the_target(schedule: str) -> None:
    cfg = _documented(schedule)
    assert cfg.evaluation.evals_per_epoch == EVALS_PER_EPOCH and cfg.training.steps is None
    run = resolve_run(cfg)
    assert run.config.training.steps == DEFAULT_MAX_EPOCHS * SPE and run.config.training.max_epochs == 50
    assert run.data is not None and run.data.steps_per_epoch == SPE
    every = round(SPE / EVALS_PER_EPOCH)                            # 2 steps: 11 evaluations an epoch
    if schedule == "pipedream":
        # asynchronous: evaluated inside the segment without a drain; cut once an epoch, where a
        # reached target can stop the run
        inner = [tuple(range(e * SPE + every, (e + 1) * SPE, every)) for e in range(50)]
        assert [(s.kind, s.steps, s.evaluate, s.evals) for s in run.segments] == \
            [("timed", SPE, True, steps) for steps in inner]
    else:
        assert [(s.kind, s.steps, s.evaluate) for s in run.segments] == [("timed", every, True)] * (50 * SPE // every)
    # one schedule object for the segments of one length: the resolved run stays small
    assert len({id(s.schedule) for s in run.segments}) == 1
    assert len(pickle.dumps(run)) < 64 * 1024


def test_steps_until_the_target_round_to_the_schedule_period() -> None:
    # pipedream steps a stage with 2 replicas once per 2 minibatches: 29 steps an epoch -> 28, no refusal
    cfg = TrainConfig.of(model="mlp", data="digits", workers=3, schedule="pipedream", config="2-1", batch_size=48,
                         target_accuracy=0.9, max_epochs=1, quiet=True)
    run = resolve_run(cfg)
    assert run.data is not None and run.data.steps_per_epoch == 29
    assert run.config.training.steps == 28 and [(s.steps, s.evaluate) for s in run.segments] == [(28, True)]


@pytest.mark.parametrize("batch, config, workers, spe, every", [
    (128, "1-1", 2, 11, 1), (64, "1-1", 2, 22, 2), (48, "1-1", 2, 29, 3), (32, "1-1", 2, 44, 4),
    (48, "2-1", 3, 29, 2),     # round(2.9) = 3 steps, down to the schedule's period of 2
])
def test_ten_evaluations_an_epoch_on_steps_the_schedule_can_stop_at(batch: int, config: str, workers: int, spe: int,
                                                                    every: int) -> None:
    cfg = TrainConfig.of(model="mlp", data="digits", workers=workers, schedule="pipedream", config=config,
                         batch_size=batch, epochs=1, evals_per_epoch=10, quiet=True)
    run = resolve_run(cfg)
    assert run.data is not None and run.data.steps_per_epoch == spe
    ends = [sum(s.steps for s in run.segments[:i + 1]) for i in range(len(run.segments))]
    evaluated = sorted({*ends, *(t for s in run.segments for t in s.evals)})  # asynchronous: inside, no drain
    steps = run.config.training.steps
    assert evaluated == sorted({*range(every, steps, every), steps}) and all(s.evaluate for s in run.segments)


def test_compare_evaluates_ten_times_an_epoch_unless_told() -> None:
    assert _documented("flush").evaluation.evals_per_epoch == EVALS_PER_EPOCH
    told = _documented("flush", eval_every=11).evaluation
    assert (told.eval_every, told.evals_per_epoch) == (11, None)
    assert _documented("flush", evals_per_epoch=3).evaluation.evals_per_epoch == 3
    synthetic = entry_config(TrainConfig.of(model="mlp", workers=2), CompareEntry("flush", "flush"))
    assert synthetic.evaluation.evals_per_epoch is None


# --------------------------------------------------------------------------- rows and notices


def _history(accs: list[float], every: int = 2) -> list[dict[str, Any]]:
    return [EvalResult(step=every * k, epoch=every * k / SPE, samples=every * k * MLP_BATCH, loss=1.0 - a,
                       accuracy=a, perplexity=None, wall_time=0.5 * k).to_dict() for k, a in enumerate(accs, 1)]


def _fake(reached_at: dict[str, int | None], max_epochs: int | None) -> Any:
    """A training function: the schedule's history crosses 0.9 at the given evaluation (or never)."""
    def train(cfg: TrainConfig) -> RunResult:
        name = cfg.parallel.schedule
        at = reached_at[name]
        accs = [0.5, 0.8, 0.93] if at is not None else [0.5, 0.6, 0.7, 0.72]
        hist = _history(accs)
        r = RunResult(steps=2 * len(accs), samples_per_second=100.0, final_loss=0.3, losses=[], config="1-1",
                      schedule=name, workers=2, batch_size=MLP_BATCH, microbatches=1, seconds=0.5 * len(accs),
                      warmup_steps=0, warmup_losses=[], start_step=0, plan_source="test", stages=2, device="cpu",
                      peak_rss_mib=[], peak_rss_scope="training", rss_setup_mib=[], rss_end_mib=[],
                      peak_rss_life_mib=[], bytes_sent=[64, 64],
                      run={"config": {"training": {"max_epochs": max_epochs}}})
        r.eval_history, r.reached = hist, at is not None
        r.eval_accuracy, r.eval_loss = accs[-1], 1.0 - accs[-1]
        if at is not None:
            r.time_to_accuracy, r.epochs_to_accuracy, r.steps_to_accuracy = hist[at]["wall_time"], \
                hist[at]["epoch"], hist[at]["step"]
        return r
    return train


def test_rows_report_fractional_epochs_and_the_limit() -> None:
    base = TrainConfig.of(model="mlp", data="digits", workers=2, target_accuracy=0.9)
    out = compare(base, ["dp", "pipedream", "flush"], train=_fake({"dp": 2, "pipedream": None, "flush": None}, 1))
    dp, pd, fl = out.rows
    assert (dp.reached, dp.epochs_to_accuracy, dp.steps_to_accuracy, dp.time_to_accuracy) == (True, 6 / SPE, 6, 1.5)
    assert [r.stopped_by for r in out.rows] == ["target", "max_epochs", "max_epochs"]
    assert [r.evaluations for r in out.rows] == [3, 4, 4] and dp.train_seconds == 1.5
    assert dp.run_seconds is not None and dp.run_seconds >= 0.0 and dp.eval_seconds is None  # not measured
    assert dp.limit_notice(0.9) is None
    assert pd.limit_notice(0.9) == ("pipedream: target accuracy 0.9 not reached in 0.36 epochs, the --max-epochs 1 "
                                    "limit (best 0.72 at epoch 0.36); pass a larger --max-epochs to train longer")
    assert fl.limit_notice(0.9) == pd.limit_notice(0.9).replace("pipedream", "flush")  # type: ignore[union-attr]
    js = out.to_json()
    assert [(r["stopped_by"], r["max_epochs"], r["evaluations"]) for r in js["rows"]] == [
        ("target", 1, 3), ("max_epochs", 1, 4), ("max_epochs", 1, 4)]
    assert js["rows"][0]["epochs_to_accuracy"] == pytest.approx(0.2727, abs=1e-4)
    assert format_table(out.rows).splitlines()[1].split()[:5] == ["dp", "yes", "1.5", "s", "0.27"]
    # a fixed length (steps or epochs): not reaching the target is no limit's doing
    fixed = compare(base, ["flush"], train=_fake({"flush": None}, None)).rows[0]
    assert fixed.stopped_by == "length" and fixed.limit_notice(0.9) is None


def test_eval_seconds_sum_when_every_evaluation_measured_them() -> None:
    hist = [EvalResult.from_dict({**h, "eval_seconds": 0.25}) for h in _history([0.5, 0.95])]
    base = TrainConfig.of(model="mlp", data="digits", workers=2, target_accuracy=0.9)
    row = compare(base, ["flush"], train=_fake({"flush": 1}, 50)).rows[0]
    row.history = hist
    assert row.eval_seconds == 0.5 and row.to_dict()["eval_seconds"] == 0.5
    header = format_table([row]).splitlines()[0]
    assert header.split()[-6:] == ["evals", "eval", "s", "wall", "s", "bytes/sample"]
    row.history = hist[:1] + [EvalResult.from_dict(_history([0.5, 0.95])[1])]   # one unmeasured: no sum
    assert row.eval_seconds is None


# --------------------------------------------------------------------------- real runs


def _compare_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any], str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["compare", *argv, "--json"])
    return code, json.loads(out.getvalue()), capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(480)   # 44 s to 158 s on the 2-core machine, as other suites loaded it
def test_the_documented_command_reaches_the_target_at_a_fraction_of_an_epoch(
        capsys: pytest.CaptureFixture[str]) -> None:
    # the README's command, one schedule (each row of dp,pipedream,flush takes as long again)
    code, js, _ = _compare_json(["--model", "mlp", "--data", "digits", "--workers", "2", "--schedules", "pipedream",
                                 "--target-accuracy", "0.9", "--timeout", "60"], capsys)
    assert code == 0, js["failed"]
    (row,) = js["rows"]
    assert row["reached"] and row["stopped_by"] == "target" and row["max_epochs"] == DEFAULT_MAX_EPOCHS
    every = round(SPE / EVALS_PER_EPOCH)
    steps = row["steps_to_accuracy"]
    assert steps % every == 0 and row["epochs_to_accuracy"] == pytest.approx(steps / SPE)
    assert row["evaluations"] == steps // every == len(row["history"])
    # asynchronous: evaluations do not drain, so the run stops at the epoch's cut after the target
    assert row["steps"] == -(-steps // SPE) * SPE
    assert [h["step"] for h in row["history"]] == list(range(every, steps + 1, every))
    assert row["history"][-1]["accuracy"] >= 0.9 > max(h["accuracy"] for h in row["history"][:-1])
    assert 0.0 < row["time_to_accuracy"] == row["history"][-1]["wall_time"] <= row["train_seconds"]
    assert row["run_seconds"] > row["train_seconds"]


def test_a_target_out_of_reach_ends_at_max_epochs_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    argv = ["compare", "--model", "mlp", "--data", "digits", "--workers", "1", "--schedules", "dp",
            "--target-accuracy", "0.999", "--max-epochs", "1"]
    with redirect_stdout(out):
        code = main(argv)
    lines = out.getvalue().splitlines()
    assert code == 0 and lines[0] == "target accuracy 0.999"
    notices = [line for line in lines if line.startswith("dp: ")]
    assert len(notices) == 1 and re.fullmatch(
        r"dp: target accuracy 0\.999 not reached in 1 epoch, the --max-epochs 1 limit \(best 0\.\d+ at epoch "
        r"[01](\.\d\d)?\); pass a larger --max-epochs to train longer", notices[0]), notices
    header, row = lines[1].split("  "), lines[2].split()
    assert row[:4] == ["dp", "no", "-", "-"]
    assert [h.strip() for h in header if h.strip()][7] == "evals" and row[7] == "11"  # every 2 of 22 steps


def test_train_without_a_length_trains_until_the_target() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["train", "--model", "mlp", "--option", "depth=2", "--option", "width=32", "--data", "digits",
                     "--batch-size", "32", "--lr", "0.1", "--momentum", "0.9", "--workers", "1",
                     "--target-accuracy", "0.9", "--json"])
    res = json.loads(out.getvalue())
    assert code == 0 and res["reached"] and res["run"]["config"]["training"]["max_epochs"] == DEFAULT_MAX_EPOCHS
    # train evaluates once an epoch: it stops at the end of the first epoch that meets the target
    epochs = res["epochs_to_accuracy"]
    assert epochs == int(epochs) and res["steps"] == res["steps_to_accuracy"] == epochs * (DIGITS_TRAIN // 32)
    assert [h["epoch"] for h in res["eval_history"]] == list(range(1, int(epochs) + 1))
    assert res["eval_history"][-1]["accuracy"] >= 0.9 > res["eval_history"][-2]["accuracy"]
