"""The loss contract: each micro-batch contributes sums; one global normaliser divides them.

A mean over each micro-batch does not add up to the mean over the global batch when the
micro-batches divide by different amounts: segmentation pixels marked ignore, class weights,
images with no foreground. So a gems loss (``SumLoss``) has two parts:

- ``normaliser(target)``: what one process would divide the sum by, counted over this
  micro-batch's targets (valid pixels, the sum of the targets' class weights, images), one
  float64 entry per term of the loss. It depends on the targets only;
- ``forward(output, target)``: the sums, one entry per term (a scalar for one term).

Before a step's first forward, the engine adds every micro-batch's normaliser over the whole
launch (one small allreduce over the world: each micro-batch counted by the rank that computes
its loss), and the loss of a micro-batch becomes ``sum_j total_j / N_j`` with ``N_j`` the
global normaliser of term j. So the gradients and the loss are those of one process on the
global batch whatever each micro-batch holds -- exact in the mathematical sense; the sums are
added in another order, so equal to rounding. A term whose global normaliser is 0 (every pixel
ignored) contributes 0.

A plain callable ``(output, target) -> mean over the micro-batch`` (``nn.CrossEntropyLoss()``)
is adapted by ``MeanLoss``: total = mean x rows, normaliser = rows. That is exact when each
micro-batch's mean divides by its number of rows -- per-image means, such as cross-entropy
without ignored targets or class weights -- and not otherwise; a loss of the other kind should
subclass ``SumLoss`` (``gems.train.losses`` has cross-entropy, BCE and Dice + cross-entropy).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class SumLoss(nn.Module):
    """Base class of losses that follow the contract (see the module docstring)."""

    terms = 1

    def normaliser(self, target: torch.Tensor) -> torch.Tensor:
        """float64 tensor of ``terms`` entries: this micro-batch's part of each term's divisor."""
        raise NotImplementedError

    def forward(self, output, target) -> torch.Tensor:
        """This micro-batch's sum of each term (``terms`` entries, or a scalar for one term)."""
        raise NotImplementedError


class MeanLoss(SumLoss):
    """Adapts ``fn(output, target) -> mean over the micro-batch`` (exact when every micro-batch's
    mean divides by its number of rows; see the module docstring)."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def normaliser(self, target: torch.Tensor) -> torch.Tensor:
        return torch.tensor([float(len(target))], dtype=torch.float64)

    def forward(self, output, target) -> torch.Tensor:
        return self.fn(output, target) * len(target)


def as_sum_loss(fn: Callable) -> SumLoss:
    """``fn`` itself when it follows the contract, else ``MeanLoss(fn)``."""
    return fn if isinstance(fn, SumLoss) else MeanLoss(fn)


def reciprocal(normalisers: torch.Tensor) -> torch.Tensor:
    """1 / N per term, 0 where N is 0 (a term with nothing to count contributes nothing)."""
    safe = torch.where(normalisers > 0, normalisers, torch.ones_like(normalisers))
    return torch.where(normalisers > 0, 1.0 / safe, torch.zeros_like(normalisers))


def scaled(terms: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss from its sums and the global ``inverse`` normalisers (``reciprocal``):
    sum_j total_j / N_j, differentiable, in the sums' dtype."""
    return (terms.reshape(-1) * inverse.to(terms.dtype)).sum()


def batch_mean(loss: SumLoss, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """One process's loss on a whole batch (its own normalisers), differentiable: what a training
    step computes over all its micro-batches and ranks, for a single-process reference."""
    return scaled(torch.as_tensor(loss(output, target)), reciprocal(loss.normaliser(target)).to(output.device))


def sums(loss: SumLoss, output, target: torch.Tensor) -> torch.Tensor:
    """``[totals | normalisers]`` of one micro-batch, float64 on the CPU: what an evaluation adds up
    over batches and ranks before dividing (``mean``)."""
    totals = torch.as_tensor(loss(output, target)).detach().reshape(-1)
    return torch.cat([totals.to("cpu", torch.float64), loss.normaliser(target).reshape(-1).to("cpu", torch.float64)])


def mean(state: torch.Tensor) -> float:
    """The loss of summed ``[totals | normalisers]``: sum_j total_j / N_j (0 for a term with N_j = 0)."""
    terms = len(state) // 2
    return float((state[:terms] * reciprocal(state[terms:])).sum())


class LossScores:
    """The loss over a whole evaluation: every micro-batch's sums and normalisers added up
    (``state``, summed over the ranks by ``Engine.evaluate``), divided at the end."""

    def __init__(self, loss: SumLoss) -> None:
        self.loss = loss
        self.state = torch.zeros(2 * loss.terms, dtype=torch.float64)

    def update(self, output, target: torch.Tensor) -> None:
        self.state += sums(self.loss, output, target)

    def compute(self, state: torch.Tensor | None = None) -> dict[str, float]:
        return {"loss": mean(self.state if state is None else state)}
