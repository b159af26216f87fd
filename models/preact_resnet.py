"""Pre-activation ResNet (He et al. 2016, "Identity Mappings in Deep Residual Networks").

The bottleneck form of ResNet-164 / ResNet-1001: depth = 9n + 2, three groups of n blocks
with bottleneck widths 16, 32, 64 (times ``width``) and outputs 4x that, stride 2 entering
groups 2 and 3. Every block computes BN-ReLU before each conv and adds an untouched
identity, which is what lets 1000+ layers train. Units::

    stem (3x3 conv) | group1_block1 | ... | group3_block{n} | head (BN, ReLU, avgpool, fc)

The stem keeps full resolution (CIFAR-style): on large images this network holds big
activations in every unit, which is the case GEMS is built for.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from gems.errors import GemsError
from .checks import positive_int

EXPANSION = 4  # bottleneck output channels = EXPANSION x bottleneck width


class PreActBottleneck(nn.Module):
    """BN-ReLU-conv1x1, BN-ReLU-conv3x3(stride), BN-ReLU-conv1x1, plus the shortcut.

    The shortcut is the identity, or a strided 1x1 conv on the pre-activated input when the
    shape changes (the paper's choice: the projection also sees BN-ReLU).
    """

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * EXPANSION
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Not in place on x: x is the unit's input, which a pipeline stage may still hold.
        out = torch.relu(self.bn1(x))
        skip = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(self.relu(self.bn2(out)))
        out = self.conv3(self.relu(self.bn3(out)))
        return out + skip


def preact_resnet(depth: int = 110, num_classes: int = 1000, width: int = 1,
                  in_channels: int = 3) -> nn.Sequential:
    """Pre-activation bottleneck ResNet of ``depth`` = 9n + 2 layers (e.g. 110, 164, 1001).

    ``width`` multiplies every channel count (wide variant); ``in_channels`` is the number of
    image channels.
    """
    model = f"preact-resnet{depth}"
    positive_int(model, "num_classes", num_classes)
    positive_int(model, "width", width)
    positive_int(model, "in_channels", in_channels)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 11 or (depth - 2) % 9:
        raise GemsError(f"preact-resnet depth must be 9n + 2 with n >= 1 (11, 20, 29, ..., 110, 164, ..., 1001); "
                        f"got {depth!r}.")
    n = (depth - 2) // 9
    stem_channels = 16 * width
    units: OrderedDict[str, nn.Module] = OrderedDict()
    units["stem"] = nn.Conv2d(in_channels, stem_channels, 3, padding=1, bias=False)
    channels = stem_channels
    for g, group_width in enumerate((16 * width, 32 * width, 64 * width), start=1):
        for b in range(1, n + 1):
            stride = 2 if g > 1 and b == 1 else 1
            units[f"group{g}_block{b}"] = PreActBottleneck(channels, group_width, stride)
            channels = group_width * EXPANSION
    units["head"] = nn.Sequential(OrderedDict(
        bn=nn.BatchNorm2d(channels), relu=nn.ReLU(inplace=True), avgpool=nn.AdaptiveAvgPool2d(1),
        flatten=nn.Flatten(1), fc=nn.Linear(channels, num_classes)))
    _init(units.values())
    return nn.Sequential(units)


def _init(modules) -> None:
    # He initialisation for convs (as in the paper), BN to the identity.
    for unit in modules:
        for m in unit.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
