"""Graph capture: node structure, exact parameter bytes, real activation sizes, skip edges,
exact node-by-node execution, Hugging Face GPT-2 via torch.export, and user errors."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from pipetrain.errors import CaptureError, PipetrainError
from pipetrain.graph import capture, model_parameter_bytes, run_node_by_node
from pipetrain.graph.capture import tensor_metas
from pipetrain.models import TINY_OPTIONS, get_model

torch.set_num_threads(1)

ZOO = ["mlp", "alexnet", "vgg16", "resnet50", "gnmt", "gpt"]


def tiny(name: str, batch_size: int = 2):
    torch.manual_seed(0)
    return get_model(name, batch_size=batch_size, **TINY_OPTIONS[name])


def leaves(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def outputs_equal(a: Any, b: Any) -> bool:
    la, lb = leaves(a), leaves(b)
    return len(la) == len(lb) > 0 and all(torch.equal(x, y) for x, y in zip(la, lb))


def tiny_hf_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16,
                                  use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


# --------------------------------------------------------------------------- structure


def test_sequential_nodes_names_kinds_and_bytes() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    cm = capture(model, torch.randn(5, 4))
    assert cm.method == "fx"
    g = cm.graph
    assert [n.kind for n in g] == ["input", "module", "module", "module"]
    assert [n.target for n in g][1:] == ["0", "1", "2"]
    assert g.nodes[1].op == "Linear(in_features=4, out_features=8, bias=True)"
    assert g.nodes[1].parameter_bytes == (4 * 8 + 8) * 4
    assert g.nodes[2].parameter_bytes == 0
    assert g.nodes[3].inputs == [g.nodes[2].name]
    assert [m.shape for m in g.nodes[3].outputs] == [(5, 3)]
    assert g.outputs == cm.output_names == [g.nodes[3].name]
    assert cm.input_names == [g.nodes[0].name]
    assert g.nodes[0].activation_bytes == 5 * 4 * 4


@pytest.mark.parametrize("name", ZOO)
def test_layer_names_are_gm_node_names(name: str) -> None:
    cm = capture(tiny(name).model, tiny(name).example_inputs)
    gm_nodes = {n.name: n for n in cm.gm.graph.nodes}
    layer_names = [n.name for n in cm.graph]
    assert set(layer_names) <= set(gm_nodes)
    # every gm node that is not a layer is a folded attribute read or the output node
    extra = {gm_nodes[k].op for k in set(gm_nodes) - set(layer_names)}
    assert extra <= {"get_attr", "output"}
    # topological order: every input is listed before its reader
    pos = {n: i for i, n in enumerate(layer_names)}
    assert all(pos[src] < pos[n.name] for n in cm.graph for src in n.inputs)


# --------------------------------------------------------------------------- parameter bytes


class TiedAndUnused(nn.Module):
    """Tied embedding/output weights, a get_attr parameter, a plain buffer, an unused layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight
        self.pos = nn.Parameter(torch.zeros(3, 6))
        self.register_buffer("scale", torch.full((1,), 2.0))
        self.unused = nn.Linear(6, 6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head((self.emb(ids) + self.pos) * self.scale)


@pytest.mark.parametrize("name", ZOO)
def test_parameter_bytes_add_up_exactly_for_zoo(name: str) -> None:
    b = tiny(name)
    cm = capture(b.model, b.example_inputs)
    expected = sum(p.numel() * p.element_size() for p in b.model.parameters()) + \
        sum(t.numel() * t.element_size() for t in b.model.buffers())
    assert cm.graph.parameter_bytes == expected == model_parameter_bytes(b.model)


def test_tied_weights_counted_once_and_recorded() -> None:
    model = TiedAndUnused()
    cm = capture(model, torch.randint(0, 10, (2, 3)))
    assert cm.graph.parameter_bytes == model_parameter_bytes(model) == (60 + 18 + 1 + 42) * 4
    [shared] = cm.shared_parameters
    assert set(shared.names) == {"emb.weight", "head.weight"}
    assert shared.nodes == ["emb", "head"] and shared.nbytes == 60 * 4
    assert cm.graph["head"].parameter_bytes == 0            # counted at the first reader, emb
    assert cm.unused_parameters == ["unused.weight", "unused.bias"]
    # emb: the tied weight plus the unused layer (held by the first non-input node)
    assert cm.graph["emb"].parameter_bytes == (60 + 42) * 4
    assert cm.node_parameters["emb"] == ["emb.weight", "unused.weight", "unused.bias"]
    # the get_attr reads are folded into their consumers
    assert cm.folded_attributes == {"pos": ["add"], "scale": ["mul"]}
    assert cm.graph["add"].parameter_bytes == 18 * 4 and cm.graph["mul"].parameter_bytes == 4


# --------------------------------------------------------------------------- activation bytes


def real_output_bytes(cm, inputs) -> dict[str, int]:
    seen: dict[str, int] = {}
    run_node_by_node(cm, *inputs, on_node=lambda name, v: seen.__setitem__(
        name, sum(t.numel() * t.element_size() for t in leaves(v))))
    return seen


@pytest.mark.parametrize("name", ["mlp", "resnet50", "gnmt", "gpt"])
def test_activation_bytes_equal_real_outputs(name: str) -> None:
    b = tiny(name)
    cm = capture(b.model, b.example_inputs)
    # 1) against forward hooks on the model's own leaf modules
    by_module: dict[str, list[int]] = defaultdict(list)
    handles = []
    for n in cm.graph:
        if n.kind == "module" and n.target not in by_module:
            mod = b.model.get_submodule(n.target)
            handles.append(mod.register_forward_hook(
                lambda _m, _i, out, key=n.target: by_module[key].append(
                    sum(t.numel() * t.element_size() for t in leaves(out)))))
            by_module[n.target] = []
    with torch.no_grad():
        b.model(*b.example_inputs)
    for h in handles:
        h.remove()
    calls: dict[str, int] = defaultdict(int)
    modules = [n for n in cm.graph if n.kind == "module"]
    assert modules
    for n in modules:
        assert n.activation_bytes == by_module[n.target][calls[n.target]] > 0, n.name
        calls[n.target] += 1
    # 2) against every node's real value in a node-by-node run
    real = real_output_bytes(cm, b.example_inputs)
    assert {n.name: n.activation_bytes for n in cm.graph} == real


def test_lstm_records_every_output_tensor() -> None:
    lstm = nn.Sequential(nn.LSTM(4, 5, batch_first=True))  # a leaf inside a container
    cm = capture(lstm, torch.randn(2, 3, 4))
    assert cm.method == "fx"
    node = next(n for n in cm.graph if n.kind == "module")
    assert [m.shape for m in node.outputs] == [(2, 3, 5), (1, 2, 5), (1, 2, 5)]
    assert node.activation_bytes == (30 + 10 + 10) * 4


def test_non_tensor_outputs_record_no_bytes() -> None:
    class Sizes(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.view(x.size(0), -1)

    cm = capture(Sizes(), torch.randn(2, 3, 4))
    size_node = next(n for n in cm.graph if n.op == "size")
    assert size_node.outputs == [] and size_node.activation_bytes == 0
    assert tensor_metas({"a": torch.zeros(2, dtype=torch.int64), "b": [3, torch.zeros(1)]})[0].nbytes == 16


# --------------------------------------------------------------------------- skip edges


def test_resnet_graph_has_skip_edges() -> None:
    torch.manual_seed(0)
    options = dict(TINY_OPTIONS["resnet50"], layers=(2, 1, 1, 1))  # one block without downsample
    b = get_model("resnet50", batch_size=2, **options)
    g = capture(b.model, b.example_inputs).graph
    adds = [n for n in g if n.op in ("add", "iadd") and len(n.inputs) == 2]
    assert len(adds) == 5  # one residual add per bottleneck block

    def origin(name: str, block: str) -> str:
        """Follow the skip operand back through the block's downsample branch."""
        while name.startswith(f"{block}_downsample"):
            name = g[name].inputs[0]
        return name

    direct = 0
    for add in adds:
        block = add.inputs[0].rsplit("_", 1)[0]  # layer1_0 from layer1_0_bn3
        first_conv = g.index(f"{block}_conv1")
        assert g.index(add.inputs[0]) > first_conv  # the residual branch
        skip = origin(add.inputs[1], block)
        assert g.index(skip) < first_conv, (add.name, skip)  # the skip edge jumps over the block
        direct += skip == add.inputs[1]
    assert direct == 1  # layer1_1 adds its input itself (identity shortcut)


# --------------------------------------------------------------------------- exact execution


@pytest.mark.parametrize("name", ["mlp", "resnet50", "gpt", "gnmt"])
def test_node_by_node_reproduces_output_exactly(name: str) -> None:
    b = tiny(name)
    b.model.eval()
    cm = capture(b.model, b.example_inputs)
    with torch.no_grad():
        assert outputs_equal(run_node_by_node(cm, *b.example_inputs), b.model(*b.example_inputs))
    # train mode, same random stream (dropout, if any, draws the same masks)
    b.model.train()
    cm = capture(b.model, b.example_inputs)
    torch.manual_seed(7)
    ref = b.model(*b.example_inputs)
    torch.manual_seed(7)
    assert outputs_equal(run_node_by_node(cm, *b.example_inputs), ref)


def test_fx_graph_runs_on_other_batch_sizes() -> None:
    b = tiny("gpt", batch_size=2)
    b.model.eval()
    cm = capture(b.model, b.example_inputs)
    bigger = b.make_batch(5, torch.Generator().manual_seed(1))[0]
    with torch.no_grad():
        assert outputs_equal(run_node_by_node(cm, *bigger), b.model(*bigger))


def test_hf_gpt2_from_config_is_captured_by_export() -> None:
    model = tiny_hf_gpt2().eval()
    ids = torch.randint(0, 100, (2, 8))
    cm = capture(model, ids)
    assert cm.method == "export"  # fx cannot trace the HF model
    assert cm.graph.parameter_bytes == model_parameter_bytes(model)
    # the tied input embedding / LM head is one tensor read by two nodes
    tied = [s for s in cm.shared_parameters if "lm_head.weight" in s.names]
    assert tied and len(tied[0].nodes) == 2 and tied[0].nbytes == 100 * 32 * 4
    assert {n.kind for n in cm.graph} == {"input", "function"}
    assert any(n.op == "aten.addmm.default" for n in cm.graph)
    with torch.no_grad():
        out = run_node_by_node(cm, ids)
        assert torch.equal(out.logits, model(ids).logits)
        # the batch dimension is dynamic: the same graph runs a different batch size
        ids5 = torch.randint(0, 100, (5, 8))
        assert torch.equal(run_node_by_node(cm, ids5).logits, model(ids5).logits)


def test_hf_gpt2_zoo_node_by_node_exact() -> None:
    pytest.importorskip("transformers")
    b = tiny("hf-gpt2")
    b.model.eval()
    cm = capture(b.model, b.example_inputs)
    with torch.no_grad():
        assert outputs_equal(run_node_by_node(cm, *b.example_inputs), b.model(*b.example_inputs))


def test_capture_leaves_buffers_and_rng_alone() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5))
    x = torch.randn(2, 3, 6, 6)
    before = [t.clone() for t in model.buffers()]
    rng = torch.get_rng_state()
    capture(model, x)
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))
    assert torch.equal(rng, torch.get_rng_state())


def test_inplace_and_functional_ops() -> None:
    class Inplace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.act(self.fc(x))
            y.add_(1.0)
            return F.relu(y, inplace=True) * 2

    model = Inplace()
    x = torch.randn(3, 4)
    cm = capture(model, x)
    assert [n.op for n in cm.graph][2:] == ["ReLU(inplace=True)", "add_", "relu", "mul"]
    assert torch.equal(run_node_by_node(cm, x), model(x))


# --------------------------------------------------------------------------- user errors


class BranchOnValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:
            return y
        return -y


class ItemDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        n = int((y > 0).sum().item())
        return y[:, :n]


def test_data_dependent_branch_is_a_capture_error_naming_the_line() -> None:
    with pytest.raises(CaptureError, match=r"cannot capture model BranchOnValue.*torch\.fx.*control flow") as e:
        capture(BranchOnValue(), torch.randn(3, 4))
    msg = str(e.value)
    assert "`if y.sum() > 0:`" in msg and "test_capture.py" in msg
    assert "torch.export" in msg and "nn.Sequential" in msg and ".item()" in msg
    assert "\n" not in msg and "Traceback" not in msg


def test_item_dependent_shape_is_a_capture_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(CaptureError, match=r"int\(\(y > 0\)\.sum\(\)\.item\(\)\)") as e:
        capture(ItemDependent(), torch.randn(3, 4))
    assert "\n" not in str(e.value)
    assert isinstance(e.value, PipetrainError)
    err = capsys.readouterr().err
    assert "def forward" not in err  # the tracers' partial graphs are not dumped on the user


def test_wrong_example_batch_names_shapes_and_first_error_line() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    with pytest.raises(CaptureError, match=r"raised on the example batch \(inputs: \[3, 5\] float32\): "
                                           r"RuntimeError: mat1 and mat2 shapes cannot be multiplied.*"
                                           r"check that the example batch"):
        capture(model, torch.randn(3, 5))


def test_not_a_module_is_a_capture_error() -> None:
    with pytest.raises(CaptureError, match="needs an nn.Module"):
        capture(lambda x: x, torch.randn(2))  # type: ignore[arg-type]
    with pytest.raises(CaptureError, match="example_inputs must be a Tensor or a tuple"):
        capture(nn.Linear(2, 2), {"x": torch.randn(2)})  # type: ignore[arg-type]
