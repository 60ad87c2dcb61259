"""The loss follows the data; outputs as they come; metrics; models adapt to the data."""
from __future__ import annotations

import math
import pickle
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.data import (
    ArrayDataset,
    CrossEntropy,
    DataSource,
    MeanSquaredError,
    check_fits,
    correct_count,
    load_data,
    loss_for,
    loss_for_bundle,
    loss_sum,
    model_options_for,
    output_logits,
    token_loss_sum,
)
from pipetrain.data.text import load_text
from pipetrain.errors import DataError, ModelError
from pipetrain.models import TINY_OPTIONS, ModelBundle, get_model, wrap_model

torch.set_num_threads(1)


def images(n: int = 6, shape: tuple[int, ...] = (1, 28, 28), classes: int = 10) -> DataSource:
    """A Fashion-MNIST-shaped source made up on the spot."""
    g = torch.Generator().manual_seed(0)
    ds = ArrayDataset((torch.randn((n, *shape), generator=g),), torch.arange(n) % classes)
    return DataSource("images", ds, ds, "classification", shape, torch.float32, num_classes=classes)


def features(n: int = 6, width: int = 64, classes: int = 10) -> DataSource:
    ds = ArrayDataset((torch.rand(n, width),), torch.arange(n) % classes)
    return DataSource("features", ds, ds, "classification", (width,), torch.float32, num_classes=classes)


def text() -> DataSource:
    return load_text("tiny", "to be or not to be, that is the question. " * 20, seq_len=16)


# ---------------------------------------------------------------------------------------
# Loss selection


def test_loss_follows_target_dtype_and_bundle_loss_wins() -> None:
    assert isinstance(loss_for(torch.int64), CrossEntropy)
    assert isinstance(loss_for(torch.zeros(3, dtype=torch.int32)), CrossEntropy)
    assert isinstance(loss_for(torch.float32), MeanSquaredError)
    assert isinstance(loss_for(features()), CrossEntropy)
    own = lambda out, t: out.sum()  # noqa: E731
    assert loss_for(torch.int64, bundle_loss=own) is own
    with pytest.raises(DataError, match=r"targets of dtype torch.bool have no default loss"):
        loss_for(torch.bool)
    with pytest.raises(DataError, match=r"synthetic data has no target dtype"):
        loss_for(load_data("synthetic"))
    assert pickle.loads(pickle.dumps(CrossEntropy())) == CrossEntropy()


def test_loss_for_bundle_keeps_an_authors_loss_and_replaces_stand_ins() -> None:
    zoo = get_model("mlp", batch_size=2, depth=1, width=8, in_features=4)
    wrapped = wrap_model(nn.Linear(4, 1), torch.zeros(2, 4), "pair")
    own = lambda out, t: out.sum()  # noqa: E731
    authored = ModelBundle(nn.Linear(4, 3), (torch.zeros(2, 4),), own, zoo.make_batch, "mine")
    regression = DataSource("r", None, None, "regression", (4,), torch.float32, target_dtype=torch.float32)
    assert isinstance(loss_for_bundle(zoo, features(width=4)), CrossEntropy)
    assert isinstance(loss_for_bundle(wrapped, features(width=4)), CrossEntropy)
    assert isinstance(loss_for_bundle(zoo, regression), MeanSquaredError)
    assert loss_for_bundle(authored, features(width=4)) is own
    assert loss_for_bundle(zoo, load_data("synthetic")) is zoo.loss_fn


def test_cross_entropy_over_the_last_dimension_and_mse() -> None:
    g = torch.Generator().manual_seed(0)
    logits, tokens = torch.randn(2, 5, 7, generator=g), torch.randint(0, 7, (2, 5), generator=g)
    want = sum(F.cross_entropy(logits[b], tokens[b], reduction="sum") for b in range(2)) / 10
    assert torch.allclose(CrossEntropy()(logits, tokens), want, atol=1e-6)
    cls, y = torch.randn(4, 3, generator=g), torch.tensor([0, 2, 1, 2])
    assert torch.allclose(CrossEntropy()(cls, y), F.cross_entropy(cls, y))
    out, target = torch.randn(4, 1, generator=g), torch.randn(4, generator=g)
    assert torch.allclose(MeanSquaredError()(out, target), ((out[:, 0] - target) ** 2).mean())


# ---------------------------------------------------------------------------------------
# Outputs as they come


class WithLogits:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


def test_output_logits_forms() -> None:
    t = torch.randn(2, 3)
    assert output_logits(t) is t
    assert output_logits(WithLogits(t)) is t
    assert output_logits({"loss": torch.zeros(()), "logits": t}) is t
    assert output_logits((t, "cache")) is t and output_logits([(t,)]) is t
    with pytest.raises(ModelError, match=r"cannot find the logits in the model's output, a dict with keys \['h'\]"):
        output_logits({"h": t})
    with pytest.raises(ModelError, match=r"a str; return a tensor, an object with .logits"):
        output_logits("logits")


def test_hugging_face_model_output_gives_logits_and_trains() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=30, n_positions=16, n_embd=16, n_layer=1, n_head=2, use_cache=False,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(config)        # returned as it is: forward gives a ModelOutput
    ids = torch.randint(0, 30, (3, 16))
    out = lm(input_ids=ids)
    assert isinstance(out, transformers.utils.ModelOutput) and isinstance(out, OrderedDict)
    assert output_logits(out) is out.logits and out.logits.shape == (3, 16, 30)
    target = torch.roll(ids, -1, 1)
    loss = CrossEntropy()(out, target)
    assert torch.allclose(loss, F.cross_entropy(out.logits.reshape(-1, 30), target.reshape(-1)))
    loss.backward()
    assert lm.transformer.wte.weight.grad is not None
    total, count = token_loss_sum(out, target)
    assert count == 48 and total / count == pytest.approx(loss.item(), rel=1e-5)


# ---------------------------------------------------------------------------------------
# Metrics


def test_metrics_sum_exactly_over_batches() -> None:
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0], [0.0, 0.5]])
    target = torch.tensor([0, 0, 0, 1])
    assert correct_count(logits, target) == 3 and correct_count(logits, target, count=2) == 1
    total, n = loss_sum(logits, target)
    assert n == 4 and total == pytest.approx(F.cross_entropy(logits, target, reduction="sum").item())
    halves = [loss_sum(logits[:2], target[:2]), loss_sum(logits[2:], target[2:])]
    assert sum(t for t, _ in halves) == pytest.approx(total, rel=1e-12) and sum(k for _, k in halves) == 4
    assert loss_sum(torch.ones(3, 1), torch.zeros(3)) == (3.0, 3)        # squared errors of float targets
    g = torch.Generator().manual_seed(0)
    token_logits, tokens = torch.randn(2, 5, 7, generator=g), torch.randint(0, 7, (2, 5), generator=g)
    s1, c1 = token_loss_sum(token_logits, tokens, count=1)                # padding rows count nowhere
    assert c1 == 5 and s1 == pytest.approx(F.cross_entropy(token_logits[0], tokens[0], reduction="sum").item())
    assert correct_count(token_logits, tokens) == int((token_logits.argmax(-1) == tokens).sum())
    assert math.exp(token_loss_sum(token_logits, tokens)[0] / 10) == pytest.approx(
        math.exp(CrossEntropy()(token_logits, tokens).item()), rel=1e-6)


# ---------------------------------------------------------------------------------------
# Models adapt to the data


def test_mlp_on_digits_gets_64_inputs_and_10_classes() -> None:
    src = features()
    opts = model_options_for("mlp", src)
    assert opts == {"in_features": 64, "num_classes": 10}
    bundle = get_model("mlp", batch_size=2, depth=2, width=16, **opts)
    check_fits(bundle, src)
    assert bundle.model(*src.train.take(torch.arange(3))[0]).shape == (3, 10)


@pytest.mark.parametrize("name", ["alexnet", "vgg16", "resnet50", "mlp"])
def test_image_models_on_fashion_mnist_shaped_data(name: str) -> None:
    src = images()
    opts = model_options_for(name, src)
    if name == "mlp":
        assert opts == {"in_features": 784, "input_shape": (1, 28, 28), "num_classes": 10}
        tiny = {"depth": 2, "width": 16}
    else:
        assert opts == {"in_channels": 1, "image_size": 28, "num_classes": 10}
        tiny = {k: v for k, v in TINY_OPTIONS[name].items() if k not in opts}
    torch.manual_seed(0)
    bundle = get_model(name, batch_size=2, **tiny, **opts)
    check_fits(bundle, src)
    (x,), y = src.train.take(torch.arange(4))
    out = bundle.model(x)
    assert out.shape == (4, 10)
    assert math.isfinite(loss_for_bundle(bundle, src)(out, y).item())


@pytest.mark.parametrize("name", ["gpt", "hf-gpt2"])
def test_language_models_on_char_text(name: str) -> None:
    if name == "hf-gpt2":
        pytest.importorskip("transformers")
    src = text()
    opts = model_options_for(name, src)
    assert opts == {"seq_len": 16, "vocab": src.vocab_size}
    torch.manual_seed(0)
    bundle = get_model(name, batch_size=2, d_model=16, layers=1, heads=2, **opts)
    check_fits(bundle, src)
    (x,), y = src.train.take(torch.arange(2))
    assert bundle.model(x).shape == (2, 16, src.vocab_size)


@pytest.mark.parametrize("name,source,pattern", [
    ("resnet50", features, r"model 'resnet50' reads square images \[channels, size, size\], but data 'features' "
                           r"gives samples \[64\]; use --model mlp"),
    ("gpt", features, r"model 'gpt' reads token sequences \[seq_len\].*data 'features' gives classification "
                      r"samples \[64\]"),
    ("mlp", text, r"model 'mlp' reads one input of numbers, but data 'tiny' gives language samples \[16\]"),
    ("gnmt", text, r"model 'gnmt' reads \(source, target\) token pairs"),
])
def test_models_that_cannot_read_the_data(name: str, source: object, pattern: str) -> None:
    with pytest.raises(DataError, match=pattern):
        model_options_for(name, source())  # type: ignore[operator]


def test_check_fits_names_both_shapes() -> None:
    src = features(width=64)
    user = wrap_model(nn.Linear(32, 10), torch.zeros(2, 32), "mine:model")
    with pytest.raises(DataError, match=r"samples of data 'features' do not fit model 'mine:model': the model reads "
                                        r"inputs \[32\] float32 per sample, the data gives \[64\] float32"):
        check_fits(user, src)
    few = get_model("mlp", batch_size=2, depth=1, width=8, in_features=64, num_classes=4)
    with pytest.raises(DataError, match=r"model 'mlp' predicts 4 classes but data 'features' has 10; build it with "
                                        r"num_classes=10"):
        check_fits(few, src)
    src_tokens = text()
    gpt = get_model("gpt", batch_size=2, d_model=16, layers=1, heads=2, seq_len=16, vocab=8)
    with pytest.raises(DataError, match=r"model 'gpt' fails on samples of data 'tiny' .*IndexError"):
        check_fits(gpt, src_tokens)
    assert model_options_for("mlp", load_data("synthetic")) == {} and model_options_for("pkg:fn", src) == {}
