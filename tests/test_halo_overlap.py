"""The forward that computes a tile's interior while its halo travels (``gems.spatial.window``) equals
the forward that waits for the halo first, output, kept indices and gradients (1e-6), and the
geometry that decides which rows are interior (``gems.spatial.geometry.Sliding``); a max pooling in NHWC
blocks equals PyTorch's NCHW one.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gems.comm import loopback
from gems.spatial import TileGroup, window
from gems.spatial.geometry import Sliding
from gems.spatial.ops import halos

pytestmark = pytest.mark.timeout(60)


def test_interior_rows_read_only_the_tile_or_the_padding():
    w = Sliding(3, 1, 1)
    assert w.inner((0, 8), (0, 8), 16) == (0, 7)       # the first tile: the image's padding above is its own
    assert w.inner((8, 16), (8, 16), 16) == (9, 16)
    assert w.inner((4, 8), (4, 8), 16) == (5, 7)
    s = Sliding(7, 2, 3)                                  # resnet's stem: rows 128.. from input rows 256..
    assert s.inner((128, 256), (256, 512), 512) == (130, 256) and s.alone((128, 256), (256, 512))
    assert not Sliding(3, 2, 1).alone((3, 5), (5, 9))    # an output row 3 would start at input row 6, not 5
    assert Sliding(3, 1, 1).inner((0, 1), (0, 1), 4) == (0, 0)   # a one-row tile has no interior


def _both(kind, grid, size, kernel=3, stride=1, pad=1, dilation=1, channels=2, filters=6):
    """A convolution (``kind`` "conv") or max pooling on tiles, with the interior first and with the
    halo first: per rank (largest difference of outputs and gradients, whether the interior ran first)."""
    P = grid[0] * grid[1]
    torch.manual_seed(0)
    x = torch.randn(2, channels, *size, dtype=torch.float64)
    weight = torch.randn(filters, channels, kernel, kernel, dtype=torch.float64)
    size_out = tuple((n + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1 for n in size)
    geometry = ((kernel, kernel), (stride, stride), (pad, pad), (dilation, dilation))

    def rank(comm):
        tiles = TileGroup(comm, list(range(P)), grid, comm.rank, comm.group(list(range(P))))
        fill = 0.0 if kind == "conv" else -math.inf
        found, own = halos(tiles, size, size_out, *geometry, fill)
        found = tuple(h for h in found if not h.trivial(tiles))
        op = window.Conv(geometry[1], own, geometry[3], 1) if kind == "conv" else \
            window.MaxPool(geometry[0], geometry[1], own, geometry[3])
        results = []
        for hs in (found, tuple(dataclasses.replace(h, window=None) for h in found)):
            tile = tiles.tile(x).clone().requires_grad_()
            w = weight.clone().requires_grad_()
            y = window.window(tile, tiles, list(hs), op, w if kind == "conv" else None)
            if kind != "conv":
                y = y * w.sum()
            y.backward(torch.arange(y.numel(), dtype=y.dtype).view(y.shape).sin())
            results.append((y.detach(), tile.grad, w.grad))
        worst = max(float((a - b).abs().max()) for a, b in zip(*results))
        return worst, _splits(op, found, tiles, tiles.tile(x), weight if kind == "conv" else None)

    return loopback.run(P, rank, semantics="nccl", timeout=30.0)


def _splits(op, found, tiles, x, weight) -> bool:
    """Whether the window can compute the tile alone while its halo travels."""
    return window._alone(op, found, tiles) is not None and (
        window.alone_cheaper(min(x.shape[h.dim] for h in found), None if weight is None else weight.shape[0])
        or window.worth_alone(window._outputs(x, op), None if weight is None else weight[0].numel()))


@pytest.mark.parametrize("kind, kernel, stride, pad, dilation",
                         [("conv", 3, 1, 1, 1), ("conv", 3, 2, 1, 1), ("conv", 3, 1, 2, 2), ("conv", 5, 2, 2, 1),
                          ("pool", 3, 2, 1, 1)], ids=["conv", "strided", "dilated", "stem", "maxpool"])
@pytest.mark.parametrize("grid", [(2, 1), (1, 2), (2, 2), (3, 1)])
def test_the_interior_first_equals_the_halo_first(kind, kernel, stride, pad, dilation, grid):
    for worst, split in _both(kind, grid, (20 * grid[0], 12 * grid[1]), kernel, stride, pad, dilation):
        assert split and worst < 1e-6


def test_a_small_tile_of_many_filters_computes_alone_and_takes_its_border_gradients_apart():
    # 20 rows for 64 filters: the region would cost less forward, but 20x12 outputs per channel against
    # 2 x 3 x 3 weights per filter make alone worth it; backward: the border's gradients apart cost less
    for worst, split in _both("conv", (2, 1), (40, 12), filters=64):
        assert split and worst < 1e-6


def test_a_tile_without_interior_waits_for_its_halo():
    # tiles of one row: every output row reads a neighbour's
    for worst, split in _both("conv", (4, 1), (4, 6)):
        assert not split and worst == 0.0


def test_a_small_tile_of_a_wide_convolution_waits_for_its_halo():
    # 6x8 outputs per channel against 32 x 3 x 3 weights per filter, 64 filters on 6 rows: the border's
    # convolutions would cost more
    for worst, split in _both("conv", (2, 1), (12, 8), channels=32, filters=64):
        assert not split and worst == 0.0
    assert window.worth_alone(64 * 128, 64 * 9) and not window.worth_alone(8 * 16, 512 * 9)
    assert window.alone_cheaper(256, 64) and not window.alone_cheaper(64, 256)
    assert window.border_first(64 * 128, 64 * 9) and not window.border_first(32 * 64, 128 * 9)


def test_a_max_pooling_in_nhwc_blocks_equals_pytorchs_nchw_one():
    """A region large enough pools in NHWC blocks of channels (``window.nhwc_block``; 20 channels: two
    blocks of 8 and one of 4): the same values and indices as PyTorch's NCHW kernel, ReLU's tied
    zeros and NaN included."""
    torch.manual_seed(0)
    x = torch.randn(2, 20, 130, 128).relu()
    x[1, 17, 50, 51:53] = math.nan
    op = window.MaxPool((3, 3), (2, 2), (1, 1), (1, 1))
    assert window.nhwc_block(x, (3, 3)) == window.NHWC_CHANNELS
    assert not window.nhwc_block(x[:, :4], (3, 3)) and not window.nhwc_block(x, (2, 2))
    y, (indices,) = op.forward(x, None, None)
    expected, expected_indices = torch.ops.aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1], [1, 1], False)
    assert torch.equal(y.nan_to_num(-1.0), expected.nan_to_num(-1.0)) and torch.equal(indices, expected_indices)
    assert y.is_contiguous() and indices.is_contiguous()
