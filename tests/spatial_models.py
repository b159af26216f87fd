"""Small models for the spatial tests: every layer kind the tiles split, at sides that are not
powers of two (shared by tests/test_spatial.py and the engine's spatial equivalence tests)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A residual block; ``down``: 3x3 stride-2 and a 1x1 stride-2 shortcut."""

    def __init__(self, c: int, down: bool = False, norm=lambda c: nn.GroupNorm(2, c)) -> None:
        super().__init__()
        out = 2 * c if down else c
        self.c1, self.n1 = nn.Conv2d(c, out, 3, 2 if down else 1, 1), norm(out)
        self.c2, self.n2 = nn.Conv2d(out, out, 3, 1, 1), norm(out)
        self.skip = nn.Conv2d(c, out, 1, 2) if down else nn.Identity()

    def forward(self, x):
        return F.relu(self.n2(self.c2(F.relu(self.n1(self.c1(x))))) + self.skip(x))


class GroupNormNet(nn.Module):
    """5x5 stride-2 stem, max pooling, residual blocks with stride-2 downsampling (GroupNorm), a
    classifier head that pools the whole image."""

    def __init__(self, classes: int = 5, norm=lambda c: nn.GroupNorm(2, c)) -> None:
        super().__init__()
        self.stem, self.gn = nn.Conv2d(3, 8, 5, 2, 2), norm(8)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.b1, self.b2 = Block(8, norm=norm), Block(8, down=True, norm=norm)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        x = self.b2(self.b1(self.pool(F.relu(self.gn(self.stem(x))))))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def BatchNormNet(classes: int = 5) -> GroupNormNet:   # noqa: N802 - a model class's name
    """GroupNormNet with BatchNorm layers (batch statistics: not batch-independent)."""
    return GroupNormNet(classes, norm=nn.BatchNorm2d)


class Everything(nn.Module):
    """Every tiled layer kind at once: BatchNorm, a transposed convolution, bilinear resizing to a
    skip's size, average pooling without the padding's count, padding, nearest resizing, a
    channel concatenation and a squeeze-excitation scale (a replicated (N, C, 1, 1) value)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.gn = nn.Conv2d(3, 8, 5, 2, 2), nn.GroupNorm(2, 8)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.b1, self.b2, self.bn = Block(8), Block(8, down=True), nn.BatchNorm2d(16)
        self.up = nn.ConvTranspose2d(16, 8, 3, 2, 1, output_padding=1)
        self.avg = nn.AvgPool2d(3, 1, 1, count_include_pad=False)
        self.squeeze = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        x = self.pool(F.relu(self.gn(self.stem(x))))
        y = self.up(self.bn(self.b2(self.b1(x))))
        z = F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False) + x
        z = self.avg(z)
        z = z * torch.sigmoid(self.squeeze(F.adaptive_avg_pool2d(z, 1)))
        z = F.pad(z, (1, 2, 0, 1))
        big = F.interpolate(z, scale_factor=2, mode="nearest")
        return torch.cat([z, big[:, :, 1:z.shape[2] + 1, 2:z.shape[3] + 2]], 1)
