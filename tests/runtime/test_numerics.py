"""Non-finite values found where they first appear (runtime/guards/numerics.py): the step, stage,
rank and graph node; ``--skip-nonfinite`` drops the step on every stage instead.

The model divides an activation by the input's first feature (``Div``, node ``div``); the
data makes that feature 0 at minibatch :data:`BAD` only, so the forward of that minibatch is
the first to produce an Inf, in the ``div`` node. A second model takes ``sqrt`` of a value
that is 0 at minibatch :data:`BAD` (finite forward, infinite gradient: node ``sqrt``).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from restart_cases import wait_no_children
from torch import Tensor, nn

from pipetrain.job import OptimizerConfig, TrainConfig
from pipetrain.models import ModelBundle
from pipetrain.models.bundle import example_inputs, mse_loss
from pipetrain.run import train
from pipetrain.runtime import WorkerFailure
from pipetrain.runtime.guards.numerics import locate_backward, locate_forward

pytestmark = pytest.mark.timeout(120)

BAD = 2          # the minibatch whose data makes the model's output non-finite
SEED = 0
WIDTH = 8


class Div(nn.Module):
    def forward(self, h: Tensor, g: Tensor) -> Tensor:
        return h / g


class DivNet(nn.Module):
    """``l3(div(l2(tanh(l1(x))), x[:, :1])))``: infinite where the first feature is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 4)
        self.div = Div()

    def forward(self, x: Tensor) -> Tensor:
        return self.l3(self.div(self.l2(torch.tanh(self.l1(x))), x[:, :1]))


class SqrtNet(nn.Module):
    """``l2(sqrt(relu(l1(x)) * x[:, :1]))``: a finite forward whose gradient is infinite
    where the first feature is 0 (d sqrt(u)/du at u = 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.l3(torch.tanh(self.l2(torch.sqrt(torch.sigmoid(self.l1(x)) * x[:, :1]))))


def batches(batch_size: int, generator: torch.Generator) -> tuple[tuple[Tensor, ...], Tensor]:
    """Minibatch ``t`` (seed ``SEED + t``): random inputs with first feature 1, or 0 at ``BAD``."""
    x = torch.randn(batch_size, WIDTH, generator=generator)
    x[:, 0] = 0.0 if generator.initial_seed() == SEED + BAD else 1.0
    return (x,), torch.randn(batch_size, 4, generator=generator)


def div_net(batch_size: int = 8) -> ModelBundle:
    """``--model test_numerics:div_net``."""
    return ModelBundle(model=DivNet(), example_inputs=example_inputs(batches, batch_size), loss_fn=mse_loss,
                       make_batch=batches, name="test_numerics:div_net")


def sqrt_net(batch_size: int = 8) -> ModelBundle:
    """``--model test_numerics:sqrt_net``."""
    return ModelBundle(model=SqrtNet(), example_inputs=example_inputs(batches, batch_size), loss_fn=mse_loss,
                       make_batch=batches, name="test_numerics:sqrt_net")


def cfg(model: str, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(model=f"test_numerics:{model}", workers=2, config="1-1", schedule="flush",
                                batch_size=8, microbatches=2, steps=5, optimizer=OptimizerConfig("sgd", lr=0.05),
                                return_state=True, timeout=30, quiet=True, seed=SEED)
    base.update(kw)
    return TrainConfig.of(**base)


# --------------------------------------------------------------------------- one process


def _gm_params(net: nn.Module) -> tuple[torch.fx.GraphModule, dict[str, Tensor]]:
    gm = torch.fx.symbolic_trace(net)
    return gm, {n: p.detach() for n, p in gm.named_parameters()}


def test_locate_forward_names_the_first_nonfinite_node() -> None:
    torch.manual_seed(0)
    gm, params = _gm_params(DivNet())
    (x,), _ = batches(4, torch.Generator().manual_seed(SEED + BAD))
    where = locate_forward(gm, params, (x,))
    assert where is not None and where.startswith("node 'truediv' (call_function truediv"), where
    assert "is the first node whose output is non-finite (value" in where
    (ok,), _ = batches(4, torch.Generator().manual_seed(SEED))
    assert locate_forward(gm, params, (ok,)) is None


def test_locate_backward_names_the_node_whose_backward_turns_it_nonfinite() -> None:
    torch.manual_seed(0)
    gm, params = _gm_params(SqrtNet())
    (x,), y = batches(4, torch.Generator().manual_seed(SEED + BAD))
    assert locate_forward(gm, params, (x,)) is None  # the forward is finite

    def head(out: Tensor) -> list[Tensor]:
        return [mse_loss(out, y)]

    where = locate_backward(gm, params, (x,), head, None)
    assert where is not None and where.startswith("node 'sqrt' (call_function sqrt)"), where
    (ok,), y0 = batches(4, torch.Generator().manual_seed(SEED))
    assert locate_backward(gm, params, (ok,), lambda out: [mse_loss(out, y0)], None) is None


# --------------------------------------------------------------------------- a pipeline run


def test_an_inf_stops_the_run_naming_step_stage_and_node() -> None:
    with pytest.raises(WorkerFailure, match=rf"NonFiniteError: non-finite output at minibatch {BAD} on stage \d "
                                            rf"\(rank \d\): unit \d+: node 'truediv' \(call_function truediv in module "
                                            rf"div\) is the first node whose output is non-finite "
                                            rf".*the step was not applied"):
        train(cfg("div_net"))
    assert wait_no_children() == []


def test_an_infinite_gradient_stops_the_run_naming_the_node() -> None:
    with pytest.raises(WorkerFailure, match=rf"NonFiniteError: non-finite gradient at minibatch {BAD} on stage \d "
                                            rf"\(rank \d\): unit \d+: node 'sqrt' \(call_function sqrt\) is the "
                                            rf"first node whose backward produces a non-finite gradient"):
        train(cfg("sqrt_net"))
    assert wait_no_children() == []


def test_skip_nonfinite_drops_the_step_on_every_stage() -> None:
    """Skipping minibatch BAD equals a run whose minibatch BAD has lr 0: compared with a run
    that stops right before it and one that continues after it... checked directly: the
    weights after the run are finite, one step is counted, and the weights after step BAD
    equal those after step BAD - 1 (a run of BAD + 1 steps equals a run of BAD steps)."""
    done = train(cfg("div_net", steps=BAD + 1, skip_nonfinite=True))
    before = train(cfg("div_net", steps=BAD))
    assert done is not None and before is not None and done.state is not None and before.state is not None
    assert getattr(done, "skipped_steps", None) == 1
    for n, t in before.state.items():
        assert torch.isfinite(done.state[n]).all(), n
        assert torch.equal(done.state[n], t), n
    longer = train(cfg("div_net", steps=BAD + 3, skip_nonfinite=True))
    assert longer is not None and longer.state is not None and getattr(longer, "skipped_steps", None) == 1
    assert all(bool(torch.isfinite(t).all()) for t in longer.state.values())
    assert not all(torch.equal(longer.state[n], t) for n, t in before.state.items())  # later steps were applied
    assert longer.losses and all(torch.isfinite(torch.tensor(v)) for i, v in enumerate(longer.losses) if i != BAD)
    assert wait_no_children() == []


def test_skip_nonfinite_is_refused_for_asynchronous_schedules() -> None:
    with pytest.raises(WorkerFailure, match=r"--skip-nonfinite drops a step on every stage at once, which the "
                                            r"asynchronous schedule 'pipedream' cannot"):
        train(cfg("div_net", schedule="pipedream", microbatches=None, skip_nonfinite=True))
    assert wait_no_children() == []


def test_the_fused_check_finds_one_bad_element_among_many_tensors_and_not_an_overflowing_norm() -> None:
    from pipetrain.runtime.guards.numerics import _all_finite, first_nonfinite

    ts = {f"w{i}": torch.randn(64, 32) for i in range(20)}
    ts["b"] = torch.randn(7, dtype=torch.bfloat16)
    assert _all_finite(ts.values()) and first_nonfinite(ts) is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        ts["w13"].view(-1)[100] = bad
        assert not _all_finite(ts.values())
        found = first_nonfinite(ts)
        assert found is not None and found[0] == "w13"
        ts["w13"].view(-1)[100] = 0.0
    big = [torch.full((4,), 3e38), torch.full((4,), -3e38)]  # finite, but their 2-norm overflows
    assert _all_finite(big)
    assert not _all_finite([torch.randn(3), torch.tensor([1j, complex("nan")])])
    assert _all_finite([torch.arange(5), None, 3.0])


def test_a_cut_after_an_attention_mask_sends_its_infinities_on_without_a_finding() -> None:
    """The zoo GPT masks attention with ``masked_fill(mask, -inf)``; cut right after it, the
    first stage's output holds those infinities by design (the next stage's softmax makes them
    finite). The guard does not stop the run, and the run trains as the same run cut elsewhere."""
    base = dict(model="gpt", model_options={"d_model": 32, "layers": 1, "heads": 2, "seq_len": 8, "vocab": 32},
                workers=2, schedule="flush", batch_size=4, microbatches=2, steps=3, timeout=60, quiet=True,
                optimizer=OptimizerConfig("sgd", lr=0.05))
    at_mask = train(TrainConfig.of(**base, cut="softmax"))
    elsewhere = train(TrainConfig.of(**base, cut="matmul_1"))
    assert at_mask.losses == pytest.approx(elsewhere.losses, rel=1e-5)
    assert wait_no_children() == []


def test_an_infinity_that_no_constant_wrote_is_still_found() -> None:
    gm, params = _gm_params(DivNet())
    (x,), _ = batches(4, torch.Generator().manual_seed(SEED + BAD))
    where = locate_forward(gm, params, (x,))
    assert where is not None and "truediv" in where

    class Masked(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return torch.softmax(x.masked_fill(x < 0, float("-inf")), dim=-1) * x.masked_fill(x < 0, float("-inf"))

    gm2 = torch.fx.symbolic_trace(Masked())
    x2 = torch.tensor([[1.0, -1.0, 2.0]])
    assert locate_forward(gm2, {}, (torch.tensor([[1.0, 2.0]]),)) is None
    where = locate_forward(gm2, {}, (x2,))  # -inf * softmax's 0 is NaN: a finding
    assert where is not None and "mul" in where
