"""ResNet v1.5 (torchvision's) re-arranged into cuttable units.

The network is torchvision's own ``ResNet`` (stride on the 3x3 conv of a bottleneck: "v1.5"),
so results and pretrained weights carry over exactly. Only the container changes::

    stem (conv1, bn1, relu, maxpool) | layer1_0 | layer1_1 | ... | layer4_2 | head (avgpool, flatten, fc)

Each residual block is one unit because its skip connection cannot be cut.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torchvision.models.resnet import ResNet

from gems.errors import GemsError
from .checks import positive_int

# Blocks per group for each standard depth (He et al. 2016, table 1).
LAYERS: dict[int, tuple[int, int, int, int]] = {
    18: (2, 2, 2, 2),
    34: (3, 4, 6, 3),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
}


def resnet(
    depth: int,
    num_classes: int = 1000,
    layers: Sequence[int] | None = None,
    width_per_group: int = 64,
    groups: int = 1,
    zero_init_residual: bool = False,
    in_channels: int = 3,
) -> nn.Sequential:
    """ResNet v1.5 of the given depth as units (see module docstring).

    ``depth`` picks the block (basic for 18/34, bottleneck for 50+) and the default
    ``layers``; pass ``layers`` (four block counts) for a deeper variant and
    ``width_per_group`` (e.g. 128 = Wide ResNet-50-2) or ``groups`` (ResNeXt) for wider ones;
    ``in_channels`` != 3 replaces the first conv (e.g. 1 for grey-scale scans).
    """
    name = f"resnet{depth}"
    if depth not in LAYERS:
        raise GemsError(f"ResNet depth must be one of {sorted(LAYERS)}; got {depth!r}.")
    positive_int(name, "num_classes", num_classes)
    positive_int(name, "width_per_group", width_per_group)
    positive_int(name, "groups", groups)
    positive_int(name, "in_channels", in_channels)
    if layers is None:
        layers = LAYERS[depth]
    if len(layers) != 4 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in layers):
        raise GemsError(f"{name}: layers must be four positive block counts, e.g. [3, 4, 23, 3]; got {layers!r}.")
    # torchvision costs seconds to import: only models that use it pay for it (every rank, every launch).
    from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet  # noqa: PLC0415

    block = BasicBlock if depth < 50 else Bottleneck
    if block is BasicBlock and (groups != 1 or width_per_group != 64):
        raise GemsError(f"{name} uses basic blocks, which support only groups=1 and width_per_group=64; "
                        "use resnet50 or deeper for grouped or wide variants.")
    reference = ResNet(block, list(layers), num_classes=num_classes, groups=groups,
                       width_per_group=width_per_group, zero_init_residual=zero_init_residual)
    if in_channels != 3:
        old = reference.conv1
        reference.conv1 = nn.Conv2d(in_channels, old.out_channels, old.kernel_size, old.stride,
                                    old.padding, bias=False)
        nn.init.kaiming_normal_(reference.conv1.weight, mode="fan_out", nonlinearity="relu")
    return from_torchvision(reference)


def from_torchvision(model: ResNet) -> nn.Sequential:
    """Re-arrange a torchvision ``ResNet`` into units, sharing (not copying) its modules."""
    units: OrderedDict[str, nn.Module] = OrderedDict()
    units["stem"] = nn.Sequential(OrderedDict(
        conv1=model.conv1, bn1=model.bn1, relu=model.relu, maxpool=model.maxpool))
    for g in range(1, 5):
        for i, block in enumerate(getattr(model, f"layer{g}")):
            units[f"layer{g}_{i}"] = block
    units["head"] = nn.Sequential(OrderedDict(
        avgpool=model.avgpool, flatten=nn.Flatten(1), fc=model.fc))
    return nn.Sequential(units)


_TV_BLOCK = re.compile(r"^layer(\d)\.(\d+)\.(.*)$")


def torchvision_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a torchvision ResNet state dict (e.g. pretrained weights) to this layout's keys,
    so ``model.load_state_dict(torchvision_state_dict(sd))`` works on a built ResNet."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        match = _TV_BLOCK.match(key)
        if match:
            g, i, rest = match.groups()
            out[f"layer{g}_{i}.{rest}"] = value
        elif key.startswith(("conv1.", "bn1.")):
            out[f"stem.{key}"] = value
        elif key.startswith("fc."):
            out[f"head.{key}"] = value
        else:
            raise GemsError(f"{key!r} is not a torchvision ResNet parameter; pass the state dict of a "
                            "torchvision.models.ResNet.")
    return out
