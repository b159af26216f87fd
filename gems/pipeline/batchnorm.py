"""BatchNorm modes: how the BatchNorm layers of a rank's stages normalise and keep running statistics.

A pipeline step runs a stage on micro-batches, on several copies of the stage (the two mirrored
replicas under ``mast``, D data-parallel groups), so a BatchNorm layer in training mode never
sees the global batch at once. ``gems.Engine(..., batch_norm=...)`` (``--batch-norm``) says
what it does instead:

``"micro-batch"`` (default)
    PyTorch's own behaviour on every micro-batch: each micro-batch is normalised with its own
    statistics, and each copy of a layer updates its running mean/var (momentum as the
    layer's) and ``num_batches_tracked`` once per micro-batch it forwards, in its action
    list's order. At the step's sync the copies' running mean/var are averaged (arithmetic
    mean over the sync group, ``gems.pipeline.gradsync``); ``num_batches_tracked`` is not
    synced (every copy of a stage forwards as many micro-batches). So a stage's statistics
    after a step are the mean, over its copies, of m momentum updates -- except under ``mast``
    with odd K, whose middle position holds one copy of the middle stage that forwards both
    replicas' micro-batches: 2m updates per copy, and ``num_batches_tracked`` grows by 2m a
    step there, m elsewhere. The statistics therefore depend on K, m and D.
``"deferred"``
    torchgpipe's DeferredBatchNorm: each micro-batch is still normalised with its own
    statistics, but nothing is written during the step; every copy accumulates per channel
    Σx, Σx² and the element count (float64) over the micro-batches it forwards; at the sync
    the sums are added over the sync group -- every copy of the stage, the same ranks the
    gradients are summed over -- and after an applied step every copy updates its running
    statistics once, exactly as PyTorch would for one batch of the whole global batch
    (mean, unbiased variance, the layer's momentum, or the cumulative average when momentum
    is None; ``num_batches_tracked`` += 1). One rule for every stage, the middle one under
    ``mast`` with odd K included, and the result does not depend on K, m or D. Tiled layers
    (a spatial part, ``gems.spatial.norm.batch_norm``) normalise with their whole images'
    statistics, which the group's first tile adds to the sums (each tile holds the same): the
    sums of a tiled stage's tiled units are added over every tile of every copy, those of the
    leader's untiled units over the leaders (``gems.pipeline.gradsync``'s parts).
``"frozen"``
    Every BatchNorm layer in eval mode: normalised with its running statistics, which are
    never updated (affine parameters still train) -- the fine-tuning setting. A forward
    pre-hook puts each layer back in eval mode, so a later ``train()`` cannot unfreeze it.
    Training is then independent of how the batch is split.

Layers in eval mode (the user's choice) keep PyTorch's behaviour under every mode, and so do
layers built with ``track_running_stats=False``. A step that is not applied (loss not finite)
leaves no trace: deferred sums are dropped, and ``gems.pipeline.gradsync`` restores what the
micro-batch mode wrote.

Recomputation: a checkpointed segment's forward runs again during backward, on scratch copies
of its buffers (``gems.pipeline.stage``); a deferred layer finds its ``recomputing`` flag raised
then (``gems.pipeline.stage.RECOMPUTING``), and counts nothing. A flag, not the identity of its
running mean: a compiled unit (``gems.pipeline.compiled``) is guarded on the flag's value, while
torch.compile does not tell a buffer from a copy of it.
"""
from __future__ import annotations

import functools
from typing import Iterable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from gems.errors import GemsError
from gems.pipeline.stage import RECOMPUTING

MODES = ("micro-batch", "deferred", "frozen")


def check_mode(mode: str) -> None:
    """GemsError unless ``mode`` is one of ``MODES``."""
    if mode not in MODES:
        raise GemsError(f"batch_norm must be 'micro-batch' (per micro-batch statistics), 'deferred' (running "
                        f"statistics of the whole step) or 'frozen' (eval mode), got {mode!r}")


class BatchNorms:
    """The BatchNorm layers of the stages a rank holds (``stages``: their modules), under ``mode``.

    Installs the mode on the layers (deferred: a forward of its own per layer; frozen: eval mode
    and a pre-hook keeping it), and for deferred owns the step's sums: ``begin_step`` clears
    them, ``sync`` adds them over a sync group, ``update`` writes the running statistics."""

    def __init__(self, stages: Iterable[nn.Module], mode: str, device: torch.device) -> None:
        layers = [m for s in stages for m in s.modules() if isinstance(m, _BatchNorm)]
        if mode == "frozen":
            for layer in layers:
                layer.eval()
                layer.register_forward_pre_hook(_stay_in_eval)
        self._deferred = [m for m in layers if m.track_running_stats] if mode == "deferred" else []
        sizes = [2 * m.num_features + 1 for m in self._deferred]   # Σx, Σx², count
        self.sums = torch.zeros(sum(sizes), dtype=torch.float64, device=device)
        self._views = list(torch.split(self.sums, sizes)) if sizes else []
        self._counts_at = torch.tensor(sizes, dtype=torch.long, device=device).cumsum(0) - 1
        for layer, view in zip(self._deferred, self._views):
            # a tiled layer (gems.spatial.norm.batch_norm) adds its whole images' statistics through this
            setattr(layer, RECOMPUTING, False)   # raised while a segment holding it is recomputed
            layer.deferred_sums = functools.partial(_add, layer, view)
            layer.forward = functools.partial(_deferred_forward, layer, layer.deferred_sums)
        kept = layers if mode == "frozen" else self._deferred
        # Running statistics kept identical across copies by the mode itself (never written, or
        # written from the same summed statistics), so the gradient bucket must not average them.
        self.kept_buffers = [b for m in kept for b in (m.running_mean, m.running_var) if b is not None]

    def begin_step(self) -> None:
        """Forget sums from outside a step (a forward run by hand)."""
        self.sums.zero_()

    def sync(self, comm, group) -> None:
        """Add the deferred sums over ``group`` (the stage's copies; None: this rank holds the
        only copy). COLLECTIVE over the group when the mode is deferred."""
        if self._deferred and group is not None:
            comm.allreduce(self.sums, group, "the BatchNorm statistics allreduce")

    @torch.no_grad()
    def update(self) -> None:
        """Write each deferred layer's running statistics from the step's sums, as PyTorch's
        BatchNorm does for one batch; a layer that forwarded nothing this step is left alone."""
        counts = self.sums[self._counts_at].tolist()   # one device-to-host copy per step
        for layer, view, count in zip(self._deferred, self._views, counts):
            if count == 0:
                continue
            c = layer.num_features
            mean = view[:c] / count
            var = (view[c:2 * c] - count * mean * mean) / (count - 1)   # unbiased, as PyTorch keeps it
            layer.num_batches_tracked.add_(1)
            factor = layer.momentum if layer.momentum is not None else 1.0 / float(layer.num_batches_tracked)
            for buffer, new in ((layer.running_mean, mean), (layer.running_var, var)):
                buffer.copy_(buffer.double() * (1 - factor) + new * factor)


def _stay_in_eval(layer: nn.Module, args: tuple) -> None:
    layer.eval()


def _deferred_forward(layer: _BatchNorm, add, x: torch.Tensor) -> torch.Tensor:
    """``layer``'s forward under the deferred mode: the micro-batch's own statistics normalise
    it, and land in the step's sums (``add``: ``_add``) instead of the running statistics."""
    if not layer.training:
        return type(layer).forward(layer, x)
    layer._check_input_dim(x)
    # With momentum 1 the kernel leaves exactly the batch's mean and unbiased variance in these
    # scratch tensors: the statistics come from the pass that normalises, at no extra cost.
    mean, var = torch.zeros_like(layer.running_mean), torch.ones_like(layer.running_var)
    y = nn.functional.batch_norm(x, mean, var, layer.weight, layer.bias, True, 1.0, layer.eps)
    add(mean, var, x.numel() // layer.num_features)
    return y


@torch.no_grad()
def _add(layer: _BatchNorm, sums: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, n: int) -> None:
    """Add a batch of ``n`` values per channel with ``mean`` and unbiased ``var`` to ``sums`` (Σx,
    Σx², count) -- unless ``layer`` is being recomputed (stage.py raises its ``RECOMPUTING`` flag
    then), whose batch was counted by its first forward."""
    if getattr(layer, RECOMPUTING):
        return
    c = layer.num_features
    mean, var = mean.double(), var.double()
    sums[:c] += n * mean
    sums[c:2 * c] += n * mean * mean + (n - 1) * var
    sums[2 * c] += n
