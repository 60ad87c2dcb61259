"""Capture keeps plain PyTorch semantics: buffers a forward updates, encoder-decoder caches,
errors that name their real cause, and the random nodes' per-unit stream (graph/random_ops.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.errors import CaptureError
from pipetrain.graph import capture
from pipetrain.graph.capture import buffer_updates
from pipetrain.graph.random_ops import random_nodes, seeded_module, unit_seed, unit_stream

pytestmark = pytest.mark.timeout(120)


class InPlaceStats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("mean", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        with torch.no_grad():
            self.count += 1
            self.mean.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return self.b(h * self.count + self.mean)


class AssignedStats(InPlaceStats):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        with torch.no_grad():
            self.count = self.count + 1
            self.mean = 0.9 * self.mean + 0.1 * h.mean(0)
        return self.b(h * self.count + self.mean)


@pytest.mark.parametrize("cls", [InPlaceStats, AssignedStats])
def test_buffers_a_forward_updates_are_part_of_the_graph(cls: type[nn.Module]) -> None:
    """``torch.fx`` would run the update while tracing and keep the counter as a constant:
    the capture rejects that trace, leaves the model as it was, and the graph updates the
    buffers on every call exactly as the model's forward does."""
    torch.manual_seed(0)
    model, twin = cls(), cls()
    twin.load_state_dict(model.state_dict())
    bound = {n: b for n, b in model.named_buffers()}
    x = torch.randn(3, 4)
    cm = capture(model, (x,))
    assert cm.method == "export"
    for n, b in model.named_buffers():  # bindings and values as before the capture
        assert b is bound[n] and torch.equal(b, twin.get_buffer(n))
    for _ in range(3):
        torch.testing.assert_close(cm.gm(x), twin(x), rtol=0, atol=0)
    assert float(model.count) == 3 and float(twin.count) == 3
    torch.testing.assert_close(model.mean, twin.mean, rtol=0, atol=0)
    assert [u.name for u in buffer_updates(cm.gm)] == ["count", "mean"]


@pytest.mark.parametrize("cls", [InPlaceStats, AssignedStats])
def test_buffer_updates_are_recorded_when_captured_on_meta(cls: type[nn.Module]) -> None:
    """Without values (a weightless build captures on ``meta``, unvalidated), the trace that
    ran the update is still recognised (the buffer's version counter moved)."""
    with torch.device("meta"):
        model = cls()
    cm = capture(model, (torch.randn(3, 4, device="meta"),), validate=False)
    assert cm.method == "export"
    assert [u.name for u in buffer_updates(cm.gm)] == ["count", "mean"]


def test_stock_t5_is_captured_without_its_cache() -> None:
    pytest.importorskip("transformers")
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0))
    assert model.config.use_cache and model.decoder.config.use_cache
    src, tgt = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 5))
    cm = capture(model, (src, torch.ones(2, 8, dtype=torch.long), tgt))
    assert model.config.use_cache and model.decoder.config.use_cache  # restored
    out = cm.gm(src, torch.ones(2, 8, dtype=torch.long), tgt)
    assert "logits" in out and not any("cache" in k or "past" in k for k in out)
    with torch.no_grad():
        ref = model(src, torch.ones(2, 8, dtype=torch.long), tgt).logits
    torch.testing.assert_close(out["logits"], ref)


class Box:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class ReturnsBox(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Box:
        return Box(self.fc(x))


class ThroughNumpy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(x.detach().numpy() * 2)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.inner = ThroughNumpy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.fc(x))


def test_an_untraceable_output_type_is_named_without_the_control_flow_hint() -> None:
    with pytest.raises(CaptureError) as e:
        capture(ReturnsBox(), torch.randn(3, 4))
    msg = str(e.value)
    assert ("torch.export: RuntimeError: Found <class 'test_capture_state.Box'> in output, which is not a known "
            "type" in msg)
    assert "control flow" not in msg and "data-dependent" not in msg
    assert "fix: change the operation or output type these errors name" in msg and "\n" not in msg


def test_a_capture_error_names_the_submodule_and_line() -> None:
    with pytest.raises(CaptureError) as e:
        capture(Outer(), torch.randn(3, 4))
    msg = str(e.value)
    assert ("torch.export: RuntimeError: .numpy() is not supported for tensor subclasses. (at test_capture_state.py"
            in msg)
    assert "in module inner (ThroughNumpy)" in msg and "`return torch.from_numpy(x.detach().numpy() * 2)`" in msg
    assert "control flow" not in msg


class Dropping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 16)
        self.drop, self.off = nn.Dropout(0.5), nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.off(self.drop(self.fc(x)))
        return F.dropout(h, 0.25, training=self.training) + torch.rand_like(h)


def test_random_nodes_draw_from_the_unit_stream() -> None:
    torch.manual_seed(0)
    model = Dropping()
    x = torch.randn(64, 4)
    cm = capture(model, (x,))
    assert random_nodes(cm.gm) == ["drop", "dropout", "rand_like"]  # a dropout of p=0 draws nothing
    seeded = seeded_module(cm.gm)
    with unit_stream(7, 3):
        a = seeded(x)
    state = torch.get_rng_state()
    with unit_stream(7, 3):
        b = seeded(x)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is left as it was
    with unit_stream(7, 4):
        c = seeded(x)
    with unit_stream(8, 3):
        d = seeded(x)
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, d)
    # the rule: node n of unit u starts from unit_seed(seed, u, n)
    torch.manual_seed(unit_seed(7, 3, "drop"))
    expect = nn.functional.dropout(model.fc(x), 0.5)
    torch.manual_seed(unit_seed(7, 3, "dropout"))
    expect = F.dropout(expect, 0.25)
    torch.manual_seed(unit_seed(7, 3, "rand_like"))
    expect = expect + torch.rand_like(expect)
    torch.testing.assert_close(a, expect, rtol=0, atol=0)
    # outside a unit stream the graph draws from the global generator, as the model does
    torch.manual_seed(1)
    e = seeded(x)
    torch.manual_seed(1)
    torch.testing.assert_close(e, model(x), rtol=0, atol=0)
