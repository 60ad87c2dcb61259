"""A captured graph taken at another batch (pipetrain.graph.capture.rebatched): the same
node metas as a capture made at that batch, and ``None`` wherever the graph is not known to
hold there (a batch the tracer specialised, another structure, another output)."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from pipetrain.graph.capture import CapturedModel, capture, rebatched
from pipetrain.models import TINY_OPTIONS, get_model


def metas(cm: CapturedModel) -> list[tuple[str, list]]:
    return [(n.name, n.outputs) for n in cm.graph]


class Branchy(nn.Module):
    """fx cannot trace a branch on a shape; torch.export records the branch taken."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 3:
            x = x.repeat(1, 2)
        return self.fc(x).reshape(x.shape[0], 5, 1)


class Eight(Branchy):
    """A branch on the batch itself: export specialises the batch to the example's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 8:
            x = x * 2
        return self.fc(x)


class SizedByBatch(nn.Module):
    """A factory that sizes its model by the batch through a plain attribute (no tensor shows it)."""

    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch, self.fc = batch, nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).reshape(self.batch, -1)


def test_an_fx_graph_at_another_batch_has_the_metas_of_a_capture_there() -> None:
    torch.manual_seed(0)
    bundle = get_model("gpt", batch_size=8, **TINY_OPTIONS["gpt"])
    cm = capture(bundle.model, bundle.example_inputs)
    assert cm.method == "fx"
    for b in (4, 1):
        torch.manual_seed(0)  # as the launcher builds every size: the same tensors
        other = get_model("gpt", batch_size=b, **TINY_OPTIONS["gpt"])
        again = rebatched(cm, other.model, other.example_inputs)
        assert again is not None and again.gm is cm.gm
        assert metas(again) == metas(capture(other.model, other.example_inputs))
        assert metas(again) != metas(cm)
    assert metas(cm) == metas(capture(bundle.model, bundle.example_inputs))  # the original is unchanged


def test_an_export_graph_holds_over_its_batch_range_and_not_at_a_batch_of_one() -> None:
    torch.manual_seed(0)
    model = Branchy()
    cm = capture(model, torch.randn(8, 3))
    assert cm.method == "export"
    again = rebatched(cm, model, torch.randn(4, 3))
    assert again is not None
    assert metas(again) == metas(capture(model, torch.randn(4, 3)))
    x = torch.randn(4, 3)
    assert torch.equal(again.gm(x), model(x))
    assert rebatched(cm, model, torch.randn(1, 3)) is None  # export specialises 0 and 1
    assert rebatched(cm, model, torch.randn(4, 6)) is None  # another branch: a static dimension differs


def test_a_batch_the_tracer_specialised_is_captured_again() -> None:
    model = Eight()
    cm = capture(model, torch.randn(8, 6))
    assert cm.method == "export"
    assert rebatched(cm, model, torch.randn(8, 6)) is not None
    assert rebatched(cm, model, torch.randn(4, 6)) is None


def test_another_structure_or_another_output_is_captured_again() -> None:
    torch.manual_seed(0)
    cm = capture(nn.Sequential(nn.Linear(6, 4), nn.ReLU()), torch.randn(8, 6))
    assert rebatched(cm, nn.Sequential(nn.Linear(6, 3), nn.ReLU()), torch.randn(4, 6)) is None
    sized = capture(SizedByBatch(8), torch.randn(8, 6))
    assert sized.method == "fx"  # the graph holds the batch 8 as a number
    assert rebatched(sized, SizedByBatch(4), torch.randn(4, 6)) is None  # its output shape is not the model's
    torch.manual_seed(1)
    other_values = get_model("gpt", batch_size=4, **TINY_OPTIONS["gpt"])
    torch.manual_seed(0)
    gpt = get_model("gpt", batch_size=8, **TINY_OPTIONS["gpt"])
    cm = capture(gpt.model, gpt.example_inputs)
    assert rebatched(cm, other_values.model, other_values.example_inputs) is None  # the graph holds other values


def test_rebatching_leaves_buffers_and_the_rng_alone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    model.train()
    cm = capture(model, torch.randn(8, 6))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    graph_before = {k: v.clone() for k, v in cm.gm.state_dict().items()}
    x = torch.randn(4, 6)
    rng = torch.get_rng_state()
    assert rebatched(cm, model, x) is not None
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, graph_before[k]) for k, v in cm.gm.state_dict().items())


class Batches(nn.Module):
    """Records the batch of every forward that computes (not on ``meta``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(6, 4), nn.BatchNorm1d(4)
        self.computed: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.fx.Proxy) and not x.is_meta:
            self.computed.append(int(x.shape[0]))
        return self.bn(self.fc(x)).relu()


class Constant(Batches):
    """Holds a tensor that is neither parameter nor buffer: its graph does not run on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = torch.randn(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shift


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    return [(n, t, t.detach().clone()) for n, t in [*model.named_parameters(), *model.named_buffers()]]


def test_trace_at_computes_only_the_small_batch_and_gives_the_capture_of_the_whole(monkeypatch) -> None:
    cap = importlib.import_module("pipetrain.graph.capture")  # the module (the package exports the function)
    monkeypatch.setattr(cap, "TRACE_AT_WORTH", 0.0)  # take it by shape, however small the model
    torch.manual_seed(0)
    model = Batches().train()
    x = torch.randn(32, 6)
    held = _tensors(model)
    rng = torch.get_rng_state()
    taken = capture(model, x, trace_at=x[:2])
    assert set(model.computed) == {2}  # checked by value at 2 only; 32 ran on meta
    assert torch.equal(torch.get_rng_state(), rng)
    now = dict([*model.named_parameters(), *model.named_buffers()])
    assert all(now[n] is t and not t.is_meta and torch.equal(t, v) for n, t, v in held)  # the same tensors, untouched
    model.computed.clear()
    whole = capture(model, x)
    assert 32 in model.computed
    assert taken.graph == whole.graph and metas(taken) == metas(whole)
    assert torch.allclose(taken.gm(x), model(x))


def test_trace_at_traces_the_whole_batch_where_the_graph_is_not_known_to_hold_there(monkeypatch) -> None:
    cap = importlib.import_module("pipetrain.graph.capture")  # the module (the package exports the function)
    x = torch.randn(32, 6)
    small = Batches()
    capture(small, x, trace_at=x[:2])  # a model this small is checked at 32 sooner than taken
    assert 32 in small.computed
    monkeypatch.setattr(cap, "TRACE_AT_WORTH", 0.0)
    torch.manual_seed(0)
    constant = Constant()
    cm = capture(constant, x, trace_at=x[:2])  # its graph does not run on meta
    assert 32 in constant.computed and metas(cm) == metas(capture(constant, x))
    sized = SizedByBatch(32)
    cm = capture(sized, torch.randn(32, 6), trace_at=torch.randn(2, 6))  # fails at 2: traced at 32
    assert metas(cm) == metas(capture(sized, torch.randn(32, 6)))
