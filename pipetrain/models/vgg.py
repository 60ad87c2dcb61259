"""VGG-11/13/16/19 (configurations A, B, D, E), layer for layer as torchvision's ``vgg16``.

At the defaults (depth 16, 1000 classes) the model has torchvision's 138,357,544 parameters.
ReLUs are not in place and each is its own module (no parameter changes). ``width_mult``
scales every channel count and the classifier's 4096 hidden units::

    features:   [Conv 3x3 + ReLU] x n per block, MaxPool 2/2 after each of 5 blocks
    avgpool:    AdaptiveAvgPool2d(7, 7)
    classifier: Linear(512*49, 4096) - ReLU - Dropout - Linear(4096, 4096) - ReLU - Dropout -
                Linear(4096, num_classes)

Small images (``image_size`` below 32, e.g. Fashion-MNIST's 28): the max pools round up
(``ceil_mode=True``: 28 -> 14 -> 7 -> 4 -> 2 -> 1) instead of down, so no map shrinks to
nothing; ``AdaptiveAvgPool2d`` spreads the last map to 7x7 as torchvision does for any size.
``in_channels`` (1 for grey images) sets the first convolution's input channels. Neither
changes a parameter beyond the first convolution's input channels.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .bundle import ClassificationBatches, ModelBundle, classification_loss, make_bundle
from .options import Options, scaled

NAME = "vgg16"
# Convolution widths per configuration; "M" is a 2x2 max pool (Simonyan & Zisserman, Table 1).
CONFIGS: dict[int, list[int | str]] = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    13: [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
         512, 512, 512, 512, "M"],
}
DEFAULTS: dict[str, Any] = {
    "depth": 16,           # 11, 13, 16 or 19 weight layers
    "image_size": 224,     # input height = width, pixels (>= 8; below 32 the max pools round up)
    "in_channels": 3,      # input channels (1 for grey images)
    "num_classes": 1000,
    "width_mult": 1.0,     # scales every channel count and the 4096-wide classifier
    "dropout": 0.5,        # torchvision's; use 0.0 for runs compared against a reference
}
DEFAULT_BATCH_SIZE = 64
MIN_IMAGE_SIZE = 32        # smallest input for five 2x2 max pools rounding down (torchvision's)
MIN_SMALL_IMAGE_SIZE = 8   # with the pools rounding up


class VGG(nn.Module):
    """torchvision's VGG (without batch norm) with a channel multiplier."""

    def __init__(self, config: Sequence[int | str], num_classes: int = 1000, width_mult: float = 1.0,
                 dropout: float = 0.5, in_channels: int = 3, ceil_pools: bool = False) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for v in config:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2, ceil_mode=ceil_pools))
            else:
                out = scaled(int(v), width_mult)
                layers += [nn.Conv2d(channels, out, kernel_size=3, padding=1), nn.ReLU()]
                channels = out
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        hidden = scaled(4096, width_mult)
        self.classifier = nn.Sequential(
            nn.Linear(channels * 7 * 7, hidden), nn.ReLU(), nn.Dropout(p=dropout),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(p=dropout),
            nn.Linear(hidden, num_classes),
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torchvision's initialisation: convolutions He (fan-out), linear layers N(0, 0.01), biases zero."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def _resolve(options: dict[str, Any]) -> Options:
    opts = Options(NAME, options, DEFAULTS)
    opts.choice("depth", sorted(CONFIGS))
    opts.int("image_size", minimum=MIN_SMALL_IMAGE_SIZE)
    opts.int("in_channels")
    opts.int("num_classes")
    opts.float("width_mult", 0.0, low_inclusive=False)
    opts.float("dropout", 0.0, 1.0)
    return opts


def _build(o: dict[str, Any]) -> VGG:
    return VGG(CONFIGS[o["depth"]], o["num_classes"], o["width_mult"], o["dropout"], o["in_channels"],
               ceil_pools=o["image_size"] < MIN_IMAGE_SIZE)


def build_model(**options: Any) -> VGG:
    """The VGG module alone (``image_size`` below 32 makes the max pools round up)."""
    return _build(_resolve(options).values)


def build(batch_size: int | None = None, **options: Any) -> ModelBundle:
    """VGG on random ``(B, in_channels, image_size, image_size)`` images with random labels."""
    o = _resolve(options).values
    s = o["image_size"]
    return make_bundle(NAME, _build(o), classification_loss,
                       ClassificationBatches((o["in_channels"], s, s), o["num_classes"]),
                       batch_size, DEFAULT_BATCH_SIZE, o)
