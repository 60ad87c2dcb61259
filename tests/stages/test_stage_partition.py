"""Stage modules built from the captured graph: relay, codecs, plans, errors (one process)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipetrain.errors import RuntimeConfigError
from pipetrain.graph import capture
from pipetrain.models import TINY_OPTIONS, get_model
from pipetrain.plan.cuts import split_by_config
from pipetrain.plan.types import Plan
from pipetrain.stages.partition import boundary_codecs, build_stage_modules, partition_graph


def stage_nodes_of_plan(plan: Plan) -> list[list[str]]:
    return [list(s.nodes) for s in plan.stages]

pytestmark = pytest.mark.timeout(120)
CPU = torch.device("cpu")


def run_chain(captured: Any, stage_nodes: list[list[str]], inputs: tuple, grad_check: bool = False) -> Any:
    """Run the stages one after the other, through their codecs (what the wire carries)."""
    part = partition_graph(captured.gm, stage_nodes)
    codecs = boundary_codecs(captured.gm, part, inputs)
    mods = build_stage_modules(captured, part, codecs, range(part.num_stages))
    values: list[Any] = list(inputs)
    for k in range(part.num_stages):
        out = mods[k].module(*values)
        if k == part.num_stages - 1:
            return mods[k].finish_output(out), part, codecs
        wires = codecs[k].encode(out, CPU)
        wires = [w.detach().clone() for w in wires]  # what a receive buffer holds
        for i in codecs[k].grad_indices:
            wires[i].requires_grad_(True)
        values = codecs[k].decode(wires)
    raise AssertionError("unreachable")


@pytest.mark.parametrize("name", ["mlp", "resnet50", "gpt", "gnmt", "vgg16"])
def test_stage_chain_equals_model(name: str) -> None:
    torch.manual_seed(0)
    b = get_model(name, batch_size=4, **TINY_OPTIONS[name])
    cm = capture(b.model, b.example_inputs)
    ref = cm.gm(*b.example_inputs)
    for stages in (2, 3):
        plan = split_by_config(cm, [1] * stages)
        out, part, _ = run_chain(cm, stage_nodes_of_plan(plan), b.example_inputs)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        # every parameter belongs to exactly one stage, under the model's own name
        assert set(part.param_stage) == {n for n, _ in b.model.named_parameters()}


def test_hf_gpt2_stages_pass_ints_across_cuts() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    b = get_model("hf-gpt2", batch_size=2, **TINY_OPTIONS["hf-gpt2"])
    cm = capture(b.model, b.example_inputs)
    plan = split_by_config(cm, [1, 1, 1])
    out, part, codecs = run_chain(cm, stage_nodes_of_plan(plan), b.example_inputs)
    torch.testing.assert_close(out, cm.gm(*b.example_inputs), rtol=0, atol=0)
    kinds = [c.template[0] for bc in codecs for c in bc.codecs]
    assert "s" in kinds  # a Python int (the batch size) crosses a cut as a small tensor


class Skip3(nn.Module):
    """x -> a -> b -> c; out = c + x (the skip from the input crosses two cuts)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        h = self.act(self.b(self.a(x)))
        return (self.c(h) + x).view(n, -1)


def test_relay_passes_skip_through_middle_stage_and_ints_cross() -> None:
    torch.manual_seed(0)
    m = Skip3()
    x = torch.randn(3, 4)
    cm = capture(m, (x,))
    names = [n.name for n in cm.graph.nodes]
    # stage 0: x, size, a; stage 1: b, act; stage 2: c, add, view
    s0 = [n for n in names if n in ("x", "size", "a")]
    s1 = [n for n in names if n in ("b", "act")]
    s2 = [n for n in names if n not in s0 + s1]
    out, part, codecs = run_chain(cm, [s0, s1, s2], (x,))
    torch.testing.assert_close(out, m(x))
    assert "x" in part.boundaries[0] and "x" in part.boundaries[1]   # relayed 0 -> 1 -> 2
    assert "size" in part.boundaries[1]                               # an int, relayed too
    bc = codecs[1]
    assert [s.needs_grad for s in bc.specs].count(True) == 1          # only act's output carries grad
    # stage 1 passes x straight from its input to its output
    mods = build_stage_modules(cm, part, codecs, [1])
    g = mods[1].module.graph
    out_node = next(n for n in g.nodes if n.op == "output")
    phs = {n.name: n for n in g.nodes if n.op == "placeholder"}
    assert phs["x"] in out_node.args[0]


def test_received_tensor_mutated_in_place_is_cloned() -> None:
    torch.manual_seed(0)
    m = Skip3()
    x = torch.randn(3, 4)
    cm = capture(m, (x,))
    names = [n.name for n in cm.graph.nodes]
    s0 = [n for n in names if n in ("x", "size", "a", "b")]
    s1 = [n for n in names if n not in s0]   # starts with act (in place) on a received tensor
    part = partition_graph(cm.gm, [s0, s1])
    codecs = boundary_codecs(cm.gm, part, (x,))
    mods = build_stage_modules(cm, part, codecs, [0, 1])
    wires = [w.detach().clone() for w in codecs[0].encode(mods[0].module(x), CPU)]
    leaves = [w.requires_grad_(True) if s.needs_grad else w for w, s in zip(wires, codecs[0].specs)]
    before = [w.detach().clone() for w in leaves]
    out = mods[1].module(*codecs[0].decode(leaves))
    out.sum().backward()   # an in-place op on a leaf that requires grad would raise here
    for w, b0 in zip(leaves, before):
        assert torch.equal(w.detach(), b0)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(t)))


def test_tied_weights_across_stages_are_recorded() -> None:
    """A tensor read by two stages is a tie (stages/tied.py keeps the copies equal)."""
    m = Tied()
    cm = capture(m, (torch.randint(0, 10, (2, 3)),))
    names = [n.name for n in cm.graph.nodes]
    part = partition_graph(cm.gm, [names[:2], names[2:]])
    assert [(t.names, t.stages) for t in part.tied] == [(("emb.weight", "head.weight"), (0, 1))]
    one = partition_graph(cm.gm, [names])  # one stage holding both readers: aliases only
    assert [(t.names, t.stages) for t in one.tied] == [(("emb.weight", "head.weight"), (0,))]


def test_bad_plans_are_explained() -> None:
    b = get_model("mlp", batch_size=2, **TINY_OPTIONS["mlp"])
    cm = capture(b.model, b.example_inputs)
    names = [n.name for n in cm.graph.nodes]
    with pytest.raises(RuntimeConfigError, match="lists node 'conv9', which the captured model has no node of"):
        partition_graph(cm.gm, [names[:3] + ["conv9"], names[3:]])
    with pytest.raises(RuntimeConfigError, match="reads '_0' from the later stage 1"):
        partition_graph(cm.gm, [names[:1] + names[2:], names[1:2]])
    with pytest.raises(RuntimeConfigError, match="places no stage for 1 node"):
        partition_graph(cm.gm, [names[:3], names[3:-1]])
    layers = len(names) - 1
    with pytest.raises(RuntimeConfigError, match=f"the model has {layers} layers, too few for {layers + 1} stages"):
        split_by_config(cm, [1] * (layers + 1))


def test_split_by_config_is_balanced_and_deterministic() -> None:
    b = get_model("mlp", batch_size=8, depth=8, width=32, in_features=32, num_classes=None)
    cm = capture(b.model, b.example_inputs)
    p1, p2 = split_by_config(cm, [2, 1]), split_by_config(cm, [2, 1])
    assert stage_nodes_of_plan(p1) == stage_nodes_of_plan(p2)
    assert p1.config == "2-1"
    linears = [sum(1 for n in s.nodes if cm.graph[n].op.startswith("Linear")) for s in p1.stages]
    assert linears == [4, 4]


def test_split_at_cuts_by_module_and_node_name() -> None:
    from pipetrain.plan.cuts import split_at_cuts, stage_first_nodes

    bundle = get_model("gpt", **TINY_OPTIONS.get("gpt", {}))
    captured = capture(bundle.model, bundle.example_inputs)
    plan = split_at_cuts(captured, ["blocks.1"], [1, 1])
    inputs = [n.name for n in captured.graph.nodes if n.is_input]
    first = stage_first_nodes(plan, inputs)
    assert first[0] == "wte" and first[1].startswith("blocks_1_")
    # every node of stage 0 precedes block 1, every node of stage 1 is block 1 or later
    assert not any(n.startswith("blocks_1_") for n in plan.stages[0].nodes)
    assert sum(len(s.nodes) for s in plan.stages) == len(list(captured.graph.nodes))
    same = split_at_cuts(captured, [first[1]], [1, 1])  # by node name: the same plan
    assert [s.nodes for s in same.stages] == [s.nodes for s in plan.stages]
    out, _, _ = run_chain(captured, stage_nodes_of_plan(plan), bundle.example_inputs)
    with torch.no_grad():
        ref = bundle.model(*bundle.example_inputs)
    torch.testing.assert_close(out, ref)
    with pytest.raises(RuntimeConfigError, match="names no node or module"):
        split_at_cuts(captured, ["blocks.99"], [1, 1])
    with pytest.raises(RuntimeConfigError, match="model order"):
        split_at_cuts(captured, ["blocks.1", "wte"], [1, 1, 1])
    with pytest.raises(RuntimeConfigError, match="one cut name fewer"):
        split_at_cuts(captured, ["blocks.1"], [1, 1, 1])


def test_fused_linear_accumulates_like_autograd() -> None:
    from pipetrain.runtime.engine.fused import AccumulatingLinear, GradSink, install

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3, bias=False))
    gm = torch.fx.symbolic_trace(model)
    ref = torch.fx.symbolic_trace(nn.Sequential(*[m for m in model]))
    xs = [torch.randn(4, 2, 6) for _ in range(3)]
    expected = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for x in xs:  # plain autograd, summed over the units
        gs = torch.autograd.grad(ref(x).square().sum(), list(model.parameters()))
        for (n, _), g in zip(model.named_parameters(), gs):
            expected[n] += g
    sink = GradSink()
    fed = install(gm, {n for n, _ in model.named_parameters()}, sink)
    assert sorted(fed) == ["0.bias", "0.weight", "2.weight"]
    assert isinstance(gm.get_submodule("0"), AccumulatingLinear)
    sink.buffers = {n: torch.full_like(p, 7.0) for n, p in model.named_parameters()}  # overwritten by unit 1
    for x in xs:
        gs = torch.autograd.grad(gm(x).square().sum(), list(model.parameters()), allow_unused=True)
        assert all(g is None for g in gs)  # autograd returns nothing: the sink has it
    for n in fed:
        torch.testing.assert_close(sink.buffers[n], expected[n], rtol=1e-5, atol=1e-5)


def test_cut_option_is_checked_against_config_and_plan() -> None:
    from pipetrain.job.config import TrainConfig

    assert TrainConfig.of(cut="blocks.4", config="2-1").parallel.cut == "blocks.4"
    with pytest.raises(RuntimeConfigError, match="makes 2 stages but --config 1-1-1 has 3"):
        TrainConfig.of(cut="blocks.4", config="1-1-1")
    with pytest.raises(RuntimeConfigError, match="not both"):
        TrainConfig.of(cut="blocks.4", plan="p.json")
    with pytest.raises(RuntimeConfigError, match="--cut takes"):
        TrainConfig.of(cut="a,,b")
    with pytest.raises(RuntimeConfigError, match="makes 2 stages but --config 1-1 has 4"):  # 2 chunks per rank
        TrainConfig.of(cut="blocks.4", config="1-1", schedule="interleaved")
