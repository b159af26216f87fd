"""A step that is not applied leaves no trace: the buffers its forwards changed go back.

A step whose loss is not finite skips the optimizer (``GradSync.apply``), but its forwards have
already moved every BatchNorm's running statistics and counters (``num_batches_tracked``). Each
rank keeps, allocated once, a copy of those buffers, taken at the start of every step
(``remember``) and written back when the step is not applied (``restore``): the next step starts
from exactly the state before the skipped one. Deferred BatchNorm sums (``gems.pipeline.batchnorm``)
are simply not written, so they need nothing here.
"""
from __future__ import annotations

import torch


class Rollback:
    """The values of ``buffers`` (any dtype) before the step, to put back if it is not applied."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self._buffers = buffers
        self._before = [b.detach().clone() for b in buffers]

    @torch.no_grad()
    def remember(self) -> None:
        """At a step's start: the buffers' values now."""
        for b, before in zip(self._buffers, self._before):
            before.copy_(b)

    @torch.no_grad()
    def restore(self) -> None:
        """The step is not applied: every buffer back to its value at ``remember``."""
        for b, before in zip(self._buffers, self._before):
            b.copy_(before)
