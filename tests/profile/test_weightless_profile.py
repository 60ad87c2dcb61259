"""Profiling a weightless capture (the launcher's, on ``meta``) holds a few of its tensors at a
time, finds what the built model's profile finds, and leaves the capture as it was."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipetrain.auto.stage_timing import stage_seconds
from pipetrain.graph.capture import capture
from pipetrain.graph.held import HeldTensors
from pipetrain.job import TrainConfig
from pipetrain.job.model import load_captured
from pipetrain.models import TINY_OPTIONS
from pipetrain.models.materialize import build_weightless, on_device_of
from pipetrain.profile.measure import MeasureOptions, measure_graph
from pipetrain.profile.profiler import profile_captured

torch.set_num_threads(1)
FAST = dict(warmup=0, repeats=1, threads=1)


def _cfg(name: str) -> TrainConfig:
    return TrainConfig.of(model=name, model_options=dict(TINY_OPTIONS[name]), batch_size=2, seed=3)


def _state(gm: torch.fx.GraphModule) -> tuple[list[tuple[str, int]], str]:
    tensors = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    return [(n, id(t)) for n, t in tensors], gm.code


@pytest.mark.parametrize("name", ["mlp", "gpt", "gnmt", "resnet50"])
def test_a_weightless_capture_profiles_like_the_built_model(name: str) -> None:
    """Same nodes, bytes and saved tensors as the materialised model's profile; the capture
    stays on meta with the same tensor objects and the same code."""
    _, built = load_captured(_cfg(name), 2, weights=True)
    bundle, meta = load_captured(_cfg(name), 2)
    assert all(t.is_meta for t in meta.gm.parameters())
    before = _state(meta.gm)
    inputs = tuple(bundle.make_batch(2, torch.Generator().manual_seed(0))[0])
    real = profile_captured(built, inputs, batch_size=2, **FAST)
    held = profile_captured(meta, inputs, batch_size=2, **FAST)
    assert _state(meta.gm) == before and all(t.is_meta for t in meta.gm.parameters())

    def fields(p: Any) -> list[tuple[Any, ...]]:
        return [(n.name, n.kind, n.activation_bytes, n.parameter_bytes, n.saved_bytes, tuple(n.saved_inputs),
                 n.output_saved, tuple(n.inputs)) for n in p.nodes]

    assert fields(held) == fields(real)
    assert held.loss_saved_bytes == real.loss_saved_bytes
    assert held.measured_forward_time is not None and held.measured_forward_time > 0


class Deep(nn.Module):
    """Layers large enough that each is a segment of its own."""

    def __init__(self, layers: int = 24, width: int = 768) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _weightless_deep() -> tuple[Any, torch.Tensor, int]:
    model, weightless = build_weightless(Deep, lambda m: m, seed=0)
    x = torch.randn(64, 768)
    captured = capture(model, on_device_of(model, (x,)), validate=False)
    captured.tensor_values = weightless.initial_value
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return captured, x, total


def test_timing_a_weightless_graph_holds_a_few_tensors_at_a_time() -> None:
    captured, x, total = _weightless_deep()
    acts = {n.name: n.activation_bytes for n in captured.graph}
    limit = total / 4  # the check: a tail whose activations and parameters (twice) fit
    measured = measure_graph(captured.gm, (x,), torch.device("cpu"), MeasureOptions(0, 1, check_memory=limit),
                             activation_bytes=acts)
    assert 0 < measured.held_bytes <= 0.3 * total, (measured.held_bytes, total)
    assert measured.step_from is not None  # the check ran on a tail, not the whole model
    assert all(t.is_meta for t in captured.gm.parameters())
    assert measured.times and all(f >= 0 and b >= 0 for f, b in measured.times.values())


def test_a_check_on_a_short_tail_lets_the_tensors_before_it_go() -> None:
    captured, x, total = _weightless_deep()
    acts = {n.name: n.activation_bytes for n in captured.graph}
    compute = [n.name for n in captured.gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    # no memory bound: every tensor could be checked; bounded by time, the check takes a short tail
    unbounded = measure_graph(captured.gm, (x,), torch.device("cpu"),
                              MeasureOptions(0, 1, check_memory=None, check_seconds=None), activation_bytes=acts)
    assert unbounded.step_from is None and unbounded.held_bytes == total  # the whole model kept to check
    measured = measure_graph(captured.gm, (x,), torch.device("cpu"),
                             MeasureOptions(0, 1, check_memory=None, check_seconds=0.0), activation_bytes=acts)
    assert measured.step_from is not None
    tail = compute[compute.index(measured.step_from):]
    assert len(tail) <= len(compute) // 4, tail
    # the tensors kept for tails that can no longer be the check went as soon as they could
    assert measured.held_bytes <= 0.3 * total, (measured.held_bytes, total)
    assert all(t.is_meta for t in captured.gm.parameters())


def test_held_tensors_share_a_tie_and_leave_the_graph_as_it_was() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids))

    model, weightless = build_weightless(Tied, lambda m: m, seed=0)
    ids = torch.randint(0, 10, (2, 3))
    captured = capture(model, on_device_of(model, (ids,)), validate=False)
    gm, before = captured.gm, _state(captured.gm)
    compute = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module", "call_method")]
    with HeldTensors(gm) as held:
        for n in compute:
            held.hold(n)
        reals = {id(t) for t in gm.parameters()}
        assert len(reals) == 1 and not next(gm.parameters()).is_meta  # one tensor for both names
        first = next(gm.parameters()).detach().clone()
        for n in compute:
            held.done(n)
        held.release()
        assert all(t.is_meta for t in gm.parameters())
        held.hold(compute[0])
        assert torch.equal(next(gm.parameters()), first)  # a stand-in is the same every time
    assert _state(gm) == before


def test_held_tensors_take_the_known_values() -> None:
    model, _ = build_weightless(lambda: nn.Linear(4, 3), lambda m: m, seed=0)
    captured = capture(model, on_device_of(model, (torch.randn(2, 4),)), validate=False)
    known = {"weight": torch.arange(12.0).reshape(3, 4)}
    node = next(n for n in captured.gm.graph.nodes if n.op in ("call_function", "call_module"))
    with HeldTensors(captured.gm, known.get) as held:
        held.hold(node)
        assert torch.equal(captured.gm.get_parameter("weight").detach(), known["weight"])


def test_a_weightless_stage_is_timed_holding_its_tensors_only_meanwhile() -> None:
    captured, x, _ = _weightless_deep()
    names = [n.name for n in captured.gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    half = len(names) // 2
    seconds = stage_seconds(captured.gm, (x,), [names[:half], names[half:]], repeats=1,
                            tensor_values=captured.tensor_values)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
    assert all(t.is_meta for t in captured.gm.parameters())


def test_an_optimizer_step_is_timed_on_a_bounded_sample_of_a_stage() -> None:
    """The automatic choice times a stage's STEP on at most a fixed number of elements (the
    rest scaled), so a stage as large as the model is never allocated three times over."""
    from pipetrain.auto.choose import sample_shapes

    shapes = [(4, 5), (10,), (3, 3), (7,)]
    assert sample_shapes(shapes, 100) == ([(4, 5), (10,), (3, 3), (7,)], 46)
    assert sample_shapes(shapes, 25) == ([(4, 5), (5,)], 46)  # the crossing tensor cut to what is left
    assert sample_shapes(shapes, 20) == ([(4, 5)], 46)
    assert sample_shapes([(1000, 1000)], 10) == ([(10,)], 10 ** 6)
