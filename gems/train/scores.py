"""Validation scores, exact over the whole validation set on every rank.

The rank that holds a micro-batch's output calls ``update(output, target)``; an accumulator keeps
sums and counts only, in ONE float64 tensor ``state`` of fixed size on the CPU. The engine adds
the states of all ranks (one allreduce; a rank that saw no output adds zeros) and
``compute(summed)`` gives the scores of the whole set -- never a mean of per-batch means::

    state = [loss totals (terms) | loss normalisers (terms) | task part]
    classification task part:  rows, top-1 hits, top-5 hits
    segmentation task part:    confusion matrix C x C, (truth, prediction), row-major

Counts held in float64 are exact up to 2**53 (9e15 pixels: two billion 2048 x 2048 images); loss
sums are sums of floats, exact to rounding. Targets equal to ``IGNORE`` are skipped (pixels, and
rows that pad the last batch: those rows are dropped before the loss, so a ``MeanLoss`` does not
count them either).

Metrics (``compute``):
- ``loss``: sum_j total_j / normaliser_j, the training loss on the whole set (only when a loss
  is given; NaN when it counted nothing);
- classification: ``top1``, and ``top5`` only when num_classes > 5 (with 5 classes or fewer it
  is always 1); hits / valid rows;
- segmentation, from the confusion matrix M over valid pixels, with TP_c = M[c, c],
  FP_c = column sum - TP_c, FN_c = row sum - TP_c, and "present" the classes that occur in the
  truth or the prediction anywhere in the set (absent classes are left out of the means):
  ``iou_per_class`` TP/(TP+FP+FN), NaN for an absent class; ``miou`` its mean over present
  classes; ``dice`` mean over present classes of 2TP/(2TP+FP+FN); ``pixel_accuracy``
  trace(M) / sum(M). A metric with nothing to count is NaN.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from gems.errors import GemsError
from gems.pipeline.loss import SumLoss, as_sum_loss, mean, sums
from gems.train.targets import IGNORE, predicted_labels

METRICS = {"classification": ("loss", "top1", "top5"),
           "segmentation": ("loss", "miou", "dice", "pixel_accuracy")}


def higher_is_better(name: str) -> bool:
    """Whether a larger value of metric ``name`` is better (the loss is the one lower is better)."""
    known = sorted({m for names in METRICS.values() for m in names})
    if name not in known:
        raise GemsError(f"--keep-best {name} is not a metric: choose one of {', '.join(known)}")
    return name != "loss"


class Scores:
    """Accumulates one task's sums and counts in ``state`` (see the module docstring).

    ``names``: the scalar metrics ``compute`` returns, the ones ``--keep-best`` may name.
    """

    task = ""

    def __init__(self, num_classes: int, loss: SumLoss | Callable | None, size: int) -> None:
        self.num_classes = num_classes
        self.loss = None if loss is None else as_sum_loss(loss)
        self.terms = 0 if self.loss is None else self.loss.terms
        self.state = torch.zeros(2 * self.terms + size, dtype=torch.float64)
        self.names = (("loss",) if self.loss is not None else ()) + self._names()

    def _names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def reset(self) -> None:
        self.state.zero_()

    @torch.no_grad()
    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        """Add one micro-batch: ``output`` logits ``[N, C, ...]`` (or ``[N, 1, ...]`` / ``[N]``
        for a binary task), ``target`` class indices ``[N, ...]``."""
        output = output.detach()
        if output.dim() == 1:
            output = output.unsqueeze(1)      # binary logits [N]
        self._check(output, target)
        keep = (target != IGNORE).reshape(len(target), -1).any(1)
        if not bool(keep.all()):              # rows that pad the batch: no loss, no counts
            output, target = output[keep], target[keep]
        self.state[2 * self.terms:] += self._counts(output, target).to("cpu", torch.float64)
        if self.loss is not None and len(target):
            self.state[:2 * self.terms] += sums(self.loss, output, target)

    def compute(self, state: torch.Tensor | None = None) -> dict[str, float | list[float]]:
        """The metrics from ``state`` (default: this accumulator's own; pass the sum over ranks)."""
        s = self.state if state is None else state.detach().to("cpu", torch.float64)
        if s.shape != self.state.shape:
            raise ValueError(f"a state of {list(s.shape)} entries, this accumulator's has {list(self.state.shape)}")
        result: dict[str, float | list[float]] = {}
        if self.loss is not None:
            part = s[:2 * self.terms]
            result["loss"] = mean(part) if bool((part[self.terms:] > 0).any()) else math.nan
        result.update(self._metrics(s[2 * self.terms:]))
        return result

    def _check(self, output: torch.Tensor, target: torch.Tensor) -> None:
        c = self.num_classes
        if output.dim() != target.dim() + 1 or output.shape[:1] + output.shape[2:] != target.shape:
            raise GemsError(f"{self.task} scores need outputs [N, C, ...] and targets [N, ...] of one class "
                            f"index each, got {list(output.shape)} and {list(target.shape)}: give targets "
                            f"as class indices (multi-label targets are not scored)")
        if output.shape[1] != c and not (output.shape[1] == 1 and c == 2):
            raise GemsError(f"the model outputs {output.shape[1]} channels for {c} classes: make "
                            f"--num-classes match the model's head (one channel for a binary task)")
        if target.is_floating_point() or bool(((target != IGNORE) & ((target < 0) | (target >= c))).any()):
            raise GemsError(f"validation targets must be integer class indices in 0..{c - 1} (or IGNORE): "
                            f"check --num-classes and the labels")

    def _counts(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _metrics(self, counts: torch.Tensor) -> dict[str, float | list[float]]:
        raise NotImplementedError


class ClassificationScores(Scores):
    """Loss, top-1 and (more than 5 classes) top-5 accuracy over the valid rows."""

    task = "classification"

    def __init__(self, num_classes: int, loss: SumLoss | Callable | None = None) -> None:
        super().__init__(num_classes, loss, 3)

    def _names(self) -> tuple[str, ...]:
        return ("top1", "top5") if self.num_classes > 5 else ("top1",)

    def _counts(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        hits1 = (predicted_labels(output) == target).sum()
        hits5 = torch.zeros_like(hits1)
        if self.num_classes > 5:
            hits5 = (output.topk(5, 1).indices == target.unsqueeze(1)).any(1).sum()
        return torch.stack([torch.tensor(len(target), device=hits1.device), hits1, hits5])

    def _metrics(self, counts: torch.Tensor) -> dict[str, float | list[float]]:
        rows, hits1, hits5 = counts.tolist()
        result = {"top1": hits1 / rows if rows else math.nan}
        if self.num_classes > 5:
            result["top5"] = hits5 / rows if rows else math.nan
        return result


class SegmentationScores(Scores):
    """Loss and the confusion-matrix metrics (mIoU, per-class IoU, Dice, pixel accuracy)."""

    task = "segmentation"

    def __init__(self, num_classes: int, loss: SumLoss | Callable | None = None) -> None:
        super().__init__(num_classes, loss, num_classes * num_classes)

    def _names(self) -> tuple[str, ...]:
        return ("miou", "dice", "pixel_accuracy")

    def _counts(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        c = self.num_classes
        # One bincount over cells truth * C + prediction; ignored pixels go to one extra bin, cut off.
        cell = torch.where(target != IGNORE, target * c + predicted_labels(output), c * c)
        return torch.bincount(cell.flatten(), minlength=c * c + 1)[:c * c]

    def _metrics(self, counts: torch.Tensor) -> dict[str, float | list[float]]:
        m = counts.view(self.num_classes, self.num_classes)
        tp, truth, predicted = m.diagonal(), m.sum(1), m.sum(0)
        present = truth + predicted > 0
        nan = torch.full_like(tp, math.nan)
        iou = torch.where(present, tp / (truth + predicted - tp).clamp_min(1), nan)
        dice = torch.where(present, 2 * tp / (truth + predicted).clamp_min(1), nan)
        total = float(m.sum())
        return {"miou": float(iou[present].mean()) if bool(present.any()) else math.nan,
                "iou_per_class": iou.tolist(),
                "dice": float(dice[present].mean()) if bool(present.any()) else math.nan,
                "pixel_accuracy": float(tp.sum()) / total if total else math.nan}


def make_scores(task: str, num_classes: int, loss: SumLoss | Callable | None = None) -> Scores:
    """The validation accumulator of ``task``; ``loss`` (the training loss, a ``SumLoss`` or a
    mean-loss callable) adds the ``loss`` metric, None leaves it out."""
    if task not in METRICS:
        raise GemsError(f"unknown task {task!r}: use --task {' or '.join(METRICS)}")
    if task == "segmentation" and num_classes < 2:
        raise GemsError(f"segmentation with {num_classes} class cannot be scored: pass --num-classes 2 or more "
                        f"(a binary task has 2, background and foreground)")
    if num_classes < 1:
        raise GemsError(f"{num_classes} classes: pass --num-classes 1 or more")
    return (ClassificationScores if task == "classification" else SegmentationScores)(num_classes, loss)
