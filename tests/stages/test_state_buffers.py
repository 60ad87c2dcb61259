"""Buffers the forward updates are state of one stage (stages/partition.py, ``Partition.state``).

The stages run one after the other in this process, through their codecs (what the wires
carry), unit after unit, against the model itself: outputs and buffers equal after every call.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

from pipetrain.errors import RuntimeConfigError
from pipetrain.graph import capture
from pipetrain.stages.partition import boundary_codecs, build_stage_modules, partition_graph

pytestmark = pytest.mark.timeout(120)
CPU = torch.device("cpu")


class ReadOnTwoStages(nn.Module):
    """A counter read before its update by the first layer's stage and by the last layer's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        old = self.count
        h = torch.relu(self.a(x)) + self.count
        with torch.no_grad():
            self.count = self.count + 1
        return self.b(h) * old


class UpdatedLate(nn.Module):
    """A running mean read by the first layer and updated from the last layer's output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 8)
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(torch.relu(self.a(x)) + self.mean)
        with torch.no_grad():
            self.mean = 0.9 * self.mean + 0.1 * y.mean(0)
        return y


def split_after(cm: Any, node: str) -> list[list[str]]:
    names = [n.name for n in cm.graph.nodes]
    cut = names.index(node) + 1
    return [names[:cut], names[cut:]]


def run_units(mods: dict[int, Any], codecs: list[Any], x: torch.Tensor) -> torch.Tensor:
    values: list[Any] = [x]
    for k in range(len(mods)):
        out = mods[k].module(*values)
        if k == len(mods) - 1:
            return mods[k].finish_output(out)
        wires = [w.detach().clone() for w in codecs[k].encode(out, CPU)]  # what a receive buffer holds
        values = codecs[k].decode(wires)
    raise AssertionError("unreachable")


def test_a_buffer_is_held_and_updated_by_the_stage_that_reads_it_first() -> None:
    torch.manual_seed(0)
    model, twin = ReadOnTwoStages(), ReadOnTwoStages()
    twin.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    cm = capture(model, (x,))
    part = partition_graph(cm.gm, split_after(cm, "getitem"))  # the last layer and the write-back on stage 1
    [state] = part.state
    assert state.name == "count" and state.stage == 0
    writers = list(state.writers)
    assert writers and all(part.stage_of[w] == 0 for w in writers)  # the write-back moved to stage 0
    assert all(part.stage_of[r] == 0 for r in state.reads)
    assert any(r in part.boundaries[0] for r in state.reads)  # stage 1 receives the value read
    codecs = boundary_codecs(cm.gm, part, (x,))
    mods = build_stage_modules(cm, part, codecs, [0, 1])
    assert "count" in mods[0].buffer_names and "count" not in mods[1].buffer_names
    for _ in range(3):
        torch.testing.assert_close(run_units(mods, codecs, x), twin(x), rtol=0, atol=0)
    assert float(mods[0].module.get_buffer("count")) == 3 == float(twin.count)


def test_a_buffer_updated_on_a_later_stage_than_it_is_read_is_refused() -> None:
    torch.manual_seed(0)
    cm = capture(UpdatedLate(), (torch.randn(3, 4),))
    add = next(u.name for u in cm.gm.graph.nodes if u.op == "get_attr" and u.target == "mean" for u in u.users)
    with pytest.raises(RuntimeConfigError) as e:
        partition_graph(cm.gm, split_after(cm, add))
    msg = str(e.value)
    assert msg.startswith(f"buffer 'mean' is read on stage 0 (node {add!r}) and updated on stage 1 (node ")
    assert "belongs to one stage" in msg and f"that keep nodes {add!r} to " in msg and "in one stage" in msg
    assert "\n" not in msg


class InPlaceStats(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        with torch.no_grad():
            self.mean.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return self.b(h + self.mean)


def test_no_wire_shares_a_buffers_memory() -> None:
    """The running mean updated in place crosses the cut: the stage sends a copy taken where it
    was read, and the runtime copies any wire that would still share a buffer's memory (sends
    are asynchronous; the next unit's forward updates the buffer)."""
    from pipetrain.job import OptimizerConfig
    from pipetrain.runtime.engine.optim import FunctionalOptimizer
    from pipetrain.runtime.engine.stage_runtime import StageRuntime

    torch.manual_seed(0)
    x = torch.randn(3, 4)
    cm = capture(InPlaceStats(), (x,))
    part = partition_graph(cm.gm, split_after(cm, "getitem"))  # the updated mean crosses the cut
    assert "getitem" in part.boundaries[0]
    codecs = boundary_codecs(cm.gm, part, (x,))
    st = StageRuntime(build_stage_modules(cm, part, codecs, [0])[0], FunctionalOptimizer(OptimizerConfig("sgd")),
                      1, CPU)
    mean = st.stage.module.get_buffer("mean")

    def shares(w: torch.Tensor) -> bool:
        return w.untyped_storage().data_ptr() == mean.untyped_storage().data_ptr()

    wires = codecs[0].encode(functional_call(st.stage.module, st.versions.latest, (x,)), CPU)
    assert not any(shares(w) for w in wires)
    sent = [w.clone() for w in wires]
    functional_call(st.stage.module, st.versions.latest, (x,))  # the next unit updates the buffer
    assert all(torch.equal(w, b) for w, b in zip(wires, sent))
    view, other = mean[2:], torch.ones(3)
    out = st.own_wires([view, other])
    assert not shares(out[0]) and torch.equal(out[0], view) and out[1] is other


def test_a_value_read_before_the_write_back_keeps_its_gradient() -> None:
    """``self.b(h) * old`` saves the counter's value for backward and the write-back then
    writes the counter in place: the read is a copy, so two forwards then two backwards (a
    flushed schedule's order) give the model's own gradients."""
    torch.manual_seed(0)
    model, twin = ReadOnTwoStages(), ReadOnTwoStages()
    twin.load_state_dict(model.state_dict())
    xs = [torch.randn(3, 4) for _ in range(2)]
    cm = capture(model, (xs[0],))
    part = partition_graph(cm.gm, [[n.name for n in cm.graph.nodes]])
    [sm] = build_stage_modules(cm, part, [], [0]).values()
    params = dict(sm.module.named_parameters())
    outs = [sm.finish_output(sm.module(x)).sum() for x in xs]
    grads = [torch.autograd.grad(o, list(params.values())) for o in outs]
    twin_params = dict(twin.named_parameters())
    twin_outs = [twin(x).sum() for x in xs]
    for g, o in zip(grads, twin_outs):
        for a, b in zip(g, torch.autograd.grad(o, [twin_params[n] for n in params])):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert float(sm.module.get_buffer("count")) == 2 == float(twin.count)
