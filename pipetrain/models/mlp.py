"""A deep multilayer perceptron: a flat ``nn.Sequential`` of Linear + ReLU blocks.

At the defaults this is the 16-layer MLP (Linear 1024x1024 + ReLU) of the pipeline
benchmarks; with batch size 64 it is ``get_model("mlp", batch_size=64)``.

Layout (``depth`` blocks; the first block reads ``in_features``)::

    Linear(in_features, width), ReLU, Linear(width, width), ReLU, ... [, Linear(width, num_classes)]

Without ``num_classes`` the last block's ``width`` outputs are the class scores, so the
default model is exactly ``depth`` Linear+ReLU blocks.
"""
from __future__ import annotations

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
}
DEFAULT_BATCH_SIZE = 64


def _resolve(options: dict[str, Any]) -> Options:
    opts = Options(NAME, options, DEFAULTS)
    opts.int("depth")
    opts.int("width")
    opts.int("in_features", allow_none=True)
    opts.int("num_classes", allow_none=True)
    return opts


def _build(o: dict[str, Any]) -> nn.Sequential:
    in_features = o["in_features"] or o["width"]
    layers: list[nn.Module] = []
    for i in range(o["depth"]):
        layers += [nn.Linear(in_features if i == 0 else o["width"], o["width"]), nn.ReLU()]
    if o["num_classes"] is not None:
        layers.append(nn.Linear(o["width"], o["num_classes"]))
    # He initialisation (fan-in, ReLU gain): PyTorch's default Linear init shrinks the signal
    # by about sqrt(3) a layer, so a 16-deep MLP would not train from it.
    for layer in layers:
        if isinstance(layer, nn.Linear):
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


def build_model(**options: Any) -> nn.Sequential:
    """The MLP alone (no example batch), e.g. ``build_model(depth=4, width=32)``."""
    return _build(_resolve(options).values)


def build(batch_size: int | None = None, **options: Any) -> ModelBundle:
    """The MLP bundle: random ``(B, in_features)`` inputs, random class ids, cross entropy."""
    o = _resolve(options).values
    classes = o["num_classes"] or o["width"]
    return make_bundle(NAME, _build(o), classification_loss,
                       ClassificationBatches((o["in_features"] or o["width"],), classes),
                       batch_size, DEFAULT_BATCH_SIZE, o)
