"""The all-reduce buckets of a run are decided once, in the launcher (run.resolve.bucket_mb):
overlapping the all-reduce with the backward only where it does not take the backward's
cores (a GPU, or hosts apart); ``--bucket-mb`` given is kept; the resolved run records it."""
from __future__ import annotations

import os

import pytest

from pipetrain.job import TrainConfig
from pipetrain.run import resolve_run
from pipetrain.run.resolve import OVERLAP_BUCKET_MB, bucket_mb


def cfg(**kw: object) -> TrainConfig:
    return TrainConfig.of(model="mlp", workers=2, config="2", schedule="dp", steps=2, **kw)


@pytest.fixture
def cores(monkeypatch: pytest.MonkeyPatch) -> object:
    def set_cores(n: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)
    for k in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    return set_cores


def test_ranks_filling_one_hosts_cores_get_no_buckets_and_spare_cores_get_them(cores: object) -> None:
    cores(2)  # type: ignore[operator]
    assert bucket_mb(cfg(threads=1), 2, None) == 0.0
    assert bucket_mb(cfg(threads=1), 4, None) == 0.0
    cores(8)  # type: ignore[operator]
    assert bucket_mb(cfg(threads=1), 2, None) == OVERLAP_BUCKET_MB
    assert bucket_mb(cfg(threads=4), 2, None) == 0.0  # 2 ranks x 4 threads fill 8 cores


def test_a_gpu_or_hosts_apart_overlap_and_a_given_value_is_kept(cores: object,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cores(2)  # type: ignore[operator]
    assert bucket_mb(cfg(threads=1, bucket_mb=7.0), 2, None) == 7.0
    assert bucket_mb(cfg(threads=1, bucket_mb=0.0), 2, None) == 0.0
    assert bucket_mb(cfg(threads=1, device="cuda"), 2, None) == OVERLAP_BUCKET_MB
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert bucket_mb(cfg(threads=1), 2, 2) == OVERLAP_BUCKET_MB  # torchrun over two hosts


def test_the_resolved_run_carries_the_decision(cores: object) -> None:
    cores(2)  # type: ignore[operator]
    assert resolve_run(cfg(threads=1)).config.performance.bucket_mb == 0.0
    assert resolve_run(cfg(threads=1, bucket_mb=25.0)).config.performance.bucket_mb == 25.0
