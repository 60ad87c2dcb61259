"""benchmarks/predict_time.py predicts a measured configuration as the automatic choice would
(a rehearsal of the run's plan and schedule, simulated on a loopback calibration), and falls
back to the profile alone, saying so, when the rehearsal cannot run."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

pytestmark = pytest.mark.timeout(240)


def test_a_configuration_is_predicted_from_its_rehearsal_and_from_the_profile_when_that_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from bench_models import build_bench_model
    from predict_time import TimePredictor

    from pipetrain.plan.cuts import split_by_config

    torch.set_num_threads(1)
    predictor = TimePredictor(build_bench_model("mlp"), repeats=1)
    plan = split_by_config(predictor.captured, [1, 1], "mlp", predictor.bm.batch_size)
    chosen = {"plan": plan.to_dict(), "schedule": "flush", "microbatches": 2}
    got = predictor.predict(chosen, steps=4)
    assert got is not None and got["source"].startswith("rehearsal")
    assert got["time_per_minibatch_s"] > 0 and len(got["stage_unit_seconds"]) == 2

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no rehearsal here")

    monkeypatch.setattr(TimePredictor, "_rehearsed", broken)
    fallback = predictor.predict(chosen, steps=4)
    assert fallback is not None and "the rehearsal failed: RuntimeError: no rehearsal here" in fallback["source"]
    assert fallback["time_per_minibatch_s"] > 0


def test_a_prediction_is_paired_with_its_own_rounds_run() -> None:
    from predict_time import paired_error

    # the machine ran 30% slower in the second round, and the prediction made beside it too
    assert paired_error([0.100, 0.130], [0.110, 0.143]) == pytest.approx(1 - 1 / 1.1)
    # medians taken apart would compare a fast round's prediction with a slow round's run
    assert paired_error([0.100, 0.100, 0.150], [0.100, 0.150, 0.150]) == pytest.approx(0.0)
    assert paired_error([None, 0.120], [0.100, None]) is None
    assert paired_error([0.120, None, 0.090], [0.100, 0.100, 0.100]) == pytest.approx(0.05)


def test_every_pipetrain_run_gets_its_prediction_right_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    import run
    from timing import Measurement

    calls: list[tuple[str, dict[str, Any], int]] = []

    class Predictions:
        def predict(self, model: str, chosen: dict[str, Any], steps: int) -> dict[str, Any]:
            calls.append((model, chosen, steps))
            if chosen.get("schedule") == "gpipe":
                raise RuntimeError("cannot rehearse")
            return {"time_per_minibatch_s": 0.05, "source": "rehearsal"}

    facts = run.ModelFacts("mlp", {}, {}, {"batch_size": 64})
    args = argparse.Namespace(steps_for={"mlp": 10})
    flush = run.Config("pipetrain_flush_m4", "pipetrain", 2, "flush", 4, "1-1")
    gpipe = run.Config("pipetrain_gpipe_m4", "pipetrain", 2, "gpipe", 4, "1-1")
    auto = run.Config("pipetrain_auto", "pipetrain", 2, run.AUTO, 0)
    ran = {"samples_per_second_steady": 64 / 0.055}
    monkeypatch.setattr(run, "log", lambda msg: None)
    line = run.predict_round("mlp", flush, Measurement(1000.0, "ok", "", [], {**ran, "chosen": {"schedule": "flush"}}),
                             facts, Predictions(), args)  # type: ignore[arg-type]
    assert "predicted 50.0 ms, measured 55.0" in line and calls == [("mlp", {"schedule": "flush"}, 10)]
    run.predict_round("mlp", flush, Measurement(None, "failed", "boom"), facts, Predictions(), args)  # type: ignore[arg-type]
    run.predict_round("mlp", gpipe, Measurement(1000.0, "ok", "", [], {**ran, "chosen": {"schedule": "gpipe"}}),
                      facts, Predictions(), args)  # type: ignore[arg-type]
    run.predict_round("mlp", auto, Measurement(1000.0, "ok", "", [], {**ran, "chosen": {"schedule": "pipedream"},
                                                                       "predicted_time_per_minibatch_s": 0.06}),
                      facts, Predictions(), args)  # type: ignore[arg-type]
    assert len(calls) == 2  # auto's own launcher predicted it; a failed run has nothing to predict
    flushes = facts.time_predicted["pipetrain_flush_m4"]
    assert [p and p["time_per_minibatch_s"] for p in flushes] == [0.05, None]  # one entry per run, in order
    assert facts.time_predicted["pipetrain_gpipe_m4"] == [None]
    assert facts.time_predicted["pipetrain_auto"] == [{"time_per_minibatch_s": 0.06,
                                                       "source": "pipetrain train --json"}]
