"""Functional optimizers equal torch.optim; LR schedules; clipping factor; weight versions."""
from __future__ import annotations

import math
import weakref

import pytest
import torch

from pipetrain.errors import RuntimeConfigError
from pipetrain.job.config import LRSchedule, OptimizerConfig
from pipetrain.runtime.engine.optim import FunctionalOptimizer, clip_coefficient, sum_of_squares
from pipetrain.runtime.engine.versions import WeightVersions, version_last_use
from pipetrain.runtime.single import make_torch_optimizer

pytestmark = pytest.mark.timeout(60)

CASES = [
    OptimizerConfig("sgd", lr=0.1),
    OptimizerConfig("sgd", lr=0.1, momentum=0.9),
    OptimizerConfig("sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    OptimizerConfig("sgd", lr=0.05, momentum=0.5, dampening=0.1, weight_decay=0.1),
    OptimizerConfig("adam", lr=0.01),
    OptimizerConfig("adam", lr=0.01, weight_decay=0.1, betas=(0.8, 0.99)),
    OptimizerConfig("adamw", lr=0.01, weight_decay=0.1),
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.name}-m{c.momentum}-wd{c.weight_decay}-n{c.nesterov}")
def test_functional_optimizer_matches_torch_optim(cfg: OptimizerConfig) -> None:
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (3,), (2, 2, 2)]
    ref = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    params = {f"p{i}": t.detach().clone().requires_grad_() for i, t in enumerate(ref)}
    opt = make_torch_optimizer(ref, cfg)
    fopt = FunctionalOptimizer(cfg)
    for step in range(6):
        grads = [torch.randn(s, generator=g) for s in shapes]
        lr = cfg.lr * (0.5 if step >= 3 else 1.0)
        for group in opt.param_groups:
            group["lr"] = lr
        for p, gr in zip(ref, grads):
            p.grad = gr.clone()
        # a parameter without gradient is skipped by both
        if step == 2:
            ref[1].grad = None
        opt.step()
        fg = {f"p{i}": gr.clone() for i, gr in enumerate(grads)}
        if step == 2:
            fg["p1"] = None
        old = dict(params)
        params = fopt.apply(params, fg, lr)
        for i, p in enumerate(ref):
            torch.testing.assert_close(params[f"p{i}"], p.detach(), rtol=1e-6, atol=1e-6)
        # out of place: the previous version is untouched (unless skipped)
        assert params["p0"] is not old["p0"]
        if step == 2:
            assert params["p1"] is old["p1"]
    assert fopt.steps == 6


def test_functional_optimizer_writes_into_recycled_buffers() -> None:
    cfg = OptimizerConfig("adamw", lr=0.01, weight_decay=0.1)
    p = {"w": torch.randn(4, requires_grad=True)}
    out = {"w": torch.empty(4, requires_grad=True)}
    a = FunctionalOptimizer(cfg).apply(p, {"w": torch.ones(4)}, 0.01, out=out)
    b = FunctionalOptimizer(cfg).apply(p, {"w": torch.ones(4)}, 0.01)
    assert a["w"] is out["w"]
    torch.testing.assert_close(a["w"], b["w"])
    assert a["w"].requires_grad


def test_optimizer_state_round_trip() -> None:
    cfg = OptimizerConfig("adam", lr=0.01)
    p = {"w": torch.randn(3)}
    o1 = FunctionalOptimizer(cfg)
    p1 = o1.apply(p, {"w": torch.ones(3)}, 0.01)
    o2 = FunctionalOptimizer(cfg)
    o2.load_state_dict(o1.state_dict())
    torch.testing.assert_close(o1.apply(p1, {"w": torch.ones(3)}, 0.01)["w"],
                               o2.apply(p1, {"w": torch.ones(3)}, 0.01)["w"])
    assert o2.steps == 2


def test_clip_coefficient_matches_torch() -> None:
    g = torch.Generator().manual_seed(1)
    ps = [torch.randn(4, 3, generator=g, requires_grad=True) for _ in range(3)]
    for p in ps:
        p.grad = torch.randn(4, 3, generator=g) * 3
    grads = [p.grad.clone() for p in ps]
    total = torch.nn.utils.clip_grad_norm_(ps, 1.5)
    ours = math.sqrt(sum_of_squares(grads))
    assert ours == pytest.approx(float(total), rel=1e-6)
    coef = clip_coefficient(ours, 1.5)
    for p, gr in zip(ps, grads):
        torch.testing.assert_close(gr * coef, p.grad, rtol=1e-6, atol=1e-7)
    assert clip_coefficient(0.1, 1.5) == 1.0


def test_lr_schedules() -> None:
    assert LRSchedule.parse("constant").lr(0.1, 5, 10) == 0.1
    s = LRSchedule.parse("step:size=2,gamma=0.5")
    assert [s.lr(1.0, k, 10) for k in range(5)] == [1.0, 1.0, 0.5, 0.5, 0.25]
    c = LRSchedule.parse("cosine:warmup=2,total=6,min=0.1")
    lrs = [c.lr(1.0, k, 100) for k in range(8)]
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)
    assert lrs[2] == pytest.approx(1.0) and lrs[6] == pytest.approx(0.1) and lrs[7] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))
    # default horizon: the stage's steps in the run
    assert LRSchedule.parse("cosine").lr(1.0, 10, 10) == pytest.approx(0.0)
    with pytest.raises(RuntimeConfigError, match="unknown learning-rate schedule 'linear'"):
        LRSchedule.parse("linear")
    with pytest.raises(RuntimeConfigError, match="bad learning-rate schedule option"):
        LRSchedule.parse("step:every=3")


def test_optimizer_config_errors() -> None:
    with pytest.raises(RuntimeConfigError, match="unknown optimizer 'rmsprop'"):
        OptimizerConfig("rmsprop")
    with pytest.raises(RuntimeConfigError, match="nesterov momentum needs momentum > 0"):
        OptimizerConfig("sgd", nesterov=True)


# --------------------------------------------------------------------------- versions


def test_versions_follow_liveness_and_free_memory() -> None:
    # Uses from a 1F1B-like list: F(v0)@0 F(v0)@1 B(v0)@2 STEP@3 F(v1)@4 B(v0)@5 STEP@6 B(v1)@7 STEP@8
    last = version_last_use([(0, 0), (1, 0), (2, 0), (4, 1), (5, 0), (7, 1)])
    assert last == {0: 5, 1: 7}
    w0 = {"w": torch.zeros(3, requires_grad=True)}
    vs = WeightVersions(w0, last, recycle=False)
    ref0 = weakref.ref(w0["w"])
    del w0
    vs.push({"w": torch.ones(3, requires_grad=True)})
    vs.release(3)
    assert vs.live == 2  # version 0 still needed by the B at position 5
    vs.get(0)
    vs.release(5)
    assert vs.live == 1 and ref0() is None  # dropped and really freed
    with pytest.raises(RuntimeError, match="weight version 0 is not available"):
        vs.get(0)
    vs.push({"w": torch.full((3,), 2.0, requires_grad=True)})
    vs.release(7)
    assert vs.live == 1 and vs.newest == 2 and vs.peak == 2 and vs.alive() == 1


def test_versions_recycle_dropped_tensors_only_when_unreferenced() -> None:
    vs = WeightVersions({"w": torch.zeros(2, requires_grad=True)}, {0: 0})
    old_id = id(vs.latest["w"])
    vs.push({"w": torch.ones(2, requires_grad=True)})
    vs.release(0)
    spare = vs.spare()
    assert spare is not None and id(spare["w"]) == old_id
    # a dropped version someone still references is not recycled
    vs1 = WeightVersions({"w": torch.zeros(2, requires_grad=True)}, {0: 0})
    kept = vs1.latest["w"]
    vs1.push({"w": torch.ones(2, requires_grad=True)})
    vs1.release(0)
    assert vs1.spare() is None and kept.sum() == 0
    # a dropped version that an autograd graph still holds is not recycled
    vs2 = WeightVersions({"w": torch.zeros(2, requires_grad=True)}, {0: 0})
    x = torch.randn(2, requires_grad=True)
    held = (vs2.latest["w"] * x).sum()  # saves w for x's gradient
    vs2.push({"w": torch.ones(2, requires_grad=True)})
    vs2.release(0)
    assert vs2.spare() is None
    del held
