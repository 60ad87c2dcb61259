"""Non-finite values (runtime/guards/numerics.py): a NaN/Inf loss, activation, gradient or weight
stops the run with the minibatch, stage and where it appeared (the node: tests/runtime/test_numerics.py),
and the last good checkpoint is kept and named."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from restart_cases import cfg, wait_no_children

from pipetrain.checkpoint import latest_checkpoint, read_manifest
from pipetrain.job import OptimizerConfig
from pipetrain.run import train
from pipetrain.runtime import WorkerFailure
from pipetrain.runtime.guards.numerics import NonFiniteError, NumericsGuard, first_nonfinite


def _fake(last: bool, losses: dict[int, torch.Tensor]) -> tuple[Any, Any, Any]:
    data = SimpleNamespace(step_offset=10, step_of=lambda u: 10 + u // 2)
    executor = SimpleNamespace(data=data, losses=losses)
    st = SimpleNamespace(stage=SimpleNamespace(is_last=last), index=1 if last else 0)
    return executor, st, SimpleNamespace(mb=1)


def test_first_nonfinite_names_the_tensor() -> None:
    assert first_nonfinite({"a": torch.ones(2), "b": None}) is None
    name, value = first_nonfinite({"a": torch.ones(2), "net.3.weight": torch.tensor([1.0, float("inf")])})  # type: ignore[misc]
    assert name == "net.3.weight" and value == float("inf")


def test_nonfinite_loss_names_minibatch_stage_and_unit(tmp_path: Path) -> None:
    guard = NumericsGuard(rank=3, checkpoint_dir=str(tmp_path))
    executor, st, a = _fake(True, {0: torch.tensor(1.0), 3: torch.tensor(float("nan"))})
    with pytest.raises(NonFiniteError, match=r"non-finite loss at minibatch 11 on stage 1 \(rank 3\): the loss of unit "
                                             r"3 is nan; the step was not applied and .* holds no complete checkpoint"):
        guard.check_step(executor, st, a, {"w": torch.ones(2)})


def test_nonfinite_gradient_names_the_parameter() -> None:
    guard = NumericsGuard(rank=0)
    executor, st, a = _fake(False, {})
    guard.check_step(executor, st, a, {"net.0.weight": torch.ones(2)})  # finite: nothing
    with pytest.raises(NonFiniteError, match=r"non-finite gradient at minibatch 11 on stage 0 \(rank 0\): parameter "
                                             r"'net.2.bias' \(node 'net.2'\) has gradient value nan") as e:
        guard.check_step(executor, st, a, {"net.0.weight": torch.ones(2), "net.2.bias": torch.tensor([float("nan")])})
    assert e.value.step == 11 and e.value.stage == 0 and e.value.where.startswith("parameter 'net.2.bias'")


@pytest.mark.timeout(300)
def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    huge = OptimizerConfig("sgd", lr=1e6)  # diverges to inf/nan within a few steps
    with pytest.raises(WorkerFailure, match=r"NonFiniteError: non-finite (loss|gradient|output|weight) at "
                                            r"minibatch \d+ on stage \d \(rank \d\): .*the last good checkpoint is "
                                            r".*step_\d+") as e:
        train(cfg("flush", 2, "1-1", steps=12, optimizer=huge, checkpoint_dir=str(ck), checkpoint_every=1))
    assert wait_no_children() == []
    step = int(str(e.value).split("at minibatch ")[1].split()[0])
    last = latest_checkpoint(ck)
    assert last is not None and read_manifest(last).step == step  # the checkpoint right before the bad minibatch
    assert str(last) in str(e.value)


def test_the_step_check_reads_the_mean_gradient_unless_every_unit_passed() -> None:
    """check_step skips its weight-sized read only when each unit of the group passed the
    per-unit check (and the stage is neither replicated nor tied): a unit that ran without
    that check (zero-bubble's W pass) leaves the count short, and the mean gradient is read."""
    guard = NumericsGuard(rank=0)
    executor, st, a = _fake(False, {})
    executor.tied = None
    st.acc_count, st.replicas = 2, 1
    nan = {"net.2.bias": torch.tensor([float("nan")])}
    guard._passed[0] = 2
    guard.check_step(executor, st, a, nan)  # both units passed: not read again
    guard._passed[0] = 1
    with pytest.raises(NonFiniteError, match=r"parameter 'net.2.bias'"):
        guard.check_step(executor, st, a, nan)
    guard._passed[0], st.replicas = 2, 2
    with pytest.raises(NonFiniteError, match=r"parameter 'net.2.bias'"):
        guard.check_step(executor, st, a, nan)
