"""Layers on tiles: each computes this tile's part of its global output, exactly.

A handler takes the tiled input(s), the global (H, W) of its input and output, and the layer's
own settings, fetches the halo its window needs (``gems.spatial.halo``, ``gems.spatial.window``; the layer's
padding value outside the image) and runs the stock PyTorch function with padding 0 on the
fetched region, so no arithmetic is written by hand except where PyTorch's own formula must be
evaluated for one tile's output range (interpolation's source rows). Normalisation, whose
statistics are summed over the tile group, is ``gems.spatial.norm``.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

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
