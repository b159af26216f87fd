"""The ranks of one tile group and the exchanges its layers make besides halos
(``gems.spatial.halo``), each an autograd function whose backward is exact:

* ``allreduce``: a sum over the whole tile group (normalisation statistics, global pooling); its
  gradient is the sum of every tile's gradient, so the backward is an allreduce too.
* ``gather`` / its backward: the tiles of a boundary assembled on the group's first rank (the
  *leader*, the rank that talks to the rest of the pipeline), the gradient cut back into tiles;
  ``scatter`` the reverse, where a spatial suffix takes its inputs from the leader.

Every member runs the same layers in the same order, forward and backward (autograd's order is
the same for the same graph), so the point-to-point messages between two members always pair up
in posting order; they travel with one tag, ``TILE_TAG``, apart from the pipeline's.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from gems.comm import P2POp
from gems.plan import formats
from gems.spatial.geometry import Range, parts

TILE_TAG = 1_000_000   # above every pipeline message tag (gems.schedule.ir.Message.tag), under MPICH's bound
# Tiles keep pace with each other, so their waits are short: poll without sleeping this long before
# the communicator's back-off sleeps begin (gems.comm.base.Backoff.spin) ...
SPIN_SECONDS = 2e-3
# ... or this long where the rank has a core of its own (``Comm.own_core``): nobody needs the core, and
# a sleeping rank's may go idle. On two vCPUs (resnet18 512^2, 2x1 tiles), the ceiling with every
# normalisation a barrier (benchmarks/spatial.py --lockstep) took 0.70 and 0.96 of the plain ceiling
# with 2 ms of polling, 0.95 and 0.95 polling throughout, alternating launches: the sleeps past
# 2 ms now and then cost whole milliseconds to wake from.
OWN_CORE_SPIN_SECONDS = 1.0
# ... and sleep at most this long between tests after it: a tile's wait holds up every member of the
# group, so a late wake-up is lost on all of them (the communicator's longer cap suits waits off that path).
LONGEST_SLEEP = 2.5e-4


def tile_backoff(comm):
    """The back-off of a tile group's waits on ``comm``: its communicator's, with the group's spin
    (longer where the rank has a core of its own) and longest sleep."""
    spin = OWN_CORE_SPIN_SECONDS if comm.own_core else SPIN_SECONDS
    return dataclasses.replace(comm.backoff, spin=spin, longest=min(comm.backoff.longest, LONGEST_SLEEP))


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
    # the engine's timer (``timed(label)``): every wait of the group's exchanges
    # a span on the step's timeline, labelled with what it waits for and the layer (``layer``,
    # set by ``gems.spatial.unit`` as each layer runs); None: nothing recorded
    timer: object = field(default=None, repr=False)
    layer: str = field(default="", repr=False)
    # what the layers' fixed geometry decides, computed on a layer's first call (``memo``)
    _memo: dict = field(default_factory=dict, repr=False)
    _backoff: tuple = field(default=(None, None), repr=False)   # (the communicator's back-off, ours from it)

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

    def line(self, dim: int) -> tuple[tuple[int, ...], int]:
        """The world ranks sharing this tile's columns (dim 2: the grid column) or rows (dim 3: the
        grid row), in order along ``dim``, and this rank's place among them."""
        return self.memo(("line", dim), self._line, dim)

    def _line(self, dim: int) -> tuple[tuple[int, ...], int]:
        i, j = self.cell
        rows, cols = self.grid
        if dim == 2:
            return tuple(self.ranks[r * cols + j] for r in range(rows)), i
        return tuple(self.ranks[i * cols + c] for c in range(cols)), j

    def memo(self, key, make, *args):
        """``make(*args)``, computed once per ``key`` for this group: what a layer's fixed geometry
        (its sizes, kernel, stride, padding) decides is the same at every call, and working it out
        again each step costs a tile's layers tens of microseconds each, a step's fixed overhead."""
        if key not in self._memo:
            self._memo[key] = make(*args)
        return self._memo[key]

    def own(self, size: int, dim: int) -> Range:
        """This tile's range of an axis of global length ``size``."""
        members, at = self.line(dim)
        return parts(size, len(members))[at]

    def tile(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tile of a whole (N, C, H, W) tensor (a view)."""
        (r0, r1), (c0, c1) = self.own(x.shape[2], 2), self.own(x.shape[3], 3)
        return x[:, :, r0:r1, c0:c1]

    def exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]],
                 what: str, span: str = "exchange") -> None:
        """Post every send and receive (world peer, tensor) as one batch and wait for all."""
        self.wait(self.post(sends, recvs), what, span)

    def post(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> list:
        """Start ``exchange``'s messages without waiting; ``wait`` for the returned requests."""
        ops = [P2POp("send", (formats.dense(t),), peer, TILE_TAG) for peer, t in sends]
        ops += [P2POp("recv", (t,), peer, TILE_TAG) for peer, t in recvs]
        return self.comm.ibatch(ops)

    def wait(self, requests: list, what: str, span: str = "exchange") -> None:
        """Wait for ``requests`` (``post``'s), the wait a span ``span`` on the timeline."""
        with self.timed(span):
            for req in requests:
                self.comm.wait(req, what, self.backoff)

    def sum_(self, t: torch.Tensor, what: str, span: str) -> torch.Tensor:
        """Sum ``t`` (dense, no autograd node's) over the group in place, the wait a span ``span``;
        returns ``t``. Not differentiable: for the sums a layer's own backward accounts for (the
        normalisation statistics); ``allreduce`` is the differentiable sum."""
        if self.size > 1:
            with self.timed(span):
                self.comm.allreduce(t, self.group, what, self.backoff)
        return t

    def timed(self, label: str):
        """The body a span ``label`` on the timer's timeline (nothing without a timer)."""
        return nullcontext() if self.timer is None else self.timer.timed(label)

    @property
    def backoff(self):
        """The communicator's back-off with the group's spin and longest sleep (made again only
        when the communicator or its back-off is another)."""
        source, made = self._backoff
        if source is not self.comm.backoff:
            source = self.comm.backoff
            made = tile_backoff(self.comm)
            self._backoff = (source, made)
        return made


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tiles: TileGroup, span: str) -> torch.Tensor:
        kind, _, layer = span.partition(" ")
        ctx.tiles, ctx.span = tiles, f"{kind}-grad {layer}"
        return tiles.sum_(formats.dense(x.clone()), "a tile group's sum", span)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.tiles.sum_(formats.dense(grad.clone()), "the gradient of a tile group's sum", ctx.span), None, None


def allreduce(x: torch.Tensor, tiles: TileGroup, span: str) -> torch.Tensor:
    """The sum of ``x`` over the tile group, on every member (differentiable); its wait the span
    ``span`` ("kind layer") on the timeline, its gradient's "kind-grad layer"."""
    return x if tiles.size == 1 else _AllReduce.apply(x, tiles, span)


class _Gather(torch.autograd.Function):
    """Leader: each whole tensor from every member's tiles; member: sends its tiles, returns empty
    tensors whose backward receives the tiles' gradients from the leader. One autograd node for
    all the tensors of a boundary, so leader and members exchange their gradients in one order."""

    @staticmethod
    def forward(ctx, tiles: TileGroup, shapes: list[tuple[int, ...]], *xs: torch.Tensor):
        ctx.tiles, ctx.tile_shapes = tiles, [tuple(x.shape) for x in xs]
        if not tiles.leader:
            tiles.exchange([(tiles.ranks[0], x) for x in xs], [], "the leader to take a tile", "gather")
            return tuple(x.new_zeros(()) for x in xs)
        return tuple(_assemble(tiles, xs, shapes, "the tiles of a boundary", "gather"))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        tiles = ctx.tiles
        if not tiles.leader:
            gs = [formats.empty_as(grads[0], shape) for shape in ctx.tile_shapes]
            tiles.exchange([], [(tiles.ranks[0], g) for g in gs], "the gradient of a tile from the leader",
                           "gather-grad")
            return None, None, *gs
        return None, None, *_hand_out(tiles, grads, "a member to take its tile's gradient", "gather-grad")


class _Scatter(torch.autograd.Function):
    """The inverse of ``_Gather``: the leader cuts whole tensors into tiles and sends each member
    its own; a member passes one scalar tied to its graph (``link``) and receives its tiles. The
    backward gathers the tiles' gradients on the leader."""

    @staticmethod
    def forward(ctx, tiles: TileGroup, shapes: list[tuple[int, ...]], dtype: torch.dtype, *xs: torch.Tensor):
        ctx.tiles, ctx.shapes, ctx.inputs = tiles, shapes, len(xs)
        if tiles.leader:
            return tuple(_hand_out(tiles, xs, "a member to take its tile of a boundary", "scatter", dtype))
        mine = [formats.empty_as(xs[0], tile_shape(shape, tiles, tiles.index), dtype) for shape in shapes]
        tiles.exchange([], [(tiles.ranks[0], t) for t in mine], "the tiles of a boundary from the leader", "scatter")
        return tuple(mine)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        tiles = ctx.tiles
        if not tiles.leader:
            tiles.exchange([(tiles.ranks[0], g) for g in grads], [], "the leader to take a tile's gradient",
                           "scatter-grad")
            return None, None, None, *(torch.zeros((), dtype=grads[0].dtype, device=grads[0].device)
                                       for _ in range(ctx.inputs))
        return None, None, None, *_assemble(tiles, grads, ctx.shapes, "the gradients of a boundary's tiles",
                                            "scatter-grad")


def _assemble(tiles: TileGroup, mine, shapes, what: str, span: str) -> list[torch.Tensor]:
    """Leader: the whole tensors of ``shapes`` from its own tiles ``mine`` and every member's."""
    wholes = [formats.empty_as(t, shape) for t, shape in zip(mine, shapes)]
    recvs = []
    for whole, t in zip(wholes, mine):
        for index, peer in enumerate(tiles.ranks):
            view = _view(whole, tiles, index)
            if index == 0:
                view.copy_(t)
            else:
                recvs.append((peer, view, formats.empty_as(t, view.shape)))
    tiles.exchange([], [(peer, b) for peer, _, b in recvs], what, span)
    for _, view, b in recvs:
        view.copy_(b)
    return wholes


def _hand_out(tiles: TileGroup, wholes, what: str, span: str,
              dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Leader: every member's tile of each whole tensor sent to it (in ``dtype``); its own tiles, copied."""
    sends = [(peer, _view(w, tiles, index).to(dtype or w.dtype)) for w in wholes
             for index, peer in enumerate(tiles.ranks) if index]
    tiles.exchange(sends, [], what, span)
    return [_view(w, tiles, 0).to(dtype or w.dtype, copy=True) for w in wholes]


def tile_shape(shape: tuple[int, ...], tiles: TileGroup, index: int) -> tuple[int, ...]:
    """The shape of tile ``index`` of a whole (N, C, H, W) tensor of ``shape``."""
    i, j = divmod(index, tiles.grid[1])
    (r0, r1), (c0, c1) = parts(shape[2], tiles.grid[0])[i], parts(shape[3], tiles.grid[1])[j]
    return (*shape[:2], r1 - r0, c1 - c0)


def _view(whole: torch.Tensor, tiles: TileGroup, index: int) -> torch.Tensor:
    i, j = divmod(index, tiles.grid[1])
    (r0, r1), (c0, c1) = parts(whole.shape[2], tiles.grid[0])[i], parts(whole.shape[3], tiles.grid[1])[j]
    return whole[:, :, r0:r1, c0:c1]


def gather(xs: tuple[torch.Tensor, ...], tiles: TileGroup, shapes: list[tuple[int, ...]]) -> tuple[torch.Tensor, ...]:
    """The whole (N, C, H, W) tensors of ``shapes`` on the leader from every member's tiles ``xs``;
    empty scalars elsewhere, through which the member's backward waits for its tiles' gradients."""
    return tuple(xs) if tiles.size == 1 else _Gather.apply(tiles, list(shapes), *xs)


def scatter(xs: tuple[torch.Tensor, ...], tiles: TileGroup, shapes: list[tuple[int, ...]],
            dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """This rank's tiles (in ``dtype``) of the whole tensors of ``shapes``: the leader passes them
    (``xs``), a member one scalar its graph hangs on (``xs[0]``: see ``_Scatter``)."""
    return tuple(xs) if tiles.size == 1 else _Scatter.apply(tiles, list(shapes), dtype, *xs)
