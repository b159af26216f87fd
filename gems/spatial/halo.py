"""Halo exchange: the rows (or columns) an operation needs around its tile, from the tiles that
own them, with exact backwards.

* ``fetch`` (an autograd function): the tile extended by its halo -- rows outside the image
  filled with the operation's padding value. In backward, the gradient of every row fetched goes
  back to its owner and is added to the owner's gradient: nothing is dropped at a tile border.
* ``window`` (an autograd function): the fetches and a sliding-window operation (convolution,
  max pooling: a ``WindowOp``) in one, keeping for backward the tile and the halo rows it
  received rather than the joined region. The tile is usually kept anyway by the layer before (a
  ReLU keeps its output), so keeping the joined region -- what autograd would keep for the
  convolution after ``fetch`` -- would hold a second copy of every such activation; backward
  joins the region again (one copy) and calls the operation's own backward kernel.

On a 2-D grid rows are fetched first (along the grid's columns), then columns of the
row-extended tile (along its rows), so the corners arrive through the row neighbour. Every
member runs the same layers in the same order, forward and backward, so the messages between two
members pair up in posting order (``TileGroup.exchange``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from gems.plan import formats
from gems.spatial.geometry import Range, intersect, parts
from gems.spatial.tiles import TileGroup


@dataclass(frozen=True)
class Halo:
    """One exchange along axis ``dim`` (2: rows, 3: columns) of global length ``size``:
    ``needs[q]`` is the range member q of this tile's line reads; positions outside
    ``[0, size)`` hold ``fill``."""

    dim: int
    size: int
    needs: tuple[Range, ...]
    fill: float = 0.0

    @staticmethod
    def of(tiles: TileGroup, dim: int, size: int, want, fill: float = 0.0) -> Halo:
        """``want(member index, its own range) -> needed range``, evaluated for every member of
        the line, so each knows what to send whom without asking."""
        members, _ = tiles.line(dim)
        return Halo(dim, size, tuple(want(i, r) for i, r in enumerate(parts(size, len(members)))), fill)

    def trivial(self, tiles: TileGroup) -> bool:
        """Whether every member needs exactly its own rows (no exchange, no padding)."""
        return tuple(self.needs) == tuple(parts(self.size, len(tiles.line(self.dim)[0])))


def _slice(t: torch.Tensor, dim: int, rng: Range, base: int) -> torch.Tensor:
    return t.narrow(dim, rng[0] - base, rng[1] - rng[0])


def _join(x: torch.Tensor, tiles: TileGroup, h: Halo) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The region ``h`` needs around ``x`` (this member's rows), and the rows received for it."""
    members, me = tiles.line(h.dim)
    owns = parts(h.size, len(members))
    sends, recvs = [], []
    for q, peer in enumerate(members):
        if q == me:
            continue
        give, take = intersect(owns[me], h.needs[q]), intersect(owns[q], h.needs[me])
        if give:
            sends.append((peer, _slice(x, h.dim, give, owns[me][0])))
        if take:
            shape = list(x.shape)
            shape[h.dim] = take[1] - take[0]
            recvs.append((peer, formats.empty_as(x, shape)))
    tiles.exchange(sends, recvs, "a tile's halo")
    received = [b for _, b in recvs]
    return _assemble(x, tiles, h, received), received


def _assemble(x: torch.Tensor, tiles: TileGroup, h: Halo, received: list[torch.Tensor]) -> torch.Tensor:
    """The needed rows in order -- padding before row 0, each owner's rows (this member's from
    ``x``, the others' from ``received`` in member order), padding after the last -- in one copy."""
    members, me = tiles.line(h.dim)
    owns = parts(h.size, len(members))
    want = h.needs[me]
    got = iter(received)
    pieces = []

    def padding(lo: int, hi: int) -> None:
        if lo < hi:
            shape = list(x.shape)
            shape[h.dim] = hi - lo
            pieces.append(formats.empty_as(x, shape).fill_(h.fill))
    padding(want[0], min(want[1], 0))
    for q in range(len(members)):
        rows = intersect(owns[q], want)
        if rows:
            pieces.append(_slice(x, h.dim, rows, owns[me][0]) if q == me else next(got))
    padding(max(want[0], h.size), want[1])
    return torch.cat(pieces, h.dim)


def _return(grad: torch.Tensor, tiles: TileGroup, h: Halo, shape: tuple[int, ...]) -> torch.Tensor:
    """The gradient of the tile (``shape``) from the gradient of its region: its own rows, plus
    the gradient of every row the other members fetched from it, sent back by them."""
    return _start_return(grad, tiles, h, shape)()


def _start_return(grad: torch.Tensor, tiles: TileGroup, h: Halo,
                  shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    """``_return`` with its messages posted, not waited for: call the result to wait, add the rows
    received and get the tile's gradient."""
    members, me = tiles.line(h.dim)
    owns = parts(h.size, len(members))
    own, want = owns[me], h.needs[me]
    mine = intersect(own, want)
    if mine is None:
        gx = formats.empty_as(grad, shape).zero_()
    else:   # the rows the region read, copied; the others (a strided op's last) zero
        gx = formats.empty_as(grad, shape)
        _slice(gx, h.dim, mine, own[0]).copy_(_slice(grad, h.dim, mine, want[0]))
        for unread in ((own[0], mine[0]), (mine[1], own[1])):
            if unread[0] < unread[1]:
                _slice(gx, h.dim, unread, own[0]).zero_()
    sends, recvs = [], []
    for q, peer in enumerate(members):
        if q == me:
            continue
        back, give = intersect(owns[q], want), intersect(own, h.needs[q])
        if back:
            sends.append((peer, _slice(grad, h.dim, back, want[0])))
        if give:
            shape_q = list(shape)
            shape_q[h.dim] = give[1] - give[0]
            recvs.append((peer, formats.empty_as(grad, shape_q), give))
    requests = tiles.post(sends, [(peer, b) for peer, b, _ in recvs])

    def finish() -> torch.Tensor:
        tiles.wait(requests, "the gradient of a tile's halo")
        for _, b, give in recvs:
            _slice(gx, h.dim, give, own[0]).add_(b)
        return gx
    return finish


class _Fetch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tiles: TileGroup, h: Halo) -> torch.Tensor:
        ctx.args = (tiles, h, tuple(x.shape))
        return _join(x, tiles, h)[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tiles, h, shape = ctx.args
        return _return(grad, tiles, h, shape), None, None


def fetch(x: torch.Tensor, tiles: TileGroup, dim: int, size: int, want, fill: float = 0.0) -> torch.Tensor:
    """The rows ``want(member index, own range) -> needed range`` of axis ``dim`` (2: rows, 3:
    columns; global length ``size``) that this tile's operation reads, gathered from the tiles
    owning them; positions outside ``[0, size)`` hold ``fill``."""
    return fetch_halo(x, tiles, Halo.of(tiles, dim, size, want, fill))


def fetch_halo(x: torch.Tensor, tiles: TileGroup, h: Halo) -> torch.Tensor:
    """``x`` extended by the halo ``h`` (differentiable)."""
    return _Fetch.apply(x, tiles, h)


@dataclass(frozen=True)
class Conv:
    """F.conv2d on a region, with the padding the region still needs (``padding``)."""

    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    kept = 0            # tensors of its own it keeps for backward

    def forward(self, region, weight, bias):
        return F.conv2d(region, weight, bias, self.stride, self.padding, self.dilation, self.groups), ()

    def backward(self, grad, region, weight, kept, needs):
        bias = [weight.shape[0]] if needs[2] else None
        return torch.ops.aten.convolution_backward(grad, region, weight, bias, self.stride, self.padding,
                                                   self.dilation, False, [0, 0], self.groups, list(needs))


@dataclass(frozen=True)
class MaxPool:
    """F.max_pool2d on a region (its indices kept for backward)."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    kept = 1

    def forward(self, region, weight, bias):
        y, indices = torch.ops.aten.max_pool2d_with_indices(region, self.kernel, self.stride, self.padding,
                                                            self.dilation, False)
        return y, (indices,)

    def backward(self, grad, region, weight, kept, needs):
        gx = torch.ops.aten.max_pool2d_with_indices_backward(grad, region, self.kernel, self.stride, self.padding,
                                                             self.dilation, False, kept[0])
        return gx, None, None


class _Window(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, tiles: TileGroup, halos: tuple[Halo, ...], op):
        region, received = x, []
        for h in halos:
            region, got = _join(region, tiles, h)
            received.append(got)
        y, kept = op.forward(region, weight, bias)
        ctx.args = (tiles, halos, op, [len(r) for r in received])
        ctx.save_for_backward(x, weight, *kept, *(t for r in received for t in r))
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        tiles, halos, op, counts = ctx.args
        x, weight, *rest = ctx.saved_tensors
        kept, received = rest[:op.kept], rest[op.kept:]
        levels = [x]          # the tile, then each halo's region
        for h, n in zip(halos, counts):
            levels.append(_assemble(levels[-1], tiles, h, received[:n]))
            received = received[n:]
        grad, needs = formats.dense(grad), ctx.needs_input_grad[:3]
        if not needs[0]:
            return *op.backward(grad, levels[-1], weight, kept, needs), None, None, None
        # the input's gradient first, its halo rows on their way back while the weight's is computed:
        # a neighbour a little behind costs this tile no wait
        g = op.backward(grad, levels[-1], weight, kept, (True, False, False))[0]
        returned = _start_return(g, tiles, halos[-1], tuple(levels[-2].shape))
        gw, gb = None, None
        if any(needs[1:]):
            gw, gb = op.backward(grad, levels[-1], weight, kept, (False, *needs[1:]))[1:]
        g = returned()
        for h, below in zip(reversed(halos[:-1]), reversed(levels[:-2])):
            g = _return(g, tiles, h, tuple(below.shape))
        return g, gw, gb, None, None, None


def window(x: torch.Tensor, tiles: TileGroup, halos: list[Halo], op, weight=None, bias=None) -> torch.Tensor:
    """``op`` (``Conv``, ``MaxPool``) on ``x`` joined with its ``halos`` (module docstring);
    halos every member needs nothing for are skipped."""
    halos = tuple(h for h in halos if not h.trivial(tiles))
    if not halos:
        return op.forward(x, weight, bias)[0]
    return _Window.apply(x, weight, bias, tiles, halos, op)
