"""Where each tile lies and which input rows an output range needs: pure integer geometry.

Every tiled activation of global height H and width W is cut into an R x C grid: tile (i, j)
holds rows ``parts(H, R)[i]`` and columns ``parts(W, C)[j]`` (``parts``: near-equal ranges, the
larger ones last), whatever layer made it. An operation computes its own tile of the output;
the input it needs for that is one range per axis, found here from the operation's kernel,
stride, padding and dilation. Ranges are half-open ``(lo, hi)`` in global coordinates and may
reach outside ``[0, size)``: those rows are the operation's padding, filled, never fetched.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

Range = tuple[int, int]


@functools.lru_cache(maxsize=4096)   # a tile's layers ask for the same few cuts at every call
def parts(size: int, count: int) -> tuple[Range, ...]:
    """``count`` consecutive near-equal ranges covering ``[0, size)``: range t is
    ``[t*size//count, (t+1)*size//count)``, so no two differ by more than one row."""
    return tuple((t * size // count, (t + 1) * size // count) for t in range(count))


def intersect(a: Range, b: Range) -> Range | None:
    """The overlap of two ranges, None when empty."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def window_need(out: Range, kernel: int, stride: int, pad_lo: int, dilation: int = 1) -> Range:
    """Input rows a sliding window (convolution, pooling) reads for output rows ``out``, with
    ``pad_lo`` rows of padding before row 0: output row o reads input rows
    ``o*stride - pad_lo + d*k`` for k in 0..kernel-1."""
    lo, hi = out
    return lo * stride - pad_lo, (hi - 1) * stride - pad_lo + dilation * (kernel - 1) + 1


@dataclass(frozen=True)
class Sliding:
    """A sliding window along one axis, padded alike at both ends of the image: what ``window_need``
    takes, and which output rows a tile computes from its own rows alone."""

    kernel: int
    stride: int
    pad: int
    dilation: int = 1

    def need(self, out: Range) -> Range:
        return window_need(out, self.kernel, self.stride, self.pad, self.dilation)

    def inner(self, out: Range, own: Range, size: int) -> Range:
        """The rows of ``out`` whose windows read only rows of ``own`` or the image's padding
        (outside ``[0, size)``): those a tile computes before its halo arrives; may be empty."""
        lo, hi = out
        if own[0] > 0:
            lo = max(lo, -(-(own[0] + self.pad) // self.stride))
        if own[1] < size:
            hi = min(hi, (own[1] - 1 + self.pad - self.dilation * (self.kernel - 1)) // self.stride + 1)
        lo = min(lo, out[1])
        return lo, max(lo, hi)

    def alone(self, out: Range, own: Range) -> bool:
        """Whether the window on rows ``own`` alone, padded at both ends as the image is, makes
        exactly the output rows ``out``: its first output row is ``out``'s first, and as many."""
        length = own[1] - own[0]
        count = (length + 2 * self.pad - self.dilation * (self.kernel - 1) - 1) // self.stride + 1
        return own[0] == out[0] * self.stride and count == out[1] - out[0]


def transposed_need(out: Range, size: int, kernel: int, stride: int, pad: int, dilation: int = 1) -> Range:
    """Input rows (inside ``[0, size)``) a transposed convolution takes for output rows ``out``:
    input row i adds to output rows ``i*stride - pad + d*k``, k in 0..kernel-1."""
    lo, hi = out
    first = math.ceil((lo + pad - dilation * (kernel - 1)) / stride)
    last = (hi - 1 + pad) // stride
    return max(first, 0), min(last + 1, size)


def transposed_covers(need: Range, kernel: int, stride: int, pad: int, dilation: int = 1) -> Range:
    """Output rows that a transposed convolution of input rows ``need`` (padding 0) produces, in
    global output coordinates."""
    lo, hi = need
    return lo * stride - pad, (hi - 1) * stride - pad + dilation * (kernel - 1) + 1


def halo(size: int, count: int, out_size: int, kernel: int, stride: int, pad_lo: int,
         dilation: int = 1) -> int:
    """The most rows any tile of a sliding window's input needs beyond its own (for pricing)."""
    own, want = parts(size, count), parts(out_size, count)
    extra = 0
    for (a, b), out in zip(own, want):
        if out[0] >= out[1]:
            continue
        lo, hi = window_need(out, kernel, stride, pad_lo, dilation)
        extra = max(extra, max(0, a - max(lo, 0)) + max(0, min(hi, size) - b))
    return extra


def grids(count: int) -> list[tuple[int, int]]:
    """Every R x C grid of ``count`` tiles, strips first (count x 1, 1 x count)."""
    pairs = [(r, count // r) for r in range(1, count + 1) if count % r == 0]
    return sorted(pairs, key=lambda rc: (min(rc) != 1, rc[1]))

