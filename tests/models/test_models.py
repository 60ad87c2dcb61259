"""Tests of the model zoo: shapes, losses, synthetic data, fx traceability, sizes, errors."""
from __future__ import annotations

import math
import operator
import pickle
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from pipetrain.errors import ModelError, PipetrainError
from pipetrain.models import (
    EXTRA_MODEL_NAMES,
    MODEL_NAMES,
    TINY_OPTIONS,
    ModelBundle,
    build_model,
    default_batch_size,
    default_options,
    get_model,
    load_model,
    wrap_model,
)
from pipetrain.models.resnet import Bottleneck

torch.set_num_threads(1)
B = 3  # tiny batch


def tiny(name: str, batch_size: int = B, **extra: object) -> ModelBundle:
    torch.manual_seed(0)
    return get_model(name, batch_size=batch_size, **{**TINY_OPTIONS[name], **extra})


def expected_output_shape(name: str, batch: int) -> tuple[int, ...]:
    o = TINY_OPTIONS[name]
    if name == "mlp":
        return (batch, o["num_classes"])
    if name in ("alexnet", "vgg16", "resnet50"):
        return (batch, o["num_classes"])
    return (batch, o["seq_len"], o["vocab"])


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------
# Every built-in model at tiny size.


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_shape_loss_and_backward(name: str) -> None:
    bundle = tiny(name)
    assert bundle.name == name and bundle.batch_size == B
    out = bundle.model(*bundle.example_inputs)
    assert tuple(out.shape) == expected_output_shape(name, B)
    _, target = bundle.make_batch(B, torch.Generator().manual_seed(1))
    loss = bundle.loss_fn(out, target)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    for pname, p in bundle.model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    # Random labels over C classes: the initial loss is near log(C), not 0 or inf.
    classes = out.shape[-1]
    assert 0.5 * math.log(classes) < loss.item() < 2.0 * math.log(classes)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_make_batch_is_deterministic_and_matches_example(name: str) -> None:
    bundle = tiny(name)
    (x1, y1), (x2, y2) = (bundle.make_batch(5, torch.Generator().manual_seed(7)) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(x1, x2)) and torch.equal(y1, y2)
    x3, y3 = bundle.make_batch(5, torch.Generator().manual_seed(8))
    assert not all(torch.equal(a, b) for a, b in zip(x1, x3))
    assert len(x1) == len(bundle.example_inputs)
    for got, example in zip(x1, bundle.example_inputs):
        assert got.shape[0] == 5 and got.shape[1:] == example.shape[1:] and got.dtype == example.dtype
        assert got.is_contiguous()
    assert y1.shape[0] == 5
    # The targets fit the output: the loss accepts them.
    loss = bundle.loss_fn(bundle.model(*x1), y1)
    assert math.isfinite(loss.item())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_symbolic_trace_reproduces_output_exactly(name: str) -> None:
    bundle = tiny(name)
    traced = torch.fx.symbolic_trace(bundle.model)
    expected = bundle.model(*bundle.example_inputs)
    assert torch.equal(traced(*bundle.example_inputs), expected)
    # The graph is made of leaf-module calls and tensor ops: no Python control flow survived.
    kinds = {n.op for n in traced.graph.nodes}
    assert kinds <= {"placeholder", "call_module", "call_function", "call_method", "get_attr", "output"}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_construction_is_deterministic_given_manual_seed(name: str) -> None:
    a, b = tiny(name), tiny(name)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(torch.equal(x, y) for x, y in zip(a.example_inputs, b.example_inputs))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_bundle_parts_pickle(name: str) -> None:
    bundle = tiny(name)
    make_batch = pickle.loads(pickle.dumps(bundle.make_batch))
    loss_fn = pickle.loads(pickle.dumps(bundle.loss_fn))
    x1, y1 = bundle.make_batch(2, torch.Generator().manual_seed(3))
    x2, y2 = make_batch(2, torch.Generator().manual_seed(3))
    assert torch.equal(y1, y2) and all(torch.equal(a, b) for a, b in zip(x1, x2))
    out = bundle.model(*x1)
    assert torch.equal(loss_fn(out, y1), bundle.loss_fn(out, y1))


def test_default_batch_sizes_and_options_are_recorded() -> None:
    assert default_batch_size("mlp") == 64 and default_batch_size("gpt") == 16
    bundle = get_model("mlp", depth=2, width=8)
    assert bundle.batch_size == 64
    assert bundle.options == {"depth": 2, "width": 8, "in_features": None, "num_classes": None, "input_shape": None}
    assert default_options("gpt") == {"vocab": 8192, "d_model": 256, "layers": 8, "heads": 4, "seq_len": 128,
                                       "dropout": 0.0}


# ---------------------------------------------------------------------------------------
# Architectures at their published sizes (built on the meta device: no memory, no init time).


def test_published_parameter_counts_match_torchvision() -> None:
    with torch.device("meta"):
        assert n_params(build_model("resnet50")) == 25_557_032
        assert n_params(build_model("resnet50", norm="group")) == 25_557_032
        assert n_params(build_model("vgg16")) == 138_357_544
        assert n_params(build_model("alexnet")) == 61_100_840


def test_resnet50_has_16_bottlenecks_each_with_a_skip_addition() -> None:
    with torch.device("meta"):
        model = build_model("resnet50")
    blocks = [m for m in model.modules() if isinstance(m, Bottleneck)]
    assert len(blocks) == 16
    graph = torch.fx.symbolic_trace(model).graph
    adds = [n for n in graph.nodes if n.op == "call_function" and n.target is operator.add]
    assert len(adds) == 16
    # Each addition's operands are the main branch (bn3) and the identity/downsample branch.
    for add in adds:
        sources = {str(a.target) for a in add.args}
        assert any(s.endswith("bn3") for s in sources), sources


def test_resnet_norm_none_has_no_normalization_layers() -> None:
    model = build_model("resnet50", **{**TINY_OPTIONS["resnet50"], "norm": "none"})
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)) for m in model.modules())
    model = build_model("resnet50", **{**TINY_OPTIONS["resnet50"], "norm": "batch"})
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def test_mlp_default_is_16_linear_1024_relu_blocks() -> None:
    with torch.device("meta"):
        model = build_model("mlp")
    assert isinstance(model, nn.Sequential) and len(model) == 32
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert len(linears) == 16 and all(m.in_features == m.out_features == 1024 for m in linears)
    assert all(isinstance(m, nn.ReLU) for m in list(model)[1::2])


def test_gpt_default_is_the_benchmark_lm() -> None:
    with torch.device("meta"):
        model = build_model("gpt")
    assert len(model.blocks) == 8 and model.wte.embedding_dim == 256 and model.wpe.num_embeddings == 128
    assert model.lm_head.weight is not model.wte.weight


# ---------------------------------------------------------------------------------------
# Sequence models: causality and the use of every input.


def test_gpt_is_causal() -> None:
    bundle = tiny("gpt", batch_size=2)
    (tokens,) = bundle.example_inputs
    changed = tokens.clone()
    t = 9
    changed[:, t] = (changed[:, t] + 1) % TINY_OPTIONS["gpt"]["vocab"]
    with torch.no_grad():
        a, b = bundle.model(tokens), bundle.model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_gnmt_decoder_is_causal_and_attends_to_the_source() -> None:
    bundle = tiny("gnmt", batch_size=2)
    src, tgt = bundle.example_inputs
    vocab = TINY_OPTIONS["gnmt"]["vocab"]
    with torch.no_grad():
        base = bundle.model(src, tgt)
        tgt2 = tgt.clone()
        tgt2[:, 3] = (tgt2[:, 3] + 1) % vocab
        out_tgt = bundle.model(src, tgt2)
        src2 = src.clone()
        src2[:, -1] = (src2[:, -1] + 1) % vocab
        out_src = bundle.model(src2, tgt)
    assert torch.equal(base[:, :3], out_tgt[:, :3]) and not torch.allclose(base[:, 3:], out_tgt[:, 3:])
    # The last source token reaches the first target position (bidirectional encoder + attention).
    assert not torch.allclose(base[:, 0], out_src[:, 0])


@pytest.mark.parametrize("attention,bidirectional", [("dot", False), ("additive", True)])
def test_gnmt_variants_trace_exactly(attention: str, bidirectional: bool) -> None:
    bundle = tiny("gnmt", attention=attention, bidirectional=bidirectional, layers=4)
    traced = torch.fx.symbolic_trace(bundle.model)
    assert torch.equal(traced(*bundle.example_inputs), bundle.model(*bundle.example_inputs))
    lstms = [m for m in bundle.model.modules() if isinstance(m, nn.LSTM)]
    assert len(lstms) == 8 and lstms[0].bidirectional is bidirectional


def test_dropout_option_adds_dropout_and_zero_removes_it() -> None:
    assert not any(isinstance(m, nn.Dropout) for m in tiny("gpt").model.modules())
    assert any(isinstance(m, nn.Dropout) and m.p == 0.1 for m in tiny("gpt", dropout=0.1).model.modules())
    assert all(m.p == 0.5 for m in build_model("vgg16", width_mult=0.05).modules() if isinstance(m, nn.Dropout))


# ---------------------------------------------------------------------------------------
# Hugging Face GPT-2.


def test_hf_gpt2_builds_offline_untied_and_matches_gpt_size() -> None:
    pytest.importorskip("transformers")
    bundle = tiny("hf-gpt2", batch_size=2)
    lm = bundle.model.lm
    assert lm.config.use_cache is False and lm.config.tie_word_embeddings is False
    assert lm.lm_head.weight.data_ptr() != lm.transformer.wte.weight.data_ptr()
    out = bundle.model(*bundle.example_inputs)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == expected_output_shape("hf-gpt2", 2)
    _, target = bundle.make_batch(2, torch.Generator().manual_seed(0))
    loss = bundle.loss_fn(out, target)
    loss.backward()
    assert math.isfinite(loss.item())
    # Same options, same architecture size as the built-in gpt.
    assert n_params(bundle.model) == n_params(tiny("gpt").model)
    assert "hf-gpt2" in EXTRA_MODEL_NAMES


# ---------------------------------------------------------------------------------------
# User errors.


def test_unknown_model_name_lists_valid_names() -> None:
    with pytest.raises(ModelError, match=r"unknown model 'vgg'.*valid names: mlp, alexnet, vgg16, resnet50"):
        get_model("vgg")


@pytest.mark.parametrize("name,options,pattern", [
    ("mlp", {"depth": -1}, r"mlp option 'depth' must be an integer >= 1, got -1; valid mlp options.*width=1024"),
    ("mlp", {"detph": 2}, r"unknown mlp option 'detph' \(did you mean 'depth'\?\); valid mlp options"),
    ("mlp", {"width": 2.5}, r"'width' must be an integer >= 1, got 2.5"),
    ("vgg16", {"depth": 15}, r"'depth' must be one of \[11, 13, 16, 19\], got 15"),
    ("alexnet", {"image_size": 14}, r"'image_size' must be an integer >= 15, got 14"),
    ("vgg16", {"image_size": 7}, r"'image_size' must be an integer >= 8, got 7"),
    ("resnet50", {"in_channels": 0}, r"'in_channels' must be an integer >= 1, got 0"),
    ("mlp", {"input_shape": (1, 0)}, r"'input_shape' must be None or a non-empty sequence of integers >= 1"),
    ("mlp", {"input_shape": (1, 4, 4), "in_features": 15}, r"'in_features' must be None or 16, the number of "
                                                            r"values of input_shape=\(1, 4, 4\), got 15"),
    ("alexnet", {"width_mult": 0}, r"'width_mult' must be a number in \(0.0, inf\), got 0"),
    ("resnet50", {"norm": "layer"}, r"'norm' must be one of \['batch', 'group', 'none'\], got 'layer'"),
    ("resnet50", {"layers": (3, 4, 6)}, r"'layers' must be a sequence of 4 integers >= 1"),
    ("gnmt", {"layers": 1}, r"gnmt option 'layers' must be an integer >= 2, got 1"),
    ("gnmt", {"bidirectional": 1}, r"'bidirectional' must be True or False"),
    ("gpt", {"d_model": 30, "heads": 4}, r"gpt option 'd_model' must be a multiple of heads=4, got 30"),
    ("gpt", {"dropout": 1.0}, r"'dropout' must be a number in \[0.0, 1.0\), got 1.0"),
])
def test_invalid_options_state_rule_value_and_valid_options(name: str, options: dict, pattern: str) -> None:
    with pytest.raises(ModelError, match=pattern):
        get_model(name, **options)


def test_invalid_batch_size() -> None:
    with pytest.raises(ModelError, match=r"batch_size must be an integer >= 1, got 0"):
        get_model("mlp", batch_size=0, depth=1, width=4)
    with pytest.raises(ModelError, match=r"batch_size must be an integer >= 1, got -2"):
        tiny("mlp").make_batch(-2, torch.Generator())


def test_model_error_is_a_pipetrain_value_error() -> None:
    with pytest.raises(PipetrainError):
        get_model("nope")
    with pytest.raises(ValueError):
        get_model("mlp", depth=0)


# ---------------------------------------------------------------------------------------
# load_model with user factories.

FACTORIES = '''
import torch
from torch import nn
from pipetrain.models import ModelBundle, get_model

def pair(hidden=4):
    return nn.Sequential(nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, 2)), torch.randn(6, 3)

def with_batch(batch_size=6):
    return nn.Linear(3, 2), (torch.randn(batch_size, 3),)

class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)
    def forward(self, ids, scale):
        return self.norm(self.emb(ids).sum(1)) * scale

def tokens():
    return Embed(), (torch.tensor([[0, 9], [3, 4]]), torch.ones(2, 1))

def bundle():
    return get_model("mlp", batch_size=2, depth=1, width=4)

def wrong():
    return nn.Linear(3, 2)

def wrong_batch():
    return nn.Linear(3, 2), [1, 2]

def broken():
    return nn.Linear(3, 2), torch.randn(2, 5)

def raises():
    raise RuntimeError("no GPU here\\nsecond line")

not_a_function = 3
'''


@pytest.fixture(scope="module")
def factories(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("factories")
    Path(root, "zoo_test_factories.py").write_text(textwrap.dedent(FACTORIES))
    sys.path.insert(0, str(root))
    try:
        yield "zoo_test_factories"
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("zoo_test_factories", None)


def test_load_model_builtin_name() -> None:
    bundle = load_model("mlp", batch_size=2, depth=1, width=4)
    assert bundle.name == "mlp" and bundle.batch_size == 2


def test_load_model_wraps_model_and_batch(factories: str) -> None:
    bundle = load_model(f"{factories}:pair", hidden=5)
    assert bundle.batch_size == 6 and bundle.options == {"hidden": 5}
    assert bundle.model[0].out_features == 5
    out = bundle.model(*bundle.example_inputs)
    (x1,), y1 = bundle.make_batch(4, torch.Generator().manual_seed(0))
    (x2,), y2 = bundle.make_batch(4, torch.Generator().manual_seed(0))
    assert x1.shape == (4, 3) and y1.shape == (4, 2) and torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(bundle.loss_fn(out, out), torch.zeros(()))
    loss = bundle.loss_fn(bundle.model(x1), y1)
    loss.backward()
    assert math.isfinite(loss.item())


def test_load_model_batch_size(factories: str) -> None:
    # A factory with a batch_size parameter receives it.
    assert load_model(f"{factories}:with_batch", batch_size=4).example_inputs[0].shape == (4, 3)
    # Otherwise the example inputs are redrawn at the requested size.
    assert load_model(f"{factories}:pair", batch_size=3).example_inputs[0].shape == (3, 3)
    assert load_model(f"{factories}:bundle", batch_size=5).batch_size == 5


def test_load_model_integer_inputs_and_buffers(factories: str) -> None:
    bundle = load_model(f"{factories}:tokens")
    ids, scale = bundle.make_batch(200, torch.Generator().manual_seed(0))[0]
    assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) == 9   # [0, max + 1)
    assert scale.dtype == torch.float32 and scale.shape == (200, 1)
    # The probe run (in training mode) restored the batch-norm statistics it updated.
    assert bundle.model.training
    assert torch.equal(bundle.model.norm.running_mean, torch.zeros(4))
    assert int(bundle.model.norm.num_batches_tracked) == 0


def test_load_model_accepts_a_bundle(factories: str) -> None:
    bundle = load_model(f"{factories}:bundle")
    assert bundle.name == "mlp" and bundle.batch_size == 2


@pytest.mark.parametrize("spec,options,pattern", [
    ("no_such_pkg.models:make", {}, r"cannot import module 'no_such_pkg.models'.*ModuleNotFoundError.*PYTHONPATH"),
    ("{m}:missing", {}, r"module '{m}' has no attribute 'missing'.*its functions: .*pair"),
    ("{m}:not_a_function", {}, r"has a non-callable int 'not_a_function'"),
    ("{m}:wrong", {}, r"must return \(nn.Module, example_batch\) or a ModelBundle, got Linear"),
    ("{m}:wrong_batch", {}, r"example_batch a tensor or a tuple of tensors, got example_batch list\(int, int\)"),
    ("{m}:broken", {}, r"fails on its own example batch \(input shapes \[2, 5\] float32\): RuntimeError: .*"
                       r"check that the example batch has the shape"),
    ("{m}:raises", {}, r"model factory '{m}:raises' raised RuntimeError: no GPU here; fix the factory"),
    ("{m}:pair", {"width": 3}, r"takes no option 'width'; its parameters: hidden"),
    ("{m}:a:b", {}, r"model spec '{m}:a:b' must be a built-in model name or 'package.module:function'"),
    (":pair", {}, r"must be a built-in model name or 'package.module:function'"),
])
def test_load_model_errors(factories: str, spec: str, options: dict, pattern: str) -> None:
    with pytest.raises(ModelError, match=pattern.replace("{m}", factories)) as info:
        load_model(spec.replace("{m}", factories), **options)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------
# Input and output sizes for real data; model outputs as they come.


@pytest.mark.parametrize("name", ["alexnet", "vgg16", "resnet50"])
@pytest.mark.parametrize("size", [28, 15])
def test_image_models_build_and_run_on_small_grey_images(name: str, size: int) -> None:
    bundle = tiny(name, image_size=size, in_channels=1, num_classes=10)
    assert bundle.example_inputs[0].shape == (B, 1, size, size)
    out = bundle.model(*bundle.example_inputs)
    assert out.shape == (B, 10) and torch.isfinite(out).all()
    traced = torch.fx.symbolic_trace(bundle.model)
    assert torch.equal(traced(*bundle.example_inputs), out)


def test_small_image_adaptations_change_only_the_first_layer() -> None:
    with torch.device("meta"):
        small = build_model("alexnet", image_size=28, in_channels=1, num_classes=1000)
        full = build_model("alexnet")
        vgg_small, vgg_full = build_model("vgg16", image_size=28), build_model("vgg16")
        res_grey, res_full = build_model("resnet50", in_channels=1), build_model("resnet50")
    assert small.features[0].kernel_size == (3, 3) and small.features[0].stride == (1, 1)
    assert full.features[0].kernel_size == (11, 11) and full.features[0].stride == (4, 4)
    # AlexNet: only the stem's weights differ (3x3x1 instead of 11x11x3 per filter).
    assert n_params(full) - n_params(small) == 64 * (11 * 11 * 3 - 3 * 3 * 1)
    # VGG: rounding-up pools add no parameter; torchvision's floor pools at 224.
    assert n_params(vgg_small) == n_params(vgg_full) == 138_357_544
    assert all(m.ceil_mode for m in vgg_small.modules() if isinstance(m, nn.MaxPool2d))
    assert not any(m.ceil_mode for m in vgg_full.modules() if isinstance(m, nn.MaxPool2d))
    assert n_params(res_full) - n_params(res_grey) == 64 * 7 * 7 * 2


def test_mlp_reads_images_through_a_flatten() -> None:
    bundle = tiny("mlp", input_shape=(1, 28, 28), in_features=None, num_classes=10)
    assert isinstance(bundle.model[0], nn.Flatten) and bundle.model[1].in_features == 784
    assert bundle.options["in_features"] == 784 and bundle.example_inputs[0].shape == (B, 1, 28, 28)
    assert bundle.model(*bundle.example_inputs).shape == (B, 10)
    flat = tiny("mlp", input_shape=(64,), in_features=None, num_classes=10)
    assert isinstance(flat.model[0], nn.Linear) and flat.model[0].in_features == 64


def test_zoo_losses_are_stand_ins_and_user_bundles_own_theirs(factories: str) -> None:
    assert tiny("mlp").default_loss
    assert load_model(f"{factories}:pair").default_loss
    assert not ModelBundle(nn.Linear(2, 2), (torch.zeros(1, 2),), lambda o, t: o.sum(), lambda b, g: ((), None),
                           "mine").default_loss


def test_hugging_face_model_as_it_comes_wraps_and_its_loss_reads_logits() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2, use_cache=False)
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 32, (2, 8))
    bundle = wrap_model(lm, ids, "hf-raw")
    output = bundle.model(*bundle.example_inputs)
    assert not isinstance(output, torch.Tensor)          # a ModelOutput, not wrapped
    (x,), y = bundle.make_batch(2, torch.Generator().manual_seed(0))
    assert y.shape == (2, 8, 32)                          # the random target follows the logits
    loss = bundle.loss_fn(bundle.model(x), y)
    assert loss.dim() == 0 and math.isfinite(loss.item())
