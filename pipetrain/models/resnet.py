"""ResNet-50 (v1.5, bottleneck blocks), layer for layer as torchvision's ``resnet50``.

At the defaults the model has torchvision's 25,557,032 parameters and 16 bottleneck blocks
(``layers=(3, 4, 6, 3)``). Every block keeps its skip connection, He et al. (2016) eq. (1):

    y = relu(F(x) + identity),   F = bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x))))))))

where ``identity`` is ``x`` or, when the shape changes, ``bn(conv1x1(x))``. The addition is
out of place and each ReLU is its own module, so the captured graph has an ``add`` node whose
two inputs may live on different pipeline stages (the runtime relays the skip tensor).

``norm`` picks the normalization: ``"batch"`` (torchvision), ``"group"`` (GroupNorm with
``gcd(32, channels)`` groups, same parameter count, independent of the microbatch split) or
``"none"`` (no normalization layer at all). ``in_channels`` (1 for grey images) sets the stem
convolution's input channels; small images need no change (28 pixels: 14 after the stem, 7
after the max pool, then 7, 4, 2, 1 through the four stages, averaged to 1x1).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from .bundle import ClassificationBatches, ModelBundle, classification_loss, make_bundle
from .options import Options

NAME = "resnet50"
DEFAULTS: dict[str, Any] = {
    "layers": (3, 4, 6, 3),  # bottleneck blocks in each of the four stages
    "width": 64,             # stem channels and first stage's bottleneck width (x2 per stage)
    "image_size": 224,       # input height = width, pixels
    "in_channels": 3,        # input channels (1 for grey images)
    "num_classes": 1000,
    "norm": "batch",         # "batch", "group" or "none"
}
DEFAULT_BATCH_SIZE = 64
NORMS = ("batch", "group", "none")


def norm_layer(kind: str, channels: int) -> nn.Module:
    """The normalization after a convolution: BatchNorm2d, GroupNorm or Identity."""
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(math.gcd(32, channels), channels)
    return nn.Identity()


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, v1.5), 1x1 expand by 4, plus the skip connection."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, norm: str = "batch") -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, kernel_size=1, bias=False)
        self.bn1 = norm_layer(norm, planes)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = norm_layer(norm, planes)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(planes, out, kernel_size=1, bias=False)
        self.bn3 = norm_layer(norm, out)
        self.relu3 = nn.ReLU()
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, out, kernel_size=1, stride=stride, bias=False), norm_layer(norm, out))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu1(self.bn1(self.conv1(x)))
        y = self.relu2(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu3(y + identity)


class ResNet(nn.Module):
    """torchvision's ResNet with bottleneck blocks, a base width and a choice of norm."""

    def __init__(self, layers: tuple[int, ...] = (3, 4, 6, 3), width: int = 64, num_classes: int = 1000,
                 norm: str = "batch", in_channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = norm_layer(norm, width)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        inplanes = width
        stages: list[nn.Module] = []
        for i, blocks in enumerate(layers):
            planes = width * 2 ** i
            stage = []
            for b in range(blocks):
                stage.append(Bottleneck(inplanes, planes, stride=2 if (i > 0 and b == 0) else 1, norm=norm))
                inplanes = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(inplanes, num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torchvision's initialisation: convolutions He (fan-out), norms one and zero."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _resolve(options: dict[str, Any]) -> Options:
    opts = Options(NAME, options, DEFAULTS)
    opts.int_tuple("layers", 4)
    opts.int("width")
    opts.int("image_size")
    opts.int("in_channels")
    opts.int("num_classes")
    opts.choice("norm", NORMS)
    return opts


def _build(o: dict[str, Any]) -> ResNet:
    return ResNet(o["layers"], o["width"], o["num_classes"], o["norm"], o["in_channels"])


def build_model(**options: Any) -> ResNet:
    """The ResNet module alone (``image_size`` only affects the example batch)."""
    return _build(_resolve(options).values)


def build(batch_size: int | None = None, **options: Any) -> ModelBundle:
    """ResNet on random ``(B, in_channels, image_size, image_size)`` images with random labels."""
    o = _resolve(options).values
    s = o["image_size"]
    return make_bundle(NAME, _build(o), classification_loss,
                       ClassificationBatches((o["in_channels"], s, s), o["num_classes"]),
                       batch_size, DEFAULT_BATCH_SIZE, o)
