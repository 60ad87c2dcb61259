"""The documentation test's fast mode: PIPETRAIN_DOCS_FAST cuts a run's length and a profile's
repeats, and nothing else."""
from __future__ import annotations

import pytest

from pipetrain.job import TrainConfig
from pipetrain.job import config as job_config
from pipetrain.profile import profiler


def test_both_read_the_same_variable() -> None:
    assert job_config.DOCS_FAST_ENV == profiler.DOCS_FAST_ENV == "PIPETRAIN_DOCS_FAST"


@pytest.mark.parametrize("value", ["", "0"])
def test_off_changes_nothing(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(job_config.DOCS_FAST_ENV, value)
    cfg = TrainConfig.of(steps=100, epochs=7, warmup_steps=3)
    assert (cfg.training.steps, cfg.training.epochs, cfg.training.warmup_steps) == (100, 7, 3)
    assert profiler.fast_counts(2, 5) == (2, 5)


def test_on_caps_steps_and_epochs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(job_config.DOCS_FAST_ENV, "1")
    cfg = TrainConfig.of(steps=100, epochs=7, warmup_steps=3, lr=0.5, batch_size=48)
    assert (cfg.training.steps, cfg.training.epochs) == (job_config.FAST_STEPS, job_config.FAST_EPOCHS) == (12, 1)
    assert (cfg.training.warmup_steps, cfg.optimizer.lr, cfg.training.batch_size) == (3, 0.5, 48)
    assert cfg.replace(steps=40).training.steps == 12  # steps set later (from --epochs) are cut too
    assert TrainConfig.of(steps=6).training.steps == 6  # shorter runs stay as they are
    # 12 is a multiple of every replica count up to 4: pipedream's steps stay valid
    assert all(job_config.FAST_STEPS % r == 0 for r in range(1, 5))
    assert profiler.fast_counts(2, 5) == (1, 1) and profiler.fast_counts(0, 1) == (0, 1)
