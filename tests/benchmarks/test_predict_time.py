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
