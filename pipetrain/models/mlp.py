"""A deep multilayer perceptron: a flat ``nn.Sequential`` of Linear + ReLU blocks.

At the defaults this is the 16-layer MLP (Linear 1024x1024 + ReLU) of the pipeline
benchmarks; with batch size 64 it is ``get_model("mlp", batch_size=64)``.

Layout (``depth`` blocks; the first block reads ``in_features``)::

    Linear(in_features, width), ReLU, Linear(width, width), ReLU, ... [, Linear(width, num_classes)]

Without ``num_classes`` the last block's ``width`` outputs are the class scores, so the
default model is exactly ``depth`` Linear+ReLU blocks. With ``input_shape`` (e.g. ``(1, 28, 28)``
for Fashion-MNIST images) the model reads samples of that shape and starts with a ``Flatten``;
``in_features`` is then their product.
"""
from __future__ import annotations

import math
from typing import Any

from torch import nn

from .bundle import ClassificationBatches, ModelBundle, classification_loss, make_bundle
from .options import Options

NAME = "mlp"
DEFAULTS: dict[str, Any] = {
    "depth": 16,            # number of Linear+ReLU blocks
    "width": 1024,          # hidden features of every block
    "in_features": None,    # input features; None means width
    "num_classes": None,    # None: no head, the last block's width outputs are the classes
    "input_shape": None,    # per-sample input shape; None means (in_features,); more dims add a Flatten
}
DEFAULT_BATCH_SIZE = 64


def _resolve(options: dict[str, Any]) -> Options:
    opts = Options(NAME, options, DEFAULTS)
    opts.int("depth")
    opts.int("width")
    opts.int("in_features", allow_none=True)
    opts.int("num_classes", allow_none=True)
    shape = opts.values["input_shape"]
    if shape is not None:
        if not (isinstance(shape, (tuple, list)) and shape
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in shape)):
            raise opts.fail("input_shape", "None or a non-empty sequence of integers >= 1")
        opts.values["input_shape"] = tuple(shape)
        flat = math.prod(shape)
        if opts.values["in_features"] not in (None, flat):
            raise opts.fail("in_features", f"None or {flat}, the number of values of input_shape={tuple(shape)}")
        opts.values["in_features"] = flat
    return opts


def _input_shape(o: dict[str, Any]) -> tuple[int, ...]:
    return tuple(o["input_shape"]) if o["input_shape"] is not None else (o["in_features"] or o["width"],)


class MLP(nn.Sequential):
    """The layers in order (an ``nn.Sequential``), He-initialised."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """He initialisation (fan-in, ReLU gain; He et al. 2015), biases zero: PyTorch's default
        Linear init shrinks the signal by about sqrt(3) a layer, so a 16-deep MLP would not train from it."""
        for layer in self:
            if isinstance(layer, nn.Linear):
                nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
                nn.init.zeros_(layer.bias)


def _build(o: dict[str, Any]) -> MLP:
    in_features = o["in_features"] or o["width"]
    layers: list[nn.Module] = [nn.Flatten()] if len(_input_shape(o)) > 1 else []
    for i in range(o["depth"]):
        layers += [nn.Linear(in_features if i == 0 else o["width"], o["width"]), nn.ReLU()]
    if o["num_classes"] is not None:
        layers.append(nn.Linear(o["width"], o["num_classes"]))
    return MLP(*layers)


def build_model(**options: Any) -> MLP:
    """The MLP alone (no example batch), e.g. ``build_model(depth=4, width=32)``."""
    return _build(_resolve(options).values)


def build(batch_size: int | None = None, **options: Any) -> ModelBundle:
    """The MLP bundle: random ``(B, *input_shape)`` inputs, random class ids, cross entropy."""
    o = _resolve(options).values
    classes = o["num_classes"] or o["width"]
    return make_bundle(NAME, _build(o), classification_loss,
                       ClassificationBatches(_input_shape(o), classes),
                       batch_size, DEFAULT_BATCH_SIZE, o)
