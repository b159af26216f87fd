"""Tiles of one image across ranks (gems.spatial): every tiled layer equals one process.

In-process (loopback ranks, NCCL semantics): the model's units up to ``end`` run tiled on a grid
of ranks, the leader gathers the boundary and runs the rest; the output on the leader and the
parameter gradients summed over the tile group must equal one process on the whole image (1e-5
relative), at sides that are not powers of two, on uneven tiles, on strips and 2-D grids.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gems.comm import loopback
from gems.errors import GemsError
from gems.graph import graph_units
from gems.spatial import TileGroup, flatten, norm, tile_stage
from gems.spatial.geometry import parts, transposed_need, window_need
from spatial_models import Everything, GroupNormNet

pytestmark = pytest.mark.timeout(120)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max().clamp_min(1e-12))


def _tiled_run(make, size: tuple[int, int], grid: tuple[int, int], end: int | None = None, batch: int = 2):
    """(output error, largest gradient error, running-statistics error) of the tiled run."""
    torch.manual_seed(0)
    x = torch.randn(batch, 3, *size)
    torch.manual_seed(1)
    ref = make()
    units = graph_units(ref, (3, *size), batch)
    P = grid[0] * grid[1]
    # every rank's copy of the traced model, made and flattened here, before the reference trains:
    # fx patches nn.Module process-wide while it traces
    copies = [copy.deepcopy((ref, units)) for _ in range(P)]
    for _, u in copies:
        for unit in u:
            flatten(unit)
    out = units(x)
    g = torch.randn_like(out)
    out.backward(g)
    end = len(units) if end is None else end

    def rank(comm):
        net, u = copies[comm.rank]
        group = comm.group(list(range(P)))
        tiles = TileGroup(comm, list(range(P)), grid, comm.rank, group)
        stage = tile_stage(u[0:len(u)], 0, end, u.unit_names, tiles, x.shape)
        o = stage(tiles.tile(x))
        error = None
        if tiles.leader:
            error = _relative(o, out)
            torch.autograd.backward(o, g)
        else:
            torch.autograd.backward(list(o))
        worst = 0.0
        for (name, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
            summed = p.grad.clone() if p.grad is not None else torch.zeros_like(p)   # the head: leader only
            comm.allreduce(summed, group, "gradients")
            worst = max(worst, _relative(summed, q.grad))
        stats = [(a - b).abs().max().item() for a, b in zip(net.buffers(), ref.buffers()) if a.is_floating_point()]
        return error, worst, max(stats, default=0.0)

    return loopback.run(P, rank, semantics="nccl")


@pytest.mark.parametrize("grid", [(2, 1), (1, 2), (2, 2), (4, 1), (3, 2)])
@pytest.mark.parametrize("size", [(36, 36), (37, 23)])
def test_every_layer_kind_equals_one_process(grid, size):
    results = _tiled_run(Everything, size, grid)
    assert results[0][0] < 1e-5
    for _, grads, stats in results:
        assert grads < 1e-5 and stats < 1e-6


class FarFromZero(nn.Module):
    """Normalisations of values far from zero on some channels (5 against deviations of about 0.6): a tile
    sums those channels' statistics (BatchNorm's; GroupNorm's first group) about their means."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.b, self.gn = nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8)
        self.register_buffer("far", torch.tensor([5.0, 5.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0]).view(1, 8, 1, 1))

    def forward(self, x):
        return self.gn(self.b(torch.relu(self.bn(self.a(x) + self.far))) - self.far)


@pytest.mark.parametrize("grid", [(2, 1), (1, 2)])
def test_statistics_of_channels_far_from_zero_equal_one_process(grid, monkeypatch):
    """One image (a tile's channels one run of memory each: the fast sums), the far channels summed about
    their means; as close to one process as the usual channels (PyTorch's own kernel alike: x - mean
    loses the same digits in float32 there)."""
    about, summed = [], norm._about_mean

    def counted(rows, sums, channels):
        about.append(len(channels))
        summed(rows, sums, channels)
    monkeypatch.setattr(norm, "_about_mean", counted)
    results = _tiled_run(FarFromZero, (24, 20), grid, batch=1)
    assert about, "no channel was summed about its mean"
    assert results[0][0] < 1e-5
    for _, grads, stats in results:
        assert grads < 1e-5 and stats < 1e-6


def _pool_unit(size: int) -> int:
    return next(i for i, n in enumerate(graph_units(GroupNormNet(), (3, size, size), 2).unit_names) if "adaptive" in n)


@pytest.mark.parametrize("grid", [(2, 1), (2, 2)])
@pytest.mark.parametrize("whole", [False, True])
def test_prefix_then_gather_equals_one_process(grid, whole):
    """The conv trunk tiled and the head on the leader alone (gathered before the pooling), or the
    whole model tiled (the pooling sums the tiles; the head runs on every rank, replicated)."""
    results = _tiled_run(GroupNormNet, (100, 100), grid, end=None if whole else _pool_unit(100))
    assert results[0][0] < 1e-5 and all(r[1] < 1e-5 for r in results)


class Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 2, 3), nn.Linear(2 * 10 * 10, 4)

    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))


def test_a_unit_that_mixes_pixels_is_named():
    units = graph_units(Flat(), (3, 12, 12), 1)
    tiles = TileGroup(None, [0], (1, 1), 0)
    with pytest.raises(GemsError, match=r"unit flatten cannot run on tiles: flatten turns an image into something "
                                        r"else; end the spatial part before unit flatten"):
        tile_stage(units[0:len(units)], 0, len(units), units.unit_names, tiles, (1, 3, 12, 12))


def test_a_grid_larger_than_a_tile_side_is_refused():
    units = graph_units(GroupNormNet(), (3, 12, 12), 1)
    end = _pool_unit(12)
    tiles = TileGroup(None, list(range(4)), (4, 1), 0)
    with pytest.raises(GemsError, match="larger than the tile side allows"):
        tile_stage(units[0:len(units)], 0, end, units.unit_names, tiles, (1, 3, 12, 12))


def test_geometry():
    assert parts(10, 3) == ((0, 3), (3, 6), (6, 10))
    assert window_need((0, 5), 5, 2, 2) == (-2, 11)          # stem 5x5 / 2, padding 2
    assert window_need((5, 10), 3, 1, 1) == (4, 11)
    assert transposed_need((0, 4), 3, 3, 2, 1) == (0, 3)     # output rows 0..3 of a 3-row input
