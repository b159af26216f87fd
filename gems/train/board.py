"""TensorBoard logging of a training run (``--tensorboard DIR``), on rank 0 only.

Scalars per step: ``train/loss``, ``train/lr``, ``train/images_per_s`` and ``memory/rank_R``
(each rank's process peak, bytes). At each validation: ``val/<metric>`` for every number the
task's scores give (per-class IoU as ``val/iou_class_C``), and for segmentation a few inputs
beside their true and predicted masks overlaid in colour (``val/overlays``: input | truth |
prediction, each at most ``OVERLAY_SIDE`` pixels wide). torch's ``SummaryWriter`` does the
writing; it needs the ``tensorboard`` package (the extra of the same name).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gems.errors import GemsError
from gems.train.targets import IGNORE

OVERLAY_SIDE = 384
OVERLAY_IMAGES = 4


def require_tensorboard() -> None:
    try:
        import tensorboard  # noqa: F401, PLC0415
    except ImportError:
        raise GemsError("--tensorboard needs the tensorboard package: pip install tensorboard "
                        "(or install gems with the 'tensorboard' extra)") from None


def palette(num_classes: int) -> torch.Tensor:
    """num_classes x 3 colours in [0, 1], spread around the hue circle; class 0 dark."""
    hues = torch.arange(num_classes, dtype=torch.float32) / max(1, num_classes)
    colours = torch.stack([0.5 + 0.5 * torch.cos(2 * math.pi * (hues + k / 3)) for k in range(3)], 1)
    colours[0] = 0.1
    return colours


def overlays(images: torch.Tensor, truth: torch.Tensor, predicted: torch.Tensor, num_classes: int,
             mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """N x 3 x h x 3w: each input (normalisation undone) beside its true and predicted masks
    blended over it; ignored pixels show the input alone."""
    x = images[:OVERLAY_IMAGES].float().cpu()
    x = (x * torch.tensor(std).view(-1, 1, 1) + torch.tensor(mean).view(-1, 1, 1)).clamp(0, 1)
    x = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x[:, :3]
    colours = palette(num_classes)

    def blend(mask: torch.Tensor) -> torch.Tensor:
        mask = mask[:len(x)].cpu()
        valid = (mask != IGNORE).unsqueeze(1)
        colour = colours[mask.clamp(0, num_classes - 1)].permute(0, 3, 1, 2)
        return torch.where(valid, 0.5 * x + 0.5 * colour, x)

    panel = torch.cat([x, blend(truth), blend(predicted)], dim=3)
    scale = min(1.0, 3 * OVERLAY_SIDE / panel.shape[3])
    return F.interpolate(panel, scale_factor=scale, mode="area") if scale < 1 else panel


class Board:
    """Writes to ``logdir`` when given and ``active`` (rank 0); otherwise does nothing."""

    def __init__(self, logdir: str | None, active: bool, purge_step: int | None = None) -> None:
        self.writer = None
        if logdir and active:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional dependency
            # purge_step: a resumed run drops what the interrupted one logged after its checkpoint
            self.writer = SummaryWriter(logdir, purge_step=purge_step)

    def step(self, step: int, loss: float, lr: float, images_per_s: float, peaks: list[int]) -> None:
        if self.writer is None:
            return
        self.writer.add_scalar("train/loss", loss, step)
        self.writer.add_scalar("train/lr", lr, step)
        self.writer.add_scalar("train/images_per_s", images_per_s, step)
        for rank, peak in enumerate(peaks):
            self.writer.add_scalar(f"memory/rank_{rank}", peak, step)

    def validation(self, step: int, metrics: dict, images: torch.Tensor | None = None) -> None:
        if self.writer is None:
            return
        for name, value in metrics.items():
            if isinstance(value, (list, tuple)):
                for c, v in enumerate(value):
                    if not math.isnan(v):
                        self.writer.add_scalar(f"val/{name.removesuffix('_per_class')}_class_{c}", v, step)
            else:
                self.writer.add_scalar(f"val/{name}", value, step)
        if images is not None:
            self.writer.add_images("val/overlays", images, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
