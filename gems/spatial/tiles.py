"""The ranks of one tile group and the exchanges its layers make besides halos
(``gems.spatial.halo``), each an autograd function whose backward is exact:

* ``allreduce``: a sum over the whole tile group (normalisation statistics, global pooling); its
  gradient is the sum of every tile's gradient, so the backward is an allreduce too.
* ``gather`` / its backward: the tiles of a boundary assembled on the group's first rank (the
  *leader*, the rank that talks to the rest of the pipeline), the gradient cut back into tiles.

Every member runs the same layers in the same order, forward and backward (autograd's order is
the same for the same graph), so the point-to-point messages between two members always pair up
in posting order; they travel with one tag, ``TILE_TAG``, apart from the pipeline's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from gems.comm import P2POp
from gems.spatial.geometry import Range, parts

TILE_TAG = 1_000_000   # above every pipeline message tag (gems.pipeline.ir.Message.tag), under MPICH's bound
# Tiles keep pace with each other, so their waits are short: poll without sleeping this long before
# the communicator's back-off sleeps begin (gems.comm.base.Backoff.spin).
SPIN_SECONDS = 2e-3


@dataclass(eq=False)
class TileGroup:
    """P = rows x cols ranks holding the tiles of one stage; ``ranks`` in world numbering, row-major
    over the grid; ``index`` this rank's place in it (0: the leader); ``group`` the backend's
    sub-communicator of ``ranks`` (None when P = 1)."""

    comm: object
    ranks: list[int]
    grid: tuple[int, int]
    index: int
    group: object = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def leader(self) -> bool:
        return self.index == 0

    @property
    def cell(self) -> tuple[int, int]:
        """(i, j): this tile's row and column in the grid."""
        return divmod(self.index, self.grid[1])

    def line(self, dim: int) -> tuple[list[int], int]:
        """The world ranks sharing this tile's columns (dim 2: the grid column) or rows (dim 3: the
        grid row), in order along ``dim``, and this rank's place among them."""
        i, j = self.cell
        rows, cols = self.grid
        if dim == 2:
            return [self.ranks[r * cols + j] for r in range(rows)], i
        return [self.ranks[i * cols + c] for c in range(cols)], j

    def own(self, size: int, dim: int) -> Range:
        """This tile's range of an axis of global length ``size``."""
        members, at = self.line(dim)
        return parts(size, len(members))[at]

    def tile(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tile of a whole (N, C, H, W) tensor (a view)."""
        (r0, r1), (c0, c1) = self.own(x.shape[2], 2), self.own(x.shape[3], 3)
        return x[:, :, r0:r1, c0:c1]

    def exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]],
                 what: str) -> None:
        """Post every send and receive (world peer, tensor) as one batch and wait for all."""
        ops = [P2POp("send", (t.contiguous(),), peer, TILE_TAG) for peer, t in sends]
        ops += [P2POp("recv", (t,), peer, TILE_TAG) for peer, t in recvs]
        for req in self.comm.ibatch(ops):
            self.comm.wait(req, what, self.backoff)

    @property
    def backoff(self):
        return dataclasses.replace(self.comm.backoff, spin=SPIN_SECONDS)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tiles: TileGroup) -> torch.Tensor:
        ctx.tiles = tiles
        out = x.clone().contiguous()
        tiles.comm.allreduce(out, tiles.group, "a tile group's sum", tiles.backoff)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.clone().contiguous()
        ctx.tiles.comm.allreduce(out, ctx.tiles.group, "the gradient of a tile group's sum", ctx.tiles.backoff)
        return out, None


def allreduce(x: torch.Tensor, tiles: TileGroup) -> torch.Tensor:
    """The sum of ``x`` over the tile group, on every member (differentiable)."""
    return x if tiles.size == 1 else _AllReduce.apply(x, tiles)


class _Gather(torch.autograd.Function):
    """Leader: the whole tensor from every member's tile; member: sends its tile, returns an empty
    tensor whose backward receives the tile's gradient from the leader."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tiles: TileGroup, shape: tuple[int, ...]) -> torch.Tensor:
        ctx.tiles, ctx.shape, ctx.tile_shape = tiles, shape, tuple(x.shape)
        if not tiles.leader:
            tiles.exchange([(tiles.ranks[0], x)], [], "the leader to take a tile")
            return x.new_zeros(())
        whole = x.new_empty(shape)
        recvs = []
        for index, peer in enumerate(tiles.ranks):
            view = _view(whole, tiles, index)
            if index == 0:
                view.copy_(x)
            else:
                recvs.append((peer, view, x.new_empty(view.shape)))
        tiles.exchange([], [(peer, b) for peer, _, b in recvs], "the tiles of a boundary")
        for _, view, b in recvs:
            view.copy_(b)
        return whole

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tiles = ctx.tiles
        if not tiles.leader:
            g = grad.new_empty(ctx.tile_shape)
            tiles.exchange([], [(tiles.ranks[0], g)], "the gradient of a tile from the leader")
            return g, None, None
        sends = [(peer, _view(grad, tiles, index)) for index, peer in enumerate(tiles.ranks) if index]
        tiles.exchange(sends, [], "a member to take its tile's gradient")
        return _view(grad, tiles, 0).clone(), None, None


def _view(whole: torch.Tensor, tiles: TileGroup, index: int) -> torch.Tensor:
    i, j = divmod(index, tiles.grid[1])
    (r0, r1), (c0, c1) = parts(whole.shape[2], tiles.grid[0])[i], parts(whole.shape[3], tiles.grid[1])[j]
    return whole[:, :, r0:r1, c0:c1]


def gather(x: torch.Tensor, tiles: TileGroup, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole (N, C, H, W) ``shape`` tensor on the leader from every member's tile; an empty
    scalar elsewhere, through which the member's backward waits for its tile's gradient."""
    return x if tiles.size == 1 else _Gather.apply(x, tiles, shape)
