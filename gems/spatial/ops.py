"""Layers on tiles: each computes this tile's part of its global output, exactly.

A handler takes the tiled input(s), the global (H, W) of its input and output, and the layer's
own settings, fetches the halo its window needs (``gems.spatial.halo``, ``gems.spatial.window``; the layer's
padding value outside the image) and runs the stock PyTorch function with padding 0 on the
fetched region, so no arithmetic is written by hand except where PyTorch's own formula must be
evaluated for one tile's output range (interpolation's source rows, normalisation statistics
summed over the tile group).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from gems.plan import formats
from gems.spatial.geometry import Sliding, parts, transposed_covers, transposed_need, window_need
from gems.spatial.halo import Halo, fetch, fetch_halo
from gems.spatial.tiles import TileGroup, allreduce
from gems.spatial.window import Conv, MaxPool, window

HW = tuple[int, int]
DIMS = (2, 3)


def _pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, (int, float)) else (int(v[0]), int(v[1]))


def _count(tiles: TileGroup, dim: int) -> int:
    return tiles.grid[0] if dim == 2 else tiles.grid[1]


def halos(tiles: TileGroup, size_in: HW, size_out: HW, kernel, stride, pad_lo, dilation=(1, 1),
          fill: float = 0.0, symmetric: bool = True) -> tuple[tuple[Halo, ...], tuple[int, int]]:
    """The halos a sliding window needs for this tile's output rows and columns, and the padding
    the window still applies itself: along an axis the grid does not cut, a ``symmetric`` padding
    stays the layer's own (no copy); along a cut one the halo replaces it. Worked out once per
    geometry (``TileGroup.memo``)."""
    key = ("halos", tuple(size_in), tuple(size_out), tuple(kernel), tuple(stride), tuple(pad_lo), tuple(dilation),
           fill, symmetric)
    return tiles.memo(key, _halos, tiles, size_in, size_out, kernel, stride, pad_lo, dilation, fill, symmetric)


def _halos(tiles: TileGroup, size_in: HW, size_out: HW, kernel, stride, pad_lo, dilation, fill: float,
           symmetric: bool) -> tuple[tuple[Halo, ...], tuple[int, int]]:
    pads, found = [0, 0], []
    for axis, dim in enumerate(DIMS):
        k, s, p, d = kernel[axis], stride[axis], pad_lo[axis], dilation[axis]
        if _count(tiles, dim) == 1 and symmetric:
            pads[axis] = p
            continue
        h = Halo.sliding(tiles, dim, size_in[axis], size_out[axis], Sliding(k, s, p, d), fill)
        # padded unlike at its two ends, a tile cannot start alone with the layer's padding (window._alone)
        found.append(h if symmetric else dataclasses.replace(h, window=None))
    return tuple(found), tuple(pads)


def conv_padding(padding, kernel: tuple[int, int], dilation: tuple[int, int]) -> tuple[int, int]:
    """Rows of padding before row 0 (and columns before column 0) of a Conv2d's ``padding``."""
    if padding == "valid":
        return 0, 0
    if padding == "same":
        return tuple(d * (k - 1) // 2 for k, d in zip(kernel, dilation))
    return _pair(padding)


def conv2d(x, tiles, size_in, size_out, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    kernel, stride, dilation = tuple(weight.shape[2:]), _pair(stride), _pair(dilation)
    pad = conv_padding(padding, kernel, dilation)
    symmetric = not isinstance(padding, str) or all(d * (k - 1) % 2 == 0 for k, d in zip(kernel, dilation))
    needed, own = halos(tiles, size_in, size_out, kernel, stride, pad, dilation, symmetric=symmetric)
    return window(x, tiles, needed, Conv(stride, own, dilation, groups), weight, bias)


def conv_transpose2d(x, tiles, size_in, size_out, weight, bias=None, stride=1, padding=0, output_padding=0,
                     groups=1, dilation=1):
    kernel, stride, pad, dilation = tuple(weight.shape[2:]), _pair(stride), _pair(padding), _pair(dilation)
    covers = []
    for axis, dim in enumerate(DIMS):
        outs = parts(size_out[axis], _count(tiles, dim))
        k, s, p, d, n = kernel[axis], stride[axis], pad[axis], dilation[axis], size_in[axis]
        want = lambda i, own, outs=outs, k=k, s=s, p=p, d=d, n=n: transposed_need(outs[i], n, k, s, p, d)  # noqa: E731
        x = fetch(x, tiles, dim, n, want)
        mine = outs[tiles.line(dim)[1]]
        covers.append((mine, transposed_covers(_need_of(tiles, dim, want, n), k, s, p, d)))
    y = F.conv_transpose2d(x, weight, None, stride, 0, 0, groups, dilation)
    # keep this tile's output rows: those the fetched inputs reach, then rows past the last
    # input's reach (output_padding) hold no contribution: zeros, before the bias
    for (mine, cover), dim in zip(covers, DIMS):
        lo, hi = max(mine[0], cover[0]), min(mine[1], cover[1])
        y = y.narrow(dim, lo - cover[0], max(hi - lo, 0))
        before, after = lo - mine[0], mine[1] - max(hi, lo)
        if before or after:
            pad_arg = (0, 0, before, after) if dim == 2 else (before, after)
            y = F.pad(y, pad_arg)
    return y if bias is None else y + bias.view(1, -1, 1, 1)


def _need_of(tiles: TileGroup, dim: int, want, size: int):
    members, me = tiles.line(dim)
    return want(me, parts(size, len(members))[me])


def max_pool2d(x, tiles, size_in, size_out, kernel_size, stride=None, padding=0, dilation=1,
               ceil_mode=False, return_indices=False):
    kernel = _pair(kernel_size)
    stride = _pair(stride) if stride not in (None, []) else kernel
    needed, own = halos(tiles, size_in, size_out, kernel, stride, _pair(padding), _pair(dilation), -math.inf,
                        symmetric=not ceil_mode)
    return window(x, tiles, needed, MaxPool(kernel, stride, own, _pair(dilation)))


def avg_pool2d(x, tiles, size_in, size_out, kernel_size, stride=None, padding=0, ceil_mode=False,
               count_include_pad=True, divisor_override=None):
    kernel = _pair(kernel_size)
    stride = _pair(stride) if stride not in (None, []) else kernel
    pad = _pair(padding)
    region = x
    for h in halos(tiles, size_in, size_out, kernel, stride, pad, symmetric=False)[0]:
        region = fetch_halo(region, tiles, h)
    total = F.avg_pool2d(region, kernel, stride, 0, divisor_override=1)
    if divisor_override:
        return total / divisor_override
    if count_include_pad or pad == (0, 0):
        return total / (kernel[0] * kernel[1])
    # divide by the window's pixels inside the image: pool a mask of them over the same region
    masks = []
    for axis, dim in enumerate(DIMS):
        out = parts(size_out[axis], _count(tiles, dim))[tiles.line(dim)[1]]
        lo, hi = window_need(out, kernel[axis], stride[axis], pad[axis])
        rows = torch.arange(lo, hi, device=x.device)
        masks.append(((rows >= 0) & (rows < size_in[axis])).to(x.dtype))
    mask = (masks[0][:, None] * masks[1][None, :])[None, None]
    return total / F.avg_pool2d(mask, kernel, stride, 0, divisor_override=1)


def _source(out: tuple[int, int], size_in: int, size_out: int, mode: str, align_corners, scale):
    """PyTorch's source rows and weights for output rows ``out`` of one axis (its upsample kernels'
    formulas, in float32 as they compute): [(rows, weight or None)] to sum."""
    o = torch.arange(*out, dtype=torch.float32)
    if mode == "nearest":
        if size_out == size_in:
            src = o.long()
        elif size_out == 2 * size_in:
            src = o.long() // 2
        else:
            factor = torch.tensor(1.0 / scale if scale else size_in / size_out, dtype=torch.float32)
            src = torch.clamp(torch.floor(o * factor).long(), max=size_in - 1)
        return [(src, None)]
    if size_out == size_in:
        return [(o.long(), None)]
    if align_corners:
        factor = (size_in - 1) / (size_out - 1) if size_out > 1 else 0.0
        real = o * torch.tensor(factor, dtype=torch.float32)
    else:
        factor = torch.tensor(1.0 / scale if scale else size_in / size_out, dtype=torch.float32)
        real = torch.clamp((o + 0.5) * factor - 0.5, min=0.0)
    first = real.long()
    nxt = first + (first < size_in - 1).long()
    lam = torch.clamp(real - first.float(), 0.0, 1.0)
    return [(first, 1.0 - lam), (nxt, lam)]


def interpolate(x, tiles, size_in, size_out, size=None, scale_factor=None, mode="nearest", align_corners=None,
                recompute_scale_factor=None, antialias=False):
    if isinstance(scale_factor, (int, float)) or scale_factor is None:
        scales = (scale_factor, scale_factor)
    else:
        scales = tuple(scale_factor)
    if size is not None or recompute_scale_factor:
        scales = (None, None)
    factors = [size_out[a] // size_in[a] if size_out[a] % size_in[a] == 0 else 0 for a in (0, 1)]
    native = mode in ("nearest", "bilinear") and not align_corners and not antialias and all(
        f and not f & (f - 1) and scales[a] in (None, f) for a, f in enumerate(factors))
    kept = []
    for axis, dim in enumerate(DIMS):
        # every tile's source rows and weights, once: the fetch needs each tile's reach
        every = [_source(out, size_in[axis], size_out[axis], "nearest" if mode == "nearest" else "linear",
                         align_corners, scales[axis]) for out in parts(size_out[axis], _count(tiles, dim))]
        reach = [(int(min(r.min() for r, _ in terms)), int(max(r.max() for r, _ in terms)) + 1) for terms in every]
        region = fetch(x, tiles, dim, size_in[axis], lambda i, own: reach[i])
        me = tiles.line(dim)[1]
        base = reach[me][0]
        if native:   # PyTorch's own kernel on the region below, then this tile's rows of its result
            x = region
            out = parts(size_out[axis], _count(tiles, dim))[me]
            kept.append((dim, out[0] - factors[axis] * base, out[1] - out[0]))
            continue
        result = None
        for rows, weight in every[me]:
            part = region.index_select(dim, (rows - base).to(x.device))
            if weight is not None:
                shape = [1, 1, 1, 1]
                shape[dim] = -1
                part = part * weight.to(x.device, x.dtype).view(shape)
            result = part if result is None else result + part
        x = result
    if native:
        # an upsampling by a power of two computes the same source rows and weights from any
        # region's first row (exact binary fractions), and the region holds every row this
        # tile's outputs read: the kernel on the region gives the tile's rows bit for bit
        x = F.interpolate(x, scale_factor=tuple(float(f) for f in factors), mode=mode,
                          align_corners=None if mode == "nearest" else align_corners)
        for dim, start, length in kept:
            if (start, length) != (0, x.shape[dim]):   # a whole axis stays as it is: its backward copies nothing
                x = x.narrow(dim, start, length)
    return x


def pad(x, tiles, size_in, size_out, pads, mode="constant", value=None):
    """F.pad of the last two axes (negative pads crop)."""
    pads = list(pads) + [0] * (4 - len(pads))
    return shift(x, tiles, size_in, size_out, (-pads[2], -pads[0]), 0.0 if value is None else float(value))


def crop(x, tiles, size_in, size_out, starts: tuple[int, int]):
    """A slice ``[start:start + size_out]`` of each spatial axis."""
    return shift(x, tiles, size_in, size_out, starts)


def shift(x, tiles, size_in, size_out, offsets: tuple[int, int], fill: float = 0.0):
    """Output row o is input row o + offset (per axis); rows outside the input hold ``fill``."""
    for axis, dim in enumerate(DIMS):
        outs = parts(size_out[axis], _count(tiles, dim))
        x = fetch(x, tiles, dim, size_in[axis],
                  lambda i, own, outs=outs, a=offsets[axis]: (outs[i][0] + a, outs[i][1] + a), fill)
    return x


def spatial_sum(x: torch.Tensor, tiles: TileGroup) -> torch.Tensor:
    """Σ over the image of each (N, C): this tile's sums added over the tile group (N, C, 1, 1)."""
    return allreduce(x.sum(DIMS, keepdim=True), tiles, f"sum {tiles.layer}")


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
