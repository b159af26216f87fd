"""The losses gems trains with, each a ``SumLoss`` (sums per micro-batch, one global divisor).

``make_loss(task, name, num_classes, class_weights=..., label_smoothing=...)`` builds one and
checks the user's choices once, here at the edge (``GemsError`` naming the flag and the fix).
Every loss ignores targets equal to ``IGNORE`` and splits exactly: for any split of a batch into
micro-batches, ``sum_j (sum of total_j) / (sum of normaliser_j)`` is the PyTorch mean on the
whole batch (see ``gems.pipeline.loss``). A batch with nothing to count gives 0, not PyTorch's NaN.
Normalisers are float64 on the targets' device; weights are kept in float64 and cast to the
output's dtype for the sums.

cross-entropy (classification ``[N, C]`` / segmentation ``[N, C, H, W]``, class-index targets),
one term. With class weights ``w`` and label smoothing ``s``, PyTorch's mean is::

    sum_i [(1 - s) w[y_i] (-log p_i[y_i]) + s / C sum_c w[c] (-log p_i[c])]  /  sum_i w[y_i]

over the valid targets i (``w = 1`` without weights): the smoothing term is weighted per class,
yet both parts share the divisor ``sum_i w[y_i]``, so one term is exact. Its total is
``F.cross_entropy(..., reduction="sum")`` itself (no temporaries beyond F.cross_entropy's own);
the normaliser is the sum of the valid targets' weights (their count without weights).

bce (BCE with logits), one term, normaliser = number of valid elements. Binary: output
``[N, 1]`` / ``[N, 1, H, W]`` with targets 0/1 of shape ``[N]`` / ``[N, H, W]``, or output
``[N]`` with targets ``[N]``; multi-label (classification): output ``[N, C]`` with multi-hot
targets ``[N, C]`` (IGNORE entries skipped). Class weights are PyTorch's ``pos_weight``: they
scale the positive part of each output channel's loss (one weight for a binary task or for
every label, else one per label), and the divisor stays the element count -- exactly
``F.binary_cross_entropy_with_logits(x[valid], y[valid], pos_weight=w)``. No label smoothing.

dice-ce (segmentation), two terms: term 0 is cross-entropy as above; term 1 is soft Dice
averaged over the images that have at least one valid pixel (its normaliser). For image i, with
softmax probabilities p over the C channels and V its valid pixels::

    dice_loss_i = 1/C sum_c [1 - (2 I_c + 1) / (P_c + T_c + 1)]
    I_c = sum_{x in V, y(x) = c} p_c(x),   P_c = sum_{x in V} p_c(x),   T_c = |{x in V: y(x) = c}|

every class counted (a class absent from the image and not predicted costs ~0), smoothing 1
pixel (so an image with no valid pixel costs exactly 0), class weights and label smoothing
applying to the cross-entropy term only. The loss is CE mean + Dice mean. Dice keeps one more
full-size tensor than cross-entropy (the softmax, saved for backward), computed in float32 at
least; its sums over pixels are batched products, not full-size temporaries.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from gems.errors import GemsError
from gems.pipeline.loss import SumLoss
from gems.train.targets import IGNORE

LOSSES = {"classification": ("cross-entropy", "bce"),
          "segmentation": ("cross-entropy", "bce", "dice-ce")}
DEFAULT_LOSS = {"classification": "cross-entropy", "segmentation": "cross-entropy"}
DICE_SMOOTHING = 1.0    # in pixels: keeps 0/0 away and makes an image without valid pixels cost 0


def _count(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum(dtype=torch.float64).reshape(1)


class CrossEntropy(SumLoss):
    """Cross-entropy over class-index targets, class weights and label smoothing as PyTorch's
    (see the module docstring); ``weight`` is None or C non-negative floats."""

    terms = 1

    def __init__(self, weight: Sequence[float] | None = None, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.weight = None if weight is None else torch.tensor(list(weight), dtype=torch.float64)
        self.label_smoothing = float(label_smoothing)

    def normaliser(self, target: torch.Tensor) -> torch.Tensor:
        valid = target != IGNORE
        if self.weight is None:
            return _count(valid)
        w = self.weight.to(target.device)[torch.where(valid, target, 0)]
        return torch.where(valid, w, 0.0).sum().reshape(1)

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.to(output.device, output.dtype)
        return F.cross_entropy(output, target, weight=weight, ignore_index=IGNORE, reduction="sum",
                               label_smoothing=self.label_smoothing)


class BinaryCrossEntropy(SumLoss):
    """BCE with logits, binary or multi-label; ``pos_weight`` None or one weight per output
    channel (or one for all); see the module docstring."""

    terms = 1

    def __init__(self, pos_weight: Sequence[float] | None = None) -> None:
        super().__init__()
        self.pos_weight = None if pos_weight is None else torch.tensor(list(pos_weight), dtype=torch.float64)

    def normaliser(self, target: torch.Tensor) -> torch.Tensor:
        return _count(target != IGNORE)

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if output.dim() >= 2 and output.shape[1] == 1 and target.shape == output.shape[:1] + output.shape[2:]:
            target = target.unsqueeze(1)          # binary: class indices 0/1 for a one-channel output
        if target.shape != output.shape:
            raise GemsError(f"--loss bce needs an output of one channel per label ([N, 1, ...] for a binary "
                            f"task) and targets to match, got output {list(output.shape)} and targets "
                            f"{list(target.shape)}: give the model that many output channels")
        valid = target != IGNORE
        pos_weight = None
        if self.pos_weight is not None:
            channels = output.shape[1] if output.dim() >= 2 else 1
            if len(self.pos_weight) not in (1, channels):
                raise GemsError(f"--class-weights has {len(self.pos_weight)} weights for an output of {channels} "
                                f"channels under --loss bce: give one weight, or one per output channel")
            pos_weight = self.pos_weight.to(output.device, output.dtype)
            if output.dim() > 2:
                pos_weight = pos_weight.view(-1, *[1] * (output.dim() - 2))    # along the channel dim
        positive = target.to(output.dtype, copy=True).clamp_min_(0)     # IGNORE (-1) -> 0, weighted 0 below
        return F.binary_cross_entropy_with_logits(output, positive, weight=valid.to(output.dtype),
                                                  pos_weight=pos_weight, reduction="sum")


class DiceCrossEntropy(SumLoss):
    """Cross-entropy + soft Dice per image, two terms (see the module docstring)."""

    terms = 2

    def __init__(self, weight: Sequence[float] | None = None, label_smoothing: float = 0.0) -> None:
        super().__init__()
        self.ce = CrossEntropy(weight, label_smoothing)

    def normaliser(self, target: torch.Tensor) -> torch.Tensor:
        images = (target != IGNORE).flatten(1).any(1)
        return torch.cat([self.ce.normaliser(target), _count(images)])

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.ce(output, target), dice_loss_sum(output, target)])


def dice_loss_sum(output: torch.Tensor, target: torch.Tensor, smoothing: float = DICE_SMOOTHING) -> torch.Tensor:
    """Sum over the images of ``[N, C, ...]`` logits of each image's soft Dice loss (the formula
    in the module docstring); pixels whose target is IGNORE left out."""
    n, c = output.shape[:2]
    valid = (target != IGNORE).reshape(n, -1)
    labels = torch.where(valid, target.reshape(n, -1), 0)
    dtype = torch.promote_types(output.dtype, torch.float32)
    p = torch.softmax(output, 1, dtype=dtype).reshape(n, c, -1)          # [N, C, pixels]
    v = valid.to(dtype)
    predicted = torch.bmm(p, v.unsqueeze(2)).squeeze(2)                   # P_c
    hit = p.gather(1, labels.unsqueeze(1)).squeeze(1) * v                  # p_y(x) on valid pixels
    overlap = torch.zeros(n, c, dtype=dtype, device=output.device).scatter_add(1, labels, hit)
    truth = torch.zeros(n, c, dtype=dtype, device=output.device).scatter_add(1, labels, v)
    dice = (2 * overlap + smoothing) / (predicted + truth + smoothing)
    return (1 - dice).mean(1).sum()


def make_loss(task: str, name: str, num_classes: int, *, class_weights: Sequence[float] | None = None,
              label_smoothing: float = 0.0) -> SumLoss:
    """The loss ``name`` for ``task`` (see ``LOSSES``), checked against ``num_classes``.

    bce is binary when ``num_classes`` <= 2 (one output channel) and multi-label with
    ``num_classes`` labels (classification only) otherwise.
    """
    if task not in LOSSES:
        raise GemsError(f"unknown task {task!r}: use --task {' or '.join(LOSSES)}")
    if name not in LOSSES[task]:
        raise GemsError(f"--loss {name} is not available for {task}: choose one of {', '.join(LOSSES[task])}")
    if num_classes < 1:
        raise GemsError(f"{num_classes} classes: pass --num-classes 1 or more")
    smoothing = float(label_smoothing)
    if not 0.0 <= smoothing < 1.0:
        raise GemsError(f"--label-smoothing {label_smoothing} is outside [0, 1): pass a value such as 0.1, or 0")
    if name == "bce" and smoothing:
        raise GemsError("--label-smoothing applies to cross-entropy and dice-ce, not to --loss bce: "
                        "leave --label-smoothing at 0 or choose another --loss")
    if name == "bce" and task == "segmentation" and num_classes > 2:
        raise GemsError(f"--loss bce segments one class against the rest, not {num_classes} classes: use "
                        f"--num-classes 2, or --loss cross-entropy or dice-ce")
    weights = None if class_weights is None else [float(w) for w in class_weights]
    if weights is not None:
        _check_weights(name, weights, num_classes)
    if name == "bce":
        return BinaryCrossEntropy(weights)
    if name == "dice-ce":
        return DiceCrossEntropy(weights, smoothing)
    return CrossEntropy(weights, smoothing)


def _check_weights(name: str, weights: list[float], num_classes: int) -> None:
    if name == "bce":
        allowed = (1,) if num_classes <= 2 else (1, num_classes)
        what = ("one weight (of the positive class)" if num_classes <= 2
                else f"one weight for every label or {num_classes}, one per label")
    else:
        allowed, what = (num_classes,), f"{num_classes} weights, one per class"
    if len(weights) not in allowed:
        raise GemsError(f"--class-weights has {len(weights)} weights but --loss {name} with {num_classes} "
                        f"classes takes {what}: pass that many, comma-separated")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not any(w > 0 for w in weights):
        raise GemsError(f"--class-weights {','.join(map(str, weights))} must be finite and non-negative with "
                        f"at least one above 0: fix the weights")
