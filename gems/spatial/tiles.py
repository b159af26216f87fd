"""The ranks of one tile group and the three exchanges tiled layers need, each an autograd
function whose backward is exact:

* ``fetch``: the rows (or columns) an operation needs around its tile -- its halo -- from the
  tiles that own them, rows outside the image filled with the operation's padding value. In
  backward, the gradient of every row fetched goes back to its owner and is added to the
  owner's gradient: nothing is dropped at a tile border. On a 2-D grid rows are fetched first
  (along the grid's columns), then columns of the row-extended tile (along its rows), so the
  corners arrive through the row neighbour.
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
from gems.spatial.geometry import Range, intersect, parts

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


def _slice(t: torch.Tensor, dim: int, rng: Range, base: int) -> torch.Tensor:
    return t.narrow(dim, rng[0] - base, rng[1] - rng[0])


class _Fetch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tiles: TileGroup, dim: int, size: int, needs: list[Range],
                fill: float) -> torch.Tensor:
        members, me = tiles.line(dim)
        owns = parts(size, len(members))
        want = needs[me]
        sends, recvs = [], []
        for q, peer in enumerate(members):
            if q == me:
                continue
            give, take = intersect(owns[me], needs[q]), intersect(owns[q], want)
            if give:
                sends.append((peer, _slice(x, dim, give, owns[me][0])))
            if take:
                shape = list(x.shape)
                shape[dim] = take[1] - take[0]
                recvs.append((peer, x.new_empty(shape)))
        tiles.exchange(sends, recvs, "a tile's halo")
        got = iter(b for _, b in recvs)
        # the needed rows in order -- padding before row 0, each owner's rows, padding after the
        # last -- joined in one copy
        pieces = []
        for lo, hi in ((want[0], min(want[1], 0)), (max(want[0], size), want[1])):
            if lo < hi:
                shape = list(x.shape)
                shape[dim] = hi - lo
                pieces.append((lo, x.new_full(shape, fill)))
        for q in range(len(members)):
            rows = intersect(owns[q], want)
            if rows:
                pieces.append((rows[0], _slice(x, dim, rows, owns[me][0]) if q == me else next(got)))
        ctx.args = (tiles, dim, size, needs, tuple(x.shape))
        return torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])], dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tiles, dim, size, needs, shape = ctx.args
        members, me = tiles.line(dim)
        owns = parts(size, len(members))
        want = needs[me]
        gx = grad.new_zeros(shape)
        sends, recvs = [], []
        for q, peer in enumerate(members):
            if q == me:
                mine = intersect(owns[me], want)
                if mine:
                    _slice(gx, dim, mine, owns[me][0]).add_(_slice(grad, dim, mine, want[0]))
                continue
            back, give = intersect(owns[q], want), intersect(owns[me], needs[q])
            if back:
                sends.append((peer, _slice(grad, dim, back, want[0])))
            if give:
                recvs.append((peer, give))
        buffers = [(peer, grad.new_empty([*shape[:dim], give[1] - give[0], *shape[dim + 1:]]), give)
                   for peer, give in recvs]
        tiles.exchange(sends, [(peer, b) for peer, b, _ in buffers], "the gradient of a tile's halo")
        for _, b, give in buffers:
            _slice(gx, dim, give, owns[me][0]).add_(b)
        return gx, None, None, None, None, None


def fetch(x: torch.Tensor, tiles: TileGroup, dim: int, size: int, want, fill: float = 0.0) -> torch.Tensor:
    """The rows ``want(own range) -> needed range`` of axis ``dim`` (2: rows, 3: columns; global
    length ``size``) that this tile's operation reads, gathered from the tiles owning them;
    positions outside ``[0, size)`` hold ``fill``. ``want`` is evaluated for every member of the
    line, so each knows what to send whom without asking."""
    members, _ = tiles.line(dim)
    needs = [want(i, r) for i, r in enumerate(parts(size, len(members)))]
    return _Fetch.apply(x, tiles, dim, size, needs, fill)


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
