"""Normalisation on tiles: BatchNorm2d and GroupNorm with the statistics of the whole images.

Each tile sums its Σx and Σx² per channel (or per sample and group), the sums are added over the
tile group (``gems.spatial.tiles.allreduce``, float64), and PyTorch's own fused kernels normalise
with them; backward takes each tile's Σdy and Σdy·x̂ the same way. Only what PyTorch's formula
needs evaluated with statistics of several tiles is written here (``_input_grad``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gems.plan import formats
from gems.spatial.tiles import TileGroup, allreduce


def batch_norm(x, tiles, size, module: nn.BatchNorm2d):
    """Training-mode BatchNorm2d with statistics of the whole images (every tile), and PyTorch's
    update of the running statistics -- or, for a layer under gems's deferred mode (its
    ``deferred_sums``, ``gems.pipeline.batchnorm``), the statistics added to the step's sums by
    the group's first tile alone (the others hold the same; the sums are added over every tile);
    eval mode is per pixel and runs the module itself."""
    if not (module.training or module.running_mean is None):
        return module(x)
    deferred = getattr(module, "deferred_sums", None)
    factor = 0.0
    if module.training and module.track_running_stats and deferred is None:
        module.num_batches_tracked.add_(1)
        factor = 1.0 / float(module.num_batches_tracked) if module.momentum is None else module.momentum
    n = x.shape[0] * size[0] * size[1]
    y, mean, var = _BatchNorm.apply(x, module.weight, module.bias, tiles, n, module.eps)
    if deferred is not None:
        if tiles.index == 0:
            deferred(mean, var * (n / max(n - 1, 1)), n)
    elif module.training and module.track_running_stats:
        with torch.no_grad():
            module.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
            module.running_var.mul_(1 - factor).add_(var * (n / max(n - 1, 1)), alpha=factor)
    return y


class _BatchNorm(torch.autograd.Function):
    """BatchNorm over a tile group, keeping only its input for backward as PyTorch's does.

    Forward: statistics over every tile (``_tile_stats``), then PyTorch's fused normalisation with
    them. Backward: ``_tile_input_grad``; this tile's Σdy and Σdy·x̂ are the weight's and bias's
    gradients, summed over the tiles later by the gradient sync."""

    @staticmethod
    def forward(ctx, x, weight, bias, tiles: TileGroup, n: int, eps: float):
        mean, var = _tile_stats(x, tiles, n)
        ctx.save_for_backward(x, weight, mean, var)
        ctx.tiles, ctx.n, ctx.eps, ctx.layer = tiles, n, eps, tiles.layer
        ctx.mark_non_differentiable(mean, var)
        ctx.set_materialize_grads(False)   # no zero gradients made for the statistics, which take none
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps), mean, var

    @staticmethod
    def backward(ctx, grad, _mean, _var):
        x, weight, mean, var = ctx.saved_tensors
        if grad is None:   # (the output unused: its statistics' gradients still go round the group)
            grad = torch.zeros_like(x)
        gx, dw, db = _tile_input_grad(grad, x, weight, mean, var, ctx.tiles, ctx.n, ctx.eps, ctx.layer)
        return gx, (dw if ctx.needs_input_grad[1] else None), (db if ctx.needs_input_grad[2] else None), \
            None, None, None


def _tile_stats(x: torch.Tensor, tiles: TileGroup, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance per channel (dim 1) of ``x`` over every tile (``n`` elements in all):
    each tile's Σx and Σx² (``_tile_sums``), added over the tiles in float64."""
    sums = allreduce(_tile_sums(x), tiles, f"stats {tiles.layer}") / n
    return sums[0].to(x.dtype), (sums[1] - sums[0].square()).clamp_min(0).to(x.dtype)


# Σx² - (Σx)²/count in float32 loses as many digits as Σx²/count exceeds the variance: taken only
# where that factor is at most this (a relative error of the variance around 1e-6)
SPREAD = 9.0


def _tile_sums(x: torch.Tensor) -> torch.Tensor:
    """(Σx, Σx²) per channel (dim 1) of this tile, float64 (2, C). Where each channel's values lie
    in one run of memory (one sample, on CPU), two vectorised reductions of the rows: 4-8x faster
    than the fused pass of PyTorch's training-mode BatchNorm on CPU -- GroupNorm's (1, N x G, rest)
    view above all -- unless the mean dwarfs the deviation (``SPREAD``). Otherwise that fused pass
    (~5x faster than torch.var_mean on CPU), its Σx² rebuilt as count x (var + mean²): exact enough
    in float64 whatever the mean."""
    count = x.numel() // x.shape[1]
    if x.shape[0] == 1 and x.is_contiguous() and x.device.type == "cpu" and x.dtype in (torch.float32,
                                                                                         torch.float64):
        rows = x.view(x.shape[1], -1)
        sums = torch.stack([rows.sum(1), torch.linalg.vector_norm(rows, 2, 1).square()])
        if bool((sums[0].square() * SPREAD <= sums[1] * count * (SPREAD - 1)).all()):
            return sums.double()
    mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
    return torch.stack([mean.double() * count, (var.double() + mean.double().square()) * count])


def _tile_input_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor,
                     var: torch.Tensor, tiles: TileGroup, n: int, eps: float, layer: str):
    """(dx, Σ dy·x̂, Σ dy) of a normalisation per channel (dim 1) with statistics over every tile:
    PyTorch's eval-mode backward gives this tile's sums (``_sums``), added over the tiles they
    make dx (``_input_grad``)."""
    ones = torch.ones_like(mean) if weight is None else weight
    invstd = torch.rsqrt(var + eps)
    dw, db = _sums(grad, x, mean, var, invstd, eps)
    total = allreduce(torch.stack([db, dw]), tiles, f"stats-grad {layer}") / n   # mean(dy), mean(dy·x̂) per channel
    return _input_grad(grad, x, mean, invstd, ones, ones * total[0], ones * total[1]), dw, db


def _sums(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, invstd: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ dy·x̂, Σ dy) per channel (dim 1) of this tile, in one fused pass: PyTorch's eval-mode
    BatchNorm backward. The statistics go in as both the running and the saved ones: the CPU
    kernel's eval mode reads the running pair, CUDA's reads the saved mean and inverse deviation
    whenever it reduces (it asserts they are given)."""
    _, dw, db = torch.ops.aten.native_batch_norm_backward(formats.dense(grad), x, torch.ones_like(mean), mean, var,
                                                          mean, invstd, False, eps, [False, True, True])
    return dw, db


def _input_grad(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                weight: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor) -> torch.Tensor:
    """dx = invstd·(weight·dy - m1 - x̂·m2) per channel (dim 1), ``m1``, ``m2`` the means of
    weight·dy and weight·dy·x̂ over the channel's statistics' elements: a·dy + b·x + c, two fused
    passes into one new tensor."""
    a = invstd * weight
    b = -invstd * invstd * m2               # coefficient of x
    c = -invstd * m1 - b * mean             # the rest
    view = (1, -1) + (1,) * (x.dim() - 2)
    return torch.addcmul(c.view(view), x, b.view(view)).addcmul_(grad, a.view(view))


def group_norm(x, tiles, size, num_groups: int, weight=None, bias=None, eps: float = 1e-5):
    """F.group_norm with each group's mean and variance over the whole image (``_GroupNorm``)."""
    n = (x.shape[1] // num_groups) * size[0] * size[1]
    return _GroupNorm.apply(x, weight, bias, tiles, num_groups, n, eps)


class _GroupNorm(torch.autograd.Function):
    """GroupNorm over a tile group, keeping only its input for backward as PyTorch's does (a
    composition of tensor ops would keep the centred and the normalised tile too).

    Statistics: each (sample, group) is one channel of ``x`` viewed as (1, N x G, rest), so they
    are ``_BatchNorm``'s on that view (PyTorch's fused statistics per tile, added over the tiles).
    The rest works on ``x`` viewed as (1, N x C, rest), each (sample, channel) one channel with
    its group's statistics and its channel's weight: forward normalises and scales in one pass;
    backward takes this tile's Σ dy·x̂ and Σ dy per (sample, channel) in one (``_sums``) -- summed
    over the samples, the weight's and bias's gradients (added over the tiles later by the
    gradient sync); weighted and summed over each group and the tiles, the input gradient's means
    (``_input_grad``, two passes)."""

    @staticmethod
    def forward(ctx, x, weight, bias, tiles: TileGroup, groups: int, n: int, eps: float):
        N, C = x.shape[:2]
        mean, var = _tile_stats(x.reshape(1, N * groups, -1), tiles, n)
        per = _per_channel(N, C, groups)
        y = F.batch_norm(x.reshape(1, N * C, -1), per(mean), per(var), None if weight is None else weight.repeat(N),
                         None if bias is None else bias.repeat(N), False, 0.0, eps)
        y = y.reshape(x.shape).detach()   # not a view of the kernel's result: the next layer may change it in place
        ctx.save_for_backward(x, weight, mean, var)
        ctx.tiles, ctx.groups, ctx.n, ctx.eps, ctx.has_bias = tiles, groups, n, eps, bias is not None
        ctx.layer = tiles.layer
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, var = ctx.saved_tensors
        (N, C), G = x.shape[:2], ctx.groups
        per = _per_channel(N, C, G)
        x2, grad2 = x.reshape(1, N * C, -1), formats.dense(grad).reshape(1, N * C, -1)
        invstd = torch.rsqrt(var + ctx.eps)
        dw, db = _sums(grad2, x2, per(mean), per(var), per(invstd), ctx.eps)   # per (sample, channel)
        w = torch.ones_like(dw) if weight is None else weight.repeat(N)
        sums = torch.stack([(w * db).view(N, G, -1).sum(2), (w * dw).view(N, G, -1).sum(2)]).view(2, N * G)
        total = allreduce(sums, ctx.tiles, f"stats-grad {ctx.layer}") / ctx.n   # per (sample, group)
        gx = _input_grad(grad2, x2, per(mean), per(invstd), w, per(total[0]), per(total[1])).reshape(x.shape)
        gw = dw.view(N, C).sum(0) if weight is not None and ctx.needs_input_grad[1] else None
        gb = db.view(N, C).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None, None, None


def _per_channel(N: int, C: int, groups: int):
    """(N x groups,) values of each (sample, group) -> (N x C,) of each (sample, channel)."""
    return lambda v: v.view(N, groups, 1).expand(N, groups, C // groups).reshape(N * C)
