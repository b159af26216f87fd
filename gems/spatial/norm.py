"""Normalisation on tiles: BatchNorm2d and GroupNorm with the statistics of the whole images.

Each tile sums its Σx and Σx² per channel (or per sample and group), the sums are added over the
tile group (``TileGroup.sum_``, float64), and PyTorch's own fused kernels normalise
with them; backward takes each tile's Σdy and Σdy·x̂ the same way. Only what PyTorch's formula
needs evaluated with statistics of several tiles is written here (``_input_grad``).
"""
from __future__ import annotations

import torch
from torch import nn

from gems.plan import formats
from gems.spatial.tiles import TileGroup


def batch_norm(x, tiles, size, module: nn.BatchNorm2d):
    """Training-mode BatchNorm2d with statistics of the whole images (every tile), and PyTorch's
    update of the running statistics -- or, for a layer under gems's deferred mode (its
    ``deferred_sums``, ``gems.pipeline.batchnorm``), the statistics added to the step's sums by
    the group's first tile alone (the others hold the same; the sums are added over every tile);
    eval mode is per pixel and runs the module itself."""
    if not (module.training or module.running_mean is None):
        return module(x)
    deferred = getattr(module, "deferred_sums", None)
    tracked = module.training and module.track_running_stats
    factor = 0.0
    if tracked and deferred is None:
        module.num_batches_tracked.add_(1)
        factor = 1.0 / float(module.num_batches_tracked) if module.momentum is None else module.momentum
    n = x.shape[0] * size[0] * size[1]
    y, mean, var = _BatchNorm.apply(x, module.weight, module.bias, tiles, n, module.eps)
    unbiased = n / max(n - 1, 1)
    if deferred is not None:
        if tiles.index == 0:
            deferred(mean, var * unbiased, n)
    elif tracked:   # (mean and var take no gradient: these record nothing)
        module.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        module.running_var.mul_(1 - factor).add_(var, alpha=factor * unbiased)
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
        return _normalise(x, mean, var, weight, bias, eps), mean, var

    @staticmethod
    def backward(ctx, grad, _mean, _var):
        x, weight, mean, var = ctx.saved_tensors
        if grad is None:   # (the output unused: its statistics' gradients still go round the group)
            grad = torch.zeros_like(x)
        gx, dw, db = _tile_input_grad(grad, x, weight, mean, var, ctx.tiles, ctx.n, ctx.eps, ctx.layer)
        return gx, (dw if ctx.needs_input_grad[1] else None), (db if ctx.needs_input_grad[2] else None), \
            None, None, None


# Each layer of a tile runs the functions below once per step, forward and backward, on vectors of
# a few hundred values at most: what they cost is the operations' count (a few microseconds each on
# CPU, a launch each on a GPU), so each takes the fewest -- in place where nothing else holds the
# tensor, views by ``unbind`` -- not the clearest formula.

def _normalise(x, mean, var, weight, bias, eps: float) -> torch.Tensor:
    """PyTorch's fused eval-mode normalisation of ``x`` with the statistics given."""
    return torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, torch.backends.cudnn.enabled)


def _tile_stats(x: torch.Tensor, tiles: TileGroup, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance per channel (dim 1) of ``x`` over every tile (``n`` elements in all):
    each tile's Σx and Σx² (``_tile_sums``), added over the tiles in float64."""
    sums = tiles.sum_(_tile_sums(x), "a tile group's statistics", f"stats {tiles.layer}").div_(n)
    mean, square = sums.unbind()
    square.addcmul_(mean, mean, value=-1).clamp_min_(0)   # E[x²] - E[x]², the biased variance
    return sums.to(x.dtype).unbind()


# Σx² - (Σx)²/count in float32 loses as many digits as Σx²/count exceeds the variance: taken only
# where that factor is at most this (a relative error of the variance around 1e-6)
SPREAD = 9.0


def _tile_sums(x: torch.Tensor) -> torch.Tensor:
    """(Σx, Σx²) per channel (dim 1) of this tile, float64 (2, C). Where each channel's values lie
    in one run of memory (one sample, on CPU), two vectorised reductions of the rows: 4-8x faster
    than the fused pass of PyTorch's training-mode BatchNorm on CPU -- GroupNorm's (1, N x G, rest)
    view above all --, the channels whose mean dwarfs their deviation (``SPREAD``) summed again about
    that mean (``_about_mean``). Otherwise that fused pass (~5x faster than torch.var_mean on CPU),
    its Σx² rebuilt as count x (var + mean²): exact enough in float64 whatever the mean."""
    count = x.numel() // x.shape[1]
    if x.shape[0] == 1 and x.is_contiguous() and x.device.type == "cpu" and x.dtype in (torch.float32,
                                                                                         torch.float64):
        rows = x.view(x.shape[1], -1)
        total, square = rows.sum(1), torch.linalg.vector_norm(rows, 2, 1).square_()
        # each channel's (Σx)² x SPREAD <= Σx² x count x (SPREAD - 1); false for NaN too
        close = torch.addcmul(square, total, total, value=-SPREAD / ((SPREAD - 1) * count)) >= 0
        sums = torch.stack([total, square]).double()
        if not bool(close.all()):
            _about_mean(rows, sums, (~close).nonzero().flatten())
        return sums
    mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
    mean = mean.double()
    return torch.stack([mean * count, var.double().addcmul_(mean, mean).mul_(count)])


def _about_mean(rows: torch.Tensor, sums: torch.Tensor, channels: torch.Tensor) -> None:
    """``sums``' (Σx, Σx²) of ``channels`` (rows of ``rows``) again, from the values less c, their
    mean by the first sums rounded to ``rows``' dtype: Σx = count x c + Σ(x - c), Σx² = Σ(x - c)²
    + 2c Σ(x - c) + count x c², in float64. The sums about c lose nothing to the mean, in a pass over
    those channels alone, where PyTorch's fused pass would read every channel again for a few: in
    resnet18 on a 256 x 512 image, 13 of 64 channels of one layer, 2 and 4 of 128 of two more, and
    this tile's sums of 64 x 64 x 128 with 13 such channels took 0.58 ms against 1.9."""
    count = rows.shape[1]
    shift = sums[0, channels].div(count).to(rows.dtype)
    apart = rows.index_select(0, channels).sub_(shift[:, None])
    c, total = shift.double(), apart.sum(1).double()
    square = torch.linalg.vector_norm(apart, 2, 1).double().square_()
    sums[0, channels] = total.add(c, alpha=count)
    sums[1, channels] = square.addcmul_(c, total, value=2).addcmul_(c, c, value=count)


def _tile_input_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor,
                     var: torch.Tensor, tiles: TileGroup, n: int, eps: float, layer: str):
    """(dx, Σ dy·x̂, Σ dy) of a normalisation per channel (dim 1) with statistics over every tile:
    PyTorch's eval-mode backward gives this tile's sums (``_sums``), added over the tiles they
    make dx (``_input_grad``)."""
    grad, invstd = formats.dense(grad), torch.rsqrt(var + eps)
    dw, db = _sums(grad, x, mean, var, invstd, eps)
    means = tiles.sum_(torch.stack([db, dw]), "a tile group's statistics' gradient", f"stats-grad {layer}").div_(-n)
    scale = invstd if weight is None else invstd * weight
    return _input_grad(grad, x, mean, var, eps, scale, scale, *means.unbind()), dw, db


def _sums(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, invstd: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ dy·x̂, Σ dy) per channel (dim 1) of this tile, in one fused pass: PyTorch's eval-mode
    BatchNorm backward (no weight: it scales only the input's gradient). The statistics go in as
    both the running and the saved ones: the CPU kernel's eval mode reads the running pair, CUDA's
    reads the saved mean and inverse deviation whenever it reduces (it asserts they are given)."""
    _, dw, db = torch.ops.aten.native_batch_norm_backward(grad, x, None, mean, var, mean, invstd, False, eps,
                                                          [False, True, True])
    return dw, db


def _input_grad(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float,
                a: torch.Tensor, r: torch.Tensor, t0: torch.Tensor, t1: torch.Tensor) -> torch.Tensor:
    """dx = a·dy + r·(t0 + x̂·t1) per channel (dim 1), x̂ = (x - mean)/sqrt(var + eps): a normalisation's
    input gradient, with ``a`` = invstd x the weight, ``t0`` and ``t1`` minus the means of dy and dy·x̂
    over the channel's statistics' elements, ``r`` = ``a`` (BatchNorm); or with ``t0``, ``t1``
    minus those of weight·dy, weight·dy·x̂, ``r`` = invstd (GroupNorm: several channels' statistics).
    r·(t0 + x̂·t1) is PyTorch's eval-mode normalisation of x with weight r·t1 and bias r·t0: one
    fused, vectorised pass into a new tensor, then a·dy added in place. (torch.addcmul with
    per-channel operands broadcast over the image ran at half that speed on CPU: for 64 channels of
    128 x 256, 6.5 ms against 3.5 for the whole input gradient.)"""
    view = (1, -1) + (1,) * (x.dim() - 2)
    return _normalise(x, mean, var, torch.mul(r, t1), torch.mul(r, t0), eps).addcmul_(grad, a.view(view))


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
        y = _normalise(x.reshape(1, N * C, -1), per(mean), per(var), None if weight is None else weight.repeat(N),
                       None if bias is None else bias.repeat(N), eps)
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
        invstd = per(torch.rsqrt(var + ctx.eps))   # per (sample, channel), as the rest here
        dw, db = _sums(grad2, x2, per(mean), per(var), invstd, ctx.eps)
        w = torch.ones_like(dw) if weight is None else weight.repeat(N)
        sums = torch.stack([(w * db).view(N, G, -1).sum(2), (w * dw).view(N, G, -1).sum(2)]).view(2, N * G)
        means = ctx.tiles.sum_(sums, "a tile group's statistics' gradient", f"stats-grad {ctx.layer}").div_(-ctx.n)
        gx = _input_grad(grad2, x2, per(mean), per(var), ctx.eps, invstd * w, invstd,
                         *(per(t) for t in means.unbind())).reshape(x.shape)   # means: per (sample, group)
        gw = dw.view(N, C).sum(0) if weight is not None and ctx.needs_input_grad[1] else None
        gb = db.view(N, C).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None, None, None


def _per_channel(N: int, C: int, groups: int):
    """(N x groups,) values of each (sample, group) -> (N x C,) of each (sample, channel)."""
    return lambda v: v.view(N, groups, 1).expand(N, groups, C // groups).reshape(N * C)
