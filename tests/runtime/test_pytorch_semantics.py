"""Plain PyTorch semantics kept across pipeline stages.

A model trained on two stages under ``flush`` equals the same model trained by one worker
with the same microbatches (``--workers 1 --microbatches m``), which equals a hand-written
``torch.optim`` loop over the same microbatches:

- buffers a forward updates under ``torch.no_grad()`` (a counter, a running mean), in place
  or by assignment, are updated once per unit in unit order and saved with the weights;
- dropout draws from the per-unit stream (docs/runtime.md, "Random operations"), so its
  masks do not depend on the layout, and the recompute of PipeDream without weight stashing
  draws the same masks as the forward (the run equals its replay);
- a stock Hugging Face T5 (``use_cache`` left at its default) is captured without its cache
  and trains on two stages like one worker.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.job import OptimizerConfig, TrainConfig
from pipetrain.models import ModelBundle, output_logits
from pipetrain.run import resolve_run
from pipetrain.runtime import launch_local, replay_config, train_one_process

pytestmark = pytest.mark.timeout(240)

SGD = OptimizerConfig("sgd", lr=0.1, momentum=0.9)
TIMEOUT = 40
BATCH, MICRO, STEPS, SEED = 8, 4, 3, 0


class InPlaceStats(nn.Module):
    """A counter and a running mean of the first layer's activations, updated in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("mean", torch.full((16,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        with torch.no_grad():
            self.count += 1
            self.mean.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return self.c(torch.relu(self.b(h) * (1.0 + self.count / 8) + self.mean))


class AssignedStats(nn.Module):
    """The same statistics, each forward assigning new tensors to the buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("mean", torch.full((16,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        with torch.no_grad():
            self.count = self.count + 1
            self.mean = 0.9 * self.mean + 0.1 * h.mean(0)
        return self.c(torch.relu(self.b(h) * (1.0 + self.count / 8) + self.mean))


def in_place_stats(batch_size: int = BATCH) -> tuple[nn.Module, torch.Tensor]:
    """``--model test_pytorch_semantics:in_place_stats``."""
    return InPlaceStats(), torch.randn(batch_size, 6)


def assigned_stats(batch_size: int = BATCH) -> tuple[nn.Module, torch.Tensor]:
    """``--model test_pytorch_semantics:assigned_stats``."""
    return AssignedStats(), torch.randn(batch_size, 6)


class DropoutMLP(nn.Module):
    """Dropout as a layer and as a function, on either side of any cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.a(x)))
        h = F.dropout(torch.relu(self.b(h)), p=0.2, training=self.training)
        return self.c(h)


class ShapeBranchDropout(DropoutMLP):
    """The same, with a branch on a shape that ``torch.fx`` cannot trace: captured by ``torch.export``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > 4:
            x = x * 0.5
        return super().forward(x)


def dropout_mlp(batch_size: int = BATCH) -> tuple[nn.Module, torch.Tensor]:
    """``--model test_pytorch_semantics:dropout_mlp``."""
    return DropoutMLP(), torch.randn(batch_size, 6)


def dropout_export(batch_size: int = BATCH) -> tuple[nn.Module, torch.Tensor]:
    """``--model test_pytorch_semantics:dropout_export``."""
    return ShapeBranchDropout(), torch.randn(batch_size, 6)


VOCAB, SRC, TGT = 64, 8, 6


def t5_batch(batch_size: int, g: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Source tokens, their attention mask, decoder tokens; the target is the next decoder tokens."""
    src = torch.randint(0, VOCAB, (batch_size, SRC), generator=g)
    tgt = torch.randint(0, VOCAB, (batch_size, TGT + 1), generator=g)
    return (src, torch.ones(batch_size, SRC, dtype=torch.long), tgt[:, :-1].contiguous()), tgt[:, 1:].contiguous()


def t5_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output_logits(output).flatten(0, 1), target.flatten())


def t5(batch_size: int = BATCH) -> ModelBundle:
    """``--model test_pytorch_semantics:t5``: a stock ``T5ForConditionalGeneration`` of a small
    ``T5Config``, ``use_cache`` at its default (True)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(config)
    example, _ = t5_batch(batch_size, torch.Generator().manual_seed(0))
    return ModelBundle(model, example, t5_loss, t5_batch, "t5")


def cfg(model: str, workers: int, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(model=f"test_pytorch_semantics:{model}", workers=workers, schedule="flush",
                                batch_size=BATCH, microbatches=MICRO, steps=STEPS, optimizer=SGD, seed=SEED,
                                return_state=True, timeout=TIMEOUT, quiet=True, warmup_steps=0)
    if workers > 1:
        base["config"] = "1-1"
    base.update(kw)
    return TrainConfig.of(**base)


def assert_state_equal(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float) -> None:
    assert set(ref) <= set(state), sorted(set(ref) - set(state))
    for name, t in ref.items():
        err = float((state[name].float() - t.float()).abs().max() / (t.float().abs().max() + 1e-6))
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"


def plain_loop(factory: Any) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The oracle: the model from the run's seed, ``torch.optim`` over the same microbatches
    (each unit's mean loss / m accumulated), the loss the factory bundle uses (MSE against the
    synthetic target)."""
    from pipetrain.job.model import load_bundle
    from pipetrain.runtime.engine.units import UnitData

    bundle = load_bundle(cfg(factory, 1), BATCH)
    model = bundle.model
    opt = torch.optim.SGD(model.parameters(), lr=SGD.lr, momentum=SGD.momentum)
    data = UnitData(bundle.make_batch, BATCH, MICRO, SEED)
    losses = []
    for t in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for j in range(MICRO):
            inputs, target = data.unit(t * MICRO + j)
            loss = bundle.loss_fn(model(*inputs), target)
            (loss / MICRO).backward()
            total += float(loss.detach()) / MICRO
        opt.step()
        losses.append(total)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


@pytest.fixture(scope="module")
def buffer_runs() -> dict[str, Any]:
    runs = {name: resolve_run(cfg(name, 2)) for name in ("in_place_stats", "assigned_stats")}
    results = launch_local(list(runs.values()), timeout=TIMEOUT)
    return dict(zip(runs, results))


@pytest.mark.parametrize("name", ["in_place_stats", "assigned_stats"])
def test_buffers_updated_in_forward_equal_one_worker(buffer_runs: dict[str, Any], name: str) -> None:
    two = buffer_runs[name]
    one = train_one_process(resolve_run(cfg(name, 1)))
    state, losses = plain_loop(name)
    assert float(state["count"]) == STEPS * MICRO  # once per unit
    assert one.microbatches == MICRO
    assert_state_equal(one.state, state, 1e-6)
    assert one.losses == pytest.approx(losses, rel=1e-6)
    assert_state_equal(two.state, one.state, 1e-6)
    assert two.losses == pytest.approx(one.losses, rel=1e-6)
    assert float(two.state["count"]) == STEPS * MICRO


# --------------------------------------------------------------------------- random operations


@pytest.fixture(scope="module")
def dropout_runs() -> dict[str, Any]:
    cfgs = {
        "flush": cfg("dropout_mlp", 2),
        "flush_m1": cfg("dropout_mlp", 2, microbatches=1),
        "flush_export": cfg("dropout_export", 2),
        "recompute": cfg("dropout_mlp", 2, schedule="pipedream", microbatches=1, stashing=False, steps=4,
                         optimizer=OptimizerConfig("sgd", lr=0.5, momentum=0.9)),
    }
    runs = {name: resolve_run(c) for name, c in cfgs.items()}
    return {"runs": runs, "results": dict(zip(runs, launch_local(list(runs.values()), timeout=TIMEOUT)))}


@pytest.mark.parametrize("name", ["flush", "flush_m1", "flush_export"])
def test_dropout_on_two_stages_equals_one_worker(dropout_runs: dict[str, Any], name: str) -> None:
    run, two = dropout_runs["runs"][name], dropout_runs["results"][name]
    assert run.plan is not None and run.plan.num_stages == 2
    one = train_one_process(resolve_run(cfg(run.config.model.name.split(":")[1], 1,
                                            microbatches=run.microbatches)))
    assert one.microbatches == run.microbatches
    assert_state_equal(two.state, one.state, 1e-6)
    assert two.losses == pytest.approx(one.losses, rel=1e-6)
    # dropout is really on: without it the first step's loss is the model's loss on the minibatch
    assert one.losses[0] != pytest.approx(loss_without_dropout(run.config.model.name.split(":")[1]), rel=1e-3)


def loss_without_dropout(factory: str) -> float:
    """The initial model's loss on the first minibatch, in eval mode (no dropout)."""
    from pipetrain.job.model import load_bundle

    bundle = load_bundle(cfg(factory, 1), BATCH)
    inputs, target = bundle.make_batch(BATCH, torch.Generator().manual_seed(SEED))
    bundle.model.eval()
    with torch.no_grad():
        return float(bundle.loss_fn(bundle.model(*inputs), target))


def test_recompute_without_stashing_draws_the_forward_masks(dropout_runs: dict[str, Any]) -> None:
    """PipeDream without weight stashing recomputes each stage's forward under a newer
    version: the recompute runs under the unit's stream, so the run equals the replay."""
    run, r = dropout_runs["runs"]["recompute"], dropout_runs["results"]["recompute"]
    assert run.segments[0].schedule.options["stashing"] is False
    rep = replay_config(run)
    assert_state_equal(r.state, rep.params, 1e-5)
    assert r.losses == pytest.approx([rep.losses[u] for u in sorted(rep.losses)], rel=1e-5)


# --------------------------------------------------------------------------- encoder-decoder models


def test_stock_t5_trains_on_two_stages_like_one_worker() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(SEED)
    model = t5().model
    assert model.config.use_cache and model.decoder.config.use_cache  # left at its default
    two_cfg = cfg("t5", 2, microbatches=2, steps=2)
    [two] = launch_local([resolve_run(two_cfg)], timeout=TIMEOUT)
    one = train_one_process(resolve_run(cfg("t5", 1, microbatches=2, steps=2)))
    assert_state_equal(two.state, one.state, 1e-5)
    assert two.losses == pytest.approx(one.losses, rel=1e-5)
