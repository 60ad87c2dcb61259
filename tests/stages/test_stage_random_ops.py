"""Stage modules draw their random numbers from the per-unit stream (graph/random_ops.py): a
model cut into stages gives the masks of the whole graph as one stage, on any cut."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.graph import capture
from pipetrain.graph.random_ops import unit_stream
from pipetrain.stages.partition import boundary_codecs, build_stage_modules, partition_graph, whole_graph_stage

pytestmark = pytest.mark.timeout(120)
CPU = torch.device("cpu")


class Dropping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.a(x)))
        h = F.dropout(torch.relu(self.b(h)), 0.3, training=self.training)
        return self.c(h)


def chain(cm: Any, stage_nodes: list[list[str]], x: torch.Tensor, unit: int) -> tuple[torch.Tensor, list[Any]]:
    part = partition_graph(cm.gm, stage_nodes)
    codecs = boundary_codecs(cm.gm, part, (x,))
    mods = build_stage_modules(cm, part, codecs, range(part.num_stages))
    values: list[Any] = [x]
    for k in range(part.num_stages):
        with unit_stream(5, unit):  # each stage enters the unit's stream on its own (another process)
            out = mods[k].module(*values)
        if k == part.num_stages - 1:
            return out, [mods[j] for j in range(part.num_stages)]
        values = codecs[k].decode([w.detach().clone() for w in codecs[k].encode(out, CPU)])
    raise AssertionError("unreachable")


def test_every_cut_draws_the_masks_of_the_whole_graph() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    cm = capture(Dropping(), (x,))
    whole = whole_graph_stage(cm)
    assert whole.random_nodes == ("drop", "dropout")
    names = [n.name for n in cm.graph.nodes]
    for unit in (0, 1):
        with unit_stream(5, unit):
            ref = whole.module(x)
        for cut in range(2, len(names)):
            out, mods = chain(cm, [names[:cut], names[cut:]], x, unit)
            torch.testing.assert_close(out, ref, rtol=0, atol=0)
            assert sorted(n for m in mods for n in m.random_nodes) == ["drop", "dropout"]
    with unit_stream(5, 0):
        first = whole.module(x)
    assert not torch.equal(first, ref)  # units draw different masks


class Attending(nn.Module):
    def __init__(self, p: float | None) -> None:
        super().__init__()
        self.qkv, self.p = nn.Linear(8, 24), p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.p is None:  # dropout_p left at its default, as Hugging Face's attention passes it when not training
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=True)


@pytest.mark.parametrize(("p", "draws"), [(None, False), (0.0, False), (0.2, True)])
def test_attention_draws_only_with_a_dropout_probability(p: float | None, draws: bool) -> None:
    from pipetrain.graph.random_ops import random_nodes

    cm = capture(Attending(p), torch.randn(2, 5, 8))
    assert bool(random_nodes(cm.gm)) == draws


def test_the_stream_seeds_the_generator_as_manual_seed_would() -> None:
    from pipetrain.graph.random_ops import draw_from_stream, unit_seed

    before = torch.random.get_rng_state()
    with unit_stream(5, 3):
        draw_from_stream("drop")
        drawn = torch.rand(4)
    torch.manual_seed(unit_seed(5, 3, "drop"))
    assert torch.equal(drawn, torch.rand(4))
    torch.random.set_rng_state(before)
