"""AlexNet, layer for layer as torchvision's ``alexnet`` (61,100,840 parameters at defaults).

Differences from torchvision that change no parameter and no result: ReLUs are not in place
(a pipeline stage may still need a tensor another stage's ReLU would overwrite) and every
ReLU/Dropout is its own module. ``width_mult`` scales every channel count and the classifier's
hidden width, so tests can run a tiny AlexNet::

    features:   Conv 11x11/4 (64) - MaxPool 3/2 - Conv 5x5 (192) - MaxPool 3/2 -
                Conv 3x3 (384) - Conv 3x3 (256) - Conv 3x3 (256) - MaxPool 3/2
    avgpool:    AdaptiveAvgPool2d(6, 6)
    classifier: Dropout - Linear(256*36, 4096) - ReLU - Dropout - Linear(4096, 4096) - ReLU -
                Linear(4096, num_classes)

Small images (``image_size`` below 63, e.g. Fashion-MNIST's 28): the first convolution becomes
3x3 with stride 1 and padding 1 (the usual CIFAR-sized AlexNet), so the three max pools still
have a 3x3 map to pool (28 -> 28 -> 13 -> 13 -> 6 -> 6 -> 2) and ``AdaptiveAvgPool2d`` spreads
the last map to 6x6; every other layer and the classifier are unchanged. ``in_channels``
(1 for grey images) sets the first convolution's input channels. At the defaults (224 pixels,
3 channels) the model is torchvision's, parameter for parameter.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .bundle import ClassificationBatches, ModelBundle, classification_loss, make_bundle
from .options import Options, scaled

NAME = "alexnet"
DEFAULTS: dict[str, Any] = {
    "image_size": 224,     # input height = width, pixels (>= 15; below 63 a 3x3/1 first convolution)
    "in_channels": 3,      # input channels (1 for grey images)
    "num_classes": 1000,
    "width_mult": 1.0,     # scales every channel count and the 4096-wide classifier
    "dropout": 0.5,        # torchvision's; use 0.0 for runs compared against a reference
}
DEFAULT_BATCH_SIZE = 128
MIN_IMAGE_SIZE = 63  # smallest input whose third max pool still sees a 3x3 map after the 11x11/4 stem
MIN_SMALL_IMAGE_SIZE = 15  # the same with the 3x3/1 stem of small images


class AlexNet(nn.Module):
    """torchvision's AlexNet with a channel multiplier."""

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.5,
                 in_channels: int = 3, small_stem: bool = False) -> None:
        super().__init__()
        c1, c2, c3, c4, c5 = (scaled(c, width_mult) for c in (64, 192, 384, 256, 256))
        hidden = scaled(4096, width_mult)
        stem = (nn.Conv2d(in_channels, c1, kernel_size=3, stride=1, padding=1) if small_stem
                else nn.Conv2d(in_channels, c1, kernel_size=11, stride=4, padding=2))
        self.features = nn.Sequential(
            stem, nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c1, c2, kernel_size=5, padding=2), nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c2, c3, kernel_size=3, padding=1), nn.ReLU(),
            nn.Conv2d(c3, c4, kernel_size=3, padding=1), nn.ReLU(),
            nn.Conv2d(c4, c5, kernel_size=3, padding=1), nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), nn.Linear(c5 * 6 * 6, hidden), nn.ReLU(),
            nn.Dropout(p=dropout), nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def _resolve(options: dict[str, Any]) -> Options:
    opts = Options(NAME, options, DEFAULTS)
    opts.int("image_size", minimum=MIN_SMALL_IMAGE_SIZE)
    opts.int("in_channels")
    opts.int("num_classes")
    opts.float("width_mult", 0.0, low_inclusive=False)
    opts.float("dropout", 0.0, 1.0)
    return opts


def _build(o: dict[str, Any]) -> AlexNet:
    return AlexNet(o["num_classes"], o["width_mult"], o["dropout"], o["in_channels"],
                   small_stem=o["image_size"] < MIN_IMAGE_SIZE)


def build_model(**options: Any) -> AlexNet:
    """The AlexNet module alone (``image_size`` picks the stem: 3x3/1 below 63 pixels)."""
    return _build(_resolve(options).values)


def build(batch_size: int | None = None, **options: Any) -> ModelBundle:
    """AlexNet on random ``(B, in_channels, image_size, image_size)`` images with random labels."""
    o = _resolve(options).values
    s = o["image_size"]
    return make_bundle(NAME, _build(o), classification_loss,
                       ClassificationBatches((o["in_channels"], s, s), o["num_classes"]), batch_size,
                       DEFAULT_BATCH_SIZE, o)
