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
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .bundle import ClassificationBatches, ModelBundle, classification_loss, make_bundle
from .options import Options, scaled

NAME = "alexnet"
DEFAULTS: dict[str, Any] = {
    "image_size": 224,     # input height = width, pixels (>= 63 so the last max pool has input)
    "num_classes": 1000,
    "width_mult": 1.0,     # scales every channel count and the 4096-wide classifier
    "dropout": 0.5,        # torchvision's; use 0.0 for runs compared against a reference
}
DEFAULT_BATCH_SIZE = 128
MIN_IMAGE_SIZE = 63  # smallest input whose third max pool still sees a 3x3 map


class AlexNet(nn.Module):
    """torchvision's AlexNet with a channel multiplier."""

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.5) -> None:
        super().__init__()
        c1, c2, c3, c4, c5 = (scaled(c, width_mult) for c in (64, 192, 384, 256, 256))
        hidden = scaled(4096, width_mult)
        self.features = nn.Sequential(
            nn.Conv2d(3, c1, kernel_size=11, stride=4, padding=2), nn.ReLU(),
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
    opts.int("image_size", minimum=MIN_IMAGE_SIZE)
    opts.int("num_classes")
    opts.float("width_mult", 0.0, low_inclusive=False)
    opts.float("dropout", 0.0, 1.0)
    return opts


def build_model(**options: Any) -> AlexNet:
    """The AlexNet module alone (``image_size`` only affects the example batch)."""
    o = _resolve(options).values
    return AlexNet(o["num_classes"], o["width_mult"], o["dropout"])


def build(batch_size: int | None = None, **options: Any) -> ModelBundle:
    """AlexNet on random ``(B, 3, image_size, image_size)`` images with random labels."""
    o = _resolve(options).values
    s = o["image_size"]
    return make_bundle(NAME, AlexNet(o["num_classes"], o["width_mult"], o["dropout"]), classification_loss,
                       ClassificationBatches((3, s, s), o["num_classes"]), batch_size, DEFAULT_BATCH_SIZE, o)
