"""benchmarks/architectures.py: every architecture it lists is one this transformers has, and
its small config builds (the sweep itself is a benchmark: minutes, not a test)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import architectures  # noqa: E402


def test_every_architecture_is_a_model_type_and_class_transformers_has() -> None:
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the list is of transformers 5's architectures")
    for model_type, cls in architectures.ARCHITECTURES.items():
        assert isinstance(getattr(transformers, cls), type), cls
        transformers.AutoConfig.for_model(model_type)  # raises for a model type it does not know
    assert set(architectures.EXTRA) <= set(architectures.ARCHITECTURES)


def test_an_unknown_model_type_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        architectures.main(["--only", "mixtral,no_such_model"])
    assert "unknown model type 'no_such_model'" in capsys.readouterr().err
