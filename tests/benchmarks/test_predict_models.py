"""benchmarks/predict_models.py's reading of a trace: each stage's compute per unit in the run
(F; B or I + W; STEP), set against the choice's simulated per-stage compute."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import predict_models  # noqa: E402


def _event(stage: int, op: str, dur_ms: float, rank: int = 0) -> dict[str, object]:
    return {"ph": "X", "pid": rank, "tid": 0, "ts": 0.0, "dur": dur_ms * 1e3, "name": op,
            "args": {"stage": stage, "op": op, "unit": 0}}


def test_trace_compute_means_per_unit_over_each_stages_ranks(tmp_path: Path) -> None:
    events = [
        # stage 0 replicated on ranks 0 and 1: 3 units, forwards 10/12/14 ms, backwards 20/22/24
        _event(0, "F", 10, 0), _event(0, "B", 20, 0), _event(0, "F", 12, 1), _event(0, "B", 22, 1),
        _event(0, "F", 14, 0), _event(0, "B", 24, 0), _event(0, "STEP", 3, 0), _event(0, "STEP", 5, 1),
        # stage 1, zero-bubble: I + W are the unit's backward; transfers are not compute
        _event(1, "F", 8, 2), _event(1, "I", 6, 2), _event(1, "W", 7, 2), _event(1, "SEND_B", 50, 2),
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "rank 2"}},
    ]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    got = predict_models.trace_compute(tmp_path)
    assert got[0] == pytest.approx({"forward": 0.012, "backward": 0.022, "step": 0.004})
    assert got[1] == pytest.approx({"forward": 0.008, "backward": 0.013, "step": 0.0})
    predicted = [{"forward": 0.010, "backward": 0.020, "step": 0.004}, {"forward": 0.010, "backward": 0.010, "step": 0}]
    assert predict_models.compute_ratio(predicted, got) == pytest.approx((0.034 + 0.021) / 0.050)
    assert predict_models.compute_ratio(predicted, {0: got[0]}) is None  # a stage the trace lacks: no ratio


def test_every_other_architecture_names_a_config_and_model_class_transformers_has() -> None:
    transformers = pytest.importorskip("transformers")
    for name, (config_cls, model_cls, fields) in predict_models.OTHER_CONFIGS.items():
        config = getattr(transformers, config_cls)(**fields)
        assert config.vocab_size == 256, name
        assert isinstance(getattr(transformers, model_cls), type), name
        assert name in predict_models.DESCRIPTION


def test_the_defaults_group_leaves_every_size_but_depth_width_and_heads_to_the_library() -> None:
    transformers = pytest.importorskip("transformers")
    for name, (config_cls, model_cls, fields) in predict_models.DEFAULT_CONFIGS.items():
        cls = getattr(transformers, config_cls)
        config, default = cls(**fields), cls()
        assert config.vocab_size == default.vocab_size >= 30000, name
        assert not {"vocab_size", "intermediate_size", "d_ff"} & set(fields), name
        assert isinstance(getattr(transformers, model_cls), type), name
        assert name in predict_models.DESCRIPTION and name in predict_models.HF_CONFIGS
