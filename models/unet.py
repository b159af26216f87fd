"""U-Net (Ronneberger et al., 2015) with GroupNorm: a segmentation model with long skips.

``depth`` levels of two 3x3 convolutions each; the encoder halves the resolution between levels
(max pooling) and doubles the width, the decoder upsamples (bilinear), concatenates the encoder's
features of the same level (the long skip) and convolves. GroupNorm keeps every image independent
of the others in its batch, so pipelined training equals one process exactly (BatchNorm would
normalise per micro-batch). Not an ``nn.Sequential``: its skips cross any cut, and gems traces it
(``gems.graph``) into units named by module path, e.g. ``down.2`` or ``up.0``. Inputs whose sides
are not multiples of ``2 ** (depth - 1)`` work too (the upsampling takes the skip's size).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _block(cin: int, cout: int, groups: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(min(groups, cout), cout),
                         nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.GroupNorm(min(groups, cout), cout),
                         nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, num_classes: int = 2, in_channels: int = 3, width: int = 32, depth: int = 5,
                 groups: int = 8) -> None:
        super().__init__()
        widths = [width * 2 ** i for i in range(depth)]
        self.down = nn.ModuleList(_block(cin, cout, groups) for cin, cout in zip([in_channels] + widths, widths))
        self.up = nn.ModuleList(_block(widths[i + 1] + widths[i], widths[i], groups) for i in reversed(range(depth - 1)))
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, down in enumerate(self.down):
            x = down(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        for up, skip in zip(self.up, reversed(skips[:-1])):
            x = F.interpolate(x, size=skip.shape[2:], mode="bilinear", align_corners=False)
            x = up(torch.cat([x, skip], dim=1))
        return self.head(x)


def unet(num_classes: int = 2, in_channels: int = 3, width: int = 32, depth: int = 5, groups: int = 8) -> UNet:
    return UNet(num_classes, in_channels, width, depth, groups)
