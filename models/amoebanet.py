"""AmoebaNet-D (Real et al. 2019) at the sizes GPipe trains: AmoebaNet-D(L, F).

A cell reads the outputs of the two cells before it, so the boundary between two cells is
the pair ``(prev, cur)``; every cell returns ``(cur, new)`` for the next one. Units::

    stem (3x3 conv s2, BN)                    -> tensor, F/4 channels
    stem_reduce1, stem_reduce2               reduction cells, branch width F/4, F/2
    normal1 .. normal{L/3}                   width F
    reduce1, normal .. normal                width 2F   (spatial / 2)
    reduce2, normal .. normal                width 4F   (spatial / 2)
    head (ReLU, global avg pool, fc)         reads the last tensor of the pair

The first cell takes the stem's single tensor as both inputs. Inside a cell, two 1x1
"preprocessing" convs bring prev and cur to the branch width; when prev is twice cur's
size (the cell before was a reduction) prev goes through a factorized reduce instead.
Then five steps each add two operations applied to earlier states; the cell concatenates
the states its genotype names.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gems.errors import GemsError
from .checks import positive_int


@dataclass(frozen=True)
class Genotype:
    """One cell type: ``ops[2k]`` and ``ops[2k+1]`` (input state, operation) make state k+2."""

    ops: tuple[tuple[int, str], ...]
    concat: tuple[int, ...]


# AmoebaNet-D (Real et al. 2019, fig. 8 / the TPU reference model that GPipe trained). The
# normal concat follows the reference implementation, whose parameter counts GPipe reports.
NORMAL = Genotype(
    ops=((1, "conv_1x1"), (1, "max_pool_3x3"),
         (1, "none"), (0, "conv_1x7_7x1"),
         (0, "conv_1x1"), (0, "conv_1x7_7x1"),
         (2, "max_pool_3x3"), (2, "none"),
         (1, "avg_pool_3x3"), (5, "conv_1x1")),
    concat=(0, 3, 4, 6),
)
REDUCTION = Genotype(
    ops=((0, "max_pool_2x2"), (0, "max_pool_3x3"),
         (2, "none"), (1, "conv_3x3"),
         (2, "conv_1x7_7x1"), (2, "max_pool_3x3"),
         (3, "none"), (1, "max_pool_2x2"),
         (2, "avg_pool_3x3"), (3, "conv_1x1")),
    concat=(4, 5, 6),
)


def relu_conv_bn(c_in: int, c_out: int, kernel: int | tuple[int, int] = 1,
                 stride: int | tuple[int, int] = 1, padding: int | tuple[int, int] = 0) -> nn.Sequential:
    """The cells' basic conv: ReLU first, so a state can be summed before activation."""
    return nn.Sequential(nn.ReLU(), nn.Conv2d(c_in, c_out, kernel, stride, padding, bias=False),
                         nn.BatchNorm2d(c_out))


class FactorizedReduce(nn.Module):
    """Halve the spatial size without dropping pixels: two strided 1x1 convs, one shifted by
    a pixel, concatenated. Padding on the right keeps odd sizes at ceil(n / 2), like every
    other stride-2 operation here."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv_a = nn.Conv2d(c_in, c_out // 2, 1, stride=2, bias=False)
        self.conv_b = nn.Conv2d(c_in, c_out - c_out // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(x)
        shifted = F.pad(x, (0, 1, 0, 1))[:, :, 1:, 1:]
        return self.bn(torch.cat([self.conv_a(x), self.conv_b(shifted)], dim=1))


def _bottleneck(c: int, *middle: nn.Module) -> nn.Sequential:
    # The 3x3 and 1x7-7x1 convs run at a quarter of the branch width between two 1x1 convs,
    # which keeps AmoebaNet-D(18, 256) near the size GPipe reports instead of 10x larger.
    return nn.Sequential(relu_conv_bn(c, max(c // 4, 1)), *middle, relu_conv_bn(max(c // 4, 1), c))


def operation(name: str, c: int, stride: int) -> nn.Module:
    """The operation ``name`` on ``c`` channels; stride 2 halves H and W to ceil(n / 2)."""
    q = max(c // 4, 1)
    if name == "none":
        return nn.Identity() if stride == 1 else FactorizedReduce(c, c)
    if name == "conv_1x1":
        return relu_conv_bn(c, c, 1, stride)
    if name == "conv_3x3":
        return _bottleneck(c, relu_conv_bn(q, q, 3, stride, 1))
    if name == "conv_1x7_7x1":
        return _bottleneck(c, relu_conv_bn(q, q, (1, 7), (1, stride), (0, 3)),
                           relu_conv_bn(q, q, (7, 1), (stride, 1), (3, 0)))
    if name == "max_pool_3x3":
        return nn.MaxPool2d(3, stride, padding=1)
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, stride, padding=1, count_include_pad=False)
    if name == "max_pool_2x2":
        if stride == 1:  # keep the size: pad one pixel right and bottom
            return nn.Sequential(nn.ReplicationPad2d((0, 1, 0, 1)), nn.MaxPool2d(2, 1))
        return nn.MaxPool2d(2, stride, ceil_mode=True)
    raise KeyError(name)


class Cell(nn.Module):
    """A normal or reduction cell; forward((prev, cur)) -> (cur, new).

    Accepts a single tensor too (the stem's output), used as both prev and cur.
    """

    def __init__(self, genotype: Genotype, c_prev: int, c_cur: int, channels: int,
                 reduction: bool, prev_reduced: bool) -> None:
        super().__init__()
        self.pre_prev = FactorizedReduce(c_prev, channels) if prev_reduced else relu_conv_bn(c_prev, channels)
        self.pre_cur = relu_conv_bn(c_cur, channels)
        # Only the two cell inputs (states 0 and 1) are strided in a reduction cell.
        self.ops = nn.ModuleList(
            operation(name, channels, 2 if reduction and state < 2 else 1) for state, name in genotype.ops)
        self.inputs = tuple(state for state, _ in genotype.ops)
        self.concat = genotype.concat
        self.out_channels = channels * len(genotype.concat)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        prev, cur = (x, x) if isinstance(x, torch.Tensor) else x
        states = [self.pre_prev(prev), self.pre_cur(cur)]
        for k in range(0, len(self.ops), 2):
            a, b = self.inputs[k], self.inputs[k + 1]
            states.append(self.ops[k](states[a]) + self.ops[k + 1](states[b]))
        return cur, torch.cat([states[i] for i in self.concat], dim=1)


class Head(nn.Module):
    """ReLU, global average pool and the classifier, on the last tensor of the pair."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        last = x if isinstance(x, torch.Tensor) else x[-1]
        return self.fc(torch.flatten(self.pool(F.relu(last)), 1))


def amoebanet_d(num_classes: int = 1000, num_layers: int = 18, num_filters: int = 256,
                in_channels: int = 3) -> nn.Sequential:
    """AmoebaNet-D(L = ``num_layers`` normal cells, F = ``num_filters``) as units.

    L must be a multiple of 3 (L/3 normal cells per resolution) and F a multiple of 4 (the
    stem works at F/4). GPipe's sizes: (18, 256), (36, 544); tests use e.g. (3, 8).
    """
    positive_int("amoebanet-d", "num_classes", num_classes)
    positive_int("amoebanet-d", "in_channels", in_channels)
    positive_int("amoebanet-d", "num_layers", num_layers)
    positive_int("amoebanet-d", "num_filters", num_filters)
    if num_layers % 3:
        raise GemsError(f"amoebanet-d: num_layers must be a multiple of 3 (normal cells split evenly "
                        f"between the three resolutions), e.g. 6, 18, 36; got {num_layers}.")
    if num_filters % 4:
        raise GemsError(f"amoebanet-d: num_filters must be a multiple of 4 (the stem uses num_filters / 4), "
                        f"e.g. 64, 256, 544; got {num_filters}.")
    f, n = num_filters, num_layers // 3
    c_stem = f // 4
    cells: list[tuple[str, bool, int]] = [("stem_reduce1", True, f // 4), ("stem_reduce2", True, f // 2)]
    for level, width in enumerate((f, 2 * f, 4 * f)):
        if level:
            cells.append((f"reduce{level}", True, width))
        cells += [(f"normal{level * n + i}", False, width) for i in range(1, n + 1)]

    units: OrderedDict[str, nn.Module] = OrderedDict()
    units["stem"] = nn.Sequential(nn.Conv2d(in_channels, c_stem, 3, stride=2, padding=1, bias=False),
                                  nn.BatchNorm2d(c_stem))
    c_prev, c_cur, prev_reduced = c_stem, c_stem, False
    for name, reduction, width in cells:
        cell = Cell(REDUCTION if reduction else NORMAL, c_prev, c_cur, width, reduction, prev_reduced)
        units[name] = cell
        # The next cell's prev is this cell's cur: bigger than its cur exactly when this cell reduced.
        c_prev, c_cur, prev_reduced = c_cur, cell.out_channels, reduction
    units["head"] = Head(c_cur, num_classes)
    return nn.Sequential(units)
