"""Halo exchange: the rows (or columns) an operation needs around its tile, from the tiles that
own them, with exact backwards.

* ``fetch`` (an autograd function): the tile extended by its halo -- rows outside the image
  filled with the operation's padding value. In backward, the gradient of every row fetched goes
  back to its owner and is added to the owner's gradient: nothing is dropped at a tile border.
* ``post`` / ``join`` / ``assemble`` / ``start_return`` / ``give_back``: the exchange's parts, which
  ``gems.spatial.window`` runs a sliding window between.

On a 2-D grid rows are fetched first (along the grid's columns), then columns of the
row-extended tile (along its rows), so the corners arrive through the row neighbour. Every
member runs the same layers in the same order, forward and backward, so the messages between two
members pair up in posting order (``TileGroup.exchange``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gems.plan import formats
from gems.spatial.geometry import Range, Sliding, intersect, parts
from gems.spatial.tiles import TileGroup


@dataclass(frozen=True)
class Halo:
    """One exchange along axis ``dim`` (2: rows, 3: columns) of global length ``size``:
    ``needs[q]`` is the range member q of this tile's line reads; positions outside
    ``[0, size)`` hold ``fill``. For a sliding window padded alike at both ends, ``window`` is
    its geometry along ``dim`` and ``outs[q]`` member q's output rows (what ``gems.spatial.window``
    splits a tile's output into interior and border by); None otherwise."""

    dim: int
    size: int
    needs: tuple[Range, ...]
    fill: float = 0.0
    window: Sliding | None = None
    outs: tuple[Range, ...] = ()

    @staticmethod
    def of(tiles: TileGroup, dim: int, size: int, want, fill: float = 0.0) -> Halo:
        """``want(member index, its own range) -> needed range``, evaluated for every member of
        the line, so each knows what to send whom without asking."""
        members, _ = tiles.line(dim)
        return Halo(dim, size, tuple(want(i, r) for i, r in enumerate(parts(size, len(members)))), fill)

    @staticmethod
    def sliding(tiles: TileGroup, dim: int, size: int, size_out: int, window: Sliding, fill: float = 0.0) -> Halo:
        """The halo of ``window`` (an input of ``size`` rows, an output of ``size_out``)."""
        outs = tuple(parts(size_out, len(tiles.line(dim)[0])))
        return Halo(dim, size, tuple(window.need(out) for out in outs), fill, window, outs)

    def trivial(self, tiles: TileGroup) -> bool:
        """Whether every member needs exactly its own rows (no exchange, no padding)."""
        return tuple(self.needs) == tuple(parts(self.size, len(tiles.line(self.dim)[0])))


def narrow_rows(t: torch.Tensor, dim: int, rng: Range, base: int) -> torch.Tensor:
    """The rows ``rng`` (global) along ``dim`` of ``t``, whose first row is global row ``base``."""
    return t.narrow(dim, rng[0] - base, rng[1] - rng[0])


def post(x: torch.Tensor, tiles: TileGroup, h: Halo) -> tuple[list, list[torch.Tensor]]:
    """Start exchanging the halo ``h`` around ``x`` (this member's rows): the requests to wait for,
    and the buffers the other members' rows arrive in, in member order."""
    members, me = tiles.line(h.dim)
    owns = parts(h.size, len(members))
    sends, recvs = [], []
    for q, peer in enumerate(members):
        if q == me:
            continue
        give, take = intersect(owns[me], h.needs[q]), intersect(owns[q], h.needs[me])
        if give:
            sends.append((peer, narrow_rows(x, h.dim, give, owns[me][0])))
        if take:
            shape = list(x.shape)
            shape[h.dim] = take[1] - take[0]
            recvs.append((peer, formats.empty_as(x, shape)))
    return tiles.post(sends, recvs), [b for _, b in recvs]


def join(x: torch.Tensor, tiles: TileGroup, h: Halo) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The region ``h`` needs around ``x`` (this member's rows), and the rows received for it."""
    requests, received = post(x, tiles, h)
    tiles.wait(requests, "a tile's halo", f"halo {tiles.layer}")
    return assemble(x, tiles, h, received), received


def assemble(x: torch.Tensor, tiles: TileGroup, h: Halo, received: list[torch.Tensor],
             rows: Range | None = None) -> torch.Tensor:
    """The needed rows in order -- padding before row 0, each owner's rows (this member's from
    ``x``, the others' from ``received`` in member order), padding after the last -- in one copy;
    ``rows``: only those of the region (default: all)."""
    members, me = tiles.line(h.dim)
    owns = parts(h.size, len(members))
    want = h.needs[me] if rows is None else rows
    got = iter(received)
    pieces = []

    def padding(lo: int, hi: int) -> None:
        if lo < hi:
            shape = list(x.shape)
            shape[h.dim] = hi - lo
            pieces.append(formats.empty_as(x, shape).fill_(h.fill))
    padding(want[0], min(want[1], 0))
    for q in range(len(members)):
        held = intersect(owns[q], h.needs[me])   # what q's piece holds
        if held is None:
            continue
        piece, base = (x, owns[me][0]) if q == me else (next(got), held[0])
        taken = intersect(held, want)
        if taken:
            pieces.append(narrow_rows(piece, h.dim, taken, base))
    padding(max(want[0], h.size), want[1])
    return torch.cat(pieces, h.dim)


def give_back(grad: torch.Tensor, tiles: TileGroup, h: Halo, shape: tuple[int, ...], layer: str) -> torch.Tensor:
    """The gradient of the tile (``shape``) from the gradient of its region: its own rows, plus
    the gradient of every row the other members fetched from it, sent back by them."""
    return start_return(grad, tiles, h, shape, layer)()


def start_return(grad: torch.Tensor, tiles: TileGroup, h: Halo, shape: tuple[int, ...],
                  layer: str, owned: bool = False) -> Callable[[], torch.Tensor]:
    """``give_back`` with its messages posted, not waited for: call the result to wait, add the rows
    received and get the tile's gradient. ``owned``: ``grad`` is the caller's to change (no
    autograd node shares it), so where the region holds every row of the tile, the tile's gradient
    is a view of it, the rows received added in place: no copy."""
    members, me = tiles.line(h.dim)
    owns = parts(h.size, len(members))
    own, want = owns[me], h.needs[me]
    mine = intersect(own, want)
    if owned and mine == own:
        gx = narrow_rows(grad, h.dim, own, want[0])
    elif mine is None:
        gx = formats.empty_as(grad, shape).zero_()
    else:   # the rows the region read, copied; the others (a strided op's last) zero
        gx = formats.empty_as(grad, shape)
        narrow_rows(gx, h.dim, mine, own[0]).copy_(narrow_rows(grad, h.dim, mine, want[0]))
        for unread in ((own[0], mine[0]), (mine[1], own[1])):
            if unread[0] < unread[1]:
                narrow_rows(gx, h.dim, unread, own[0]).zero_()
    sends, recvs = [], []
    for q, peer in enumerate(members):
        if q == me:
            continue
        back, give = intersect(owns[q], want), intersect(own, h.needs[q])
        if back:
            sends.append((peer, narrow_rows(grad, h.dim, back, want[0])))
        if give:
            shape_q = list(shape)
            shape_q[h.dim] = give[1] - give[0]
            recvs.append((peer, formats.empty_as(grad, shape_q), give))
    requests = tiles.post(sends, [(peer, b) for peer, b, _ in recvs])

    def finish() -> torch.Tensor:
        tiles.wait(requests, "the gradient of a tile's halo", f"halo-grad {layer}")
        for _, b, give in recvs:
            narrow_rows(gx, h.dim, give, own[0]).add_(b)
        return gx
    return finish


class _Fetch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tiles: TileGroup, h: Halo) -> torch.Tensor:
        ctx.args = (tiles, h, tuple(x.shape), tiles.layer)
        return join(x, tiles, h)[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tiles, h, shape, layer = ctx.args
        return give_back(grad, tiles, h, shape, layer), None, None


def fetch(x: torch.Tensor, tiles: TileGroup, dim: int, size: int, want, fill: float = 0.0) -> torch.Tensor:
    """The rows ``want(member index, own range) -> needed range`` of axis ``dim`` (2: rows, 3:
    columns; global length ``size``) that this tile's operation reads, gathered from the tiles
    owning them; positions outside ``[0, size)`` hold ``fill``."""
    return fetch_halo(x, tiles, Halo.of(tiles, dim, size, want, fill))


def fetch_halo(x: torch.Tensor, tiles: TileGroup, h: Halo) -> torch.Tensor:
    """``x`` extended by the halo ``h`` (differentiable); ``x`` itself where every member needs
    exactly its own rows (an axis the grid does not cut: no copy forward or backward)."""
    return x if h.trivial(tiles) else _Fetch.apply(x, tiles, h)
