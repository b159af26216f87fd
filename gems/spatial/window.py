"""A sliding window (convolution, max pooling) on tiles: ``window`` joins the operation with the
halos it needs (``gems.spatial.halo``) in one autograd function, keeping for backward the tile and
the halo rows it received rather than a joined region (the tile is usually kept anyway by the
layer before: a ReLU keeps its output).

A window does not wait for its halo before it computes. It posts the halo's messages, runs the
operation on the tile alone, padded as the layer pads the image -- every output row, the
*interior* (rows whose windows read only the tile, or the image's padding) right, the *border*
(rows whose windows reach into a neighbour's) wrong -- and only then waits; the border rows are
computed again from the halo and the rows next to it and written over::

      neighbour's rows | tile's rows                                       | neighbour's rows
      halo ~~~~~~~~~~~~|  border | interior: computed while the halo travels | border |~~~~~~~~ halo

So a neighbour up to one tile's computation behind costs no wait, and forward joins no region.
A convolution's backward does the same the other way (``_border_backward``): the border's
gradient first, its halo rows sent back at once, then the tile's own gradients from the tile alone.
Where the tile's rows do not line up with its output rows under the layer's padding (uneven
tiles of a strided window), or a tile has no interior, the window waits for its halo and runs
on the joined region; max pooling's backward always does (its indices point into the region).

On a 2-D grid the tile starts alone while the rows travel; the columns are joined after (the
corners come through the row neighbour: ``gems.spatial.halo``). Whichever way each tile
computes, its messages are the same, in the same order.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from gems.plan import formats
from gems.spatial import halo
from gems.spatial.geometry import intersect, parts
from gems.spatial.halo import Halo
from gems.spatial.tiles import TileGroup


@dataclass(frozen=True)
class Conv:
    """F.conv2d on a region, with the padding the region still needs (``padding``)."""

    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    kept = 0            # tensors of its own it keeps for backward
    linear = True       # in its input: the gradients of a region's parts add up (``_border_backward``)

    def forward(self, region, weight, bias):
        return F.conv2d(region, weight, bias, self.stride, self.padding, self.dilation, self.groups), ()

    def place(self, kept, at, width, full):
        return kept

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
    linear = False

    def forward(self, region, weight, bias):
        y, indices = torch.ops.aten.max_pool2d_with_indices(region, self.kernel, self.stride, self.padding,
                                                            self.dilation, False)
        return y, (indices,)

    def place(self, kept, at: tuple[int, int], width: int, full: int):
        """The indices of a max pooling of a part of the region whose first element lies at
        ``at`` (rows, columns) in the region, the part ``width`` columns wide, the region
        ``full``: as indices into the region (what backward pools)."""
        (indices,) = kept
        if at[1] == 0 and width == full:
            return (indices.add_(at[0] * full),)
        rows = torch.div(indices, width, rounding_mode="floor")
        return ((rows + at[0]) * full + (indices - rows * width) + at[1],)

    def backward(self, grad, region, weight, kept, needs):
        gx = torch.ops.aten.max_pool2d_with_indices_backward(grad, region, self.kernel, self.stride, self.padding,
                                                             self.dilation, False, kept[0])
        return gx, None, None


class _Window(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, tiles: TileGroup, halos: tuple[Halo, ...], op):
        layer = tiles.layer
        alone = _alone(op, halos, tiles, x, weight)
        requests, got = halo.post(x, tiles, halos[0])
        if alone is not None:   # while the halo travels: every output row, the border's padded where the halo goes
            y, kept = alone.forward(x, weight, bias)
        tiles.wait(requests, "a tile's halo", f"halo {layer}")
        received, region = [got], None
        if alone is None or len(halos) > 1:
            region = halo.assemble(x, tiles, halos[0], got)
            for h in halos[1:]:
                region, more = halo.join(region, tiles, h)
                received.append(more)
        if alone is None:
            y, kept = op.forward(region, weight, bias)
        else:
            kept = _border(y, kept, x, region, got, weight, bias, tiles, halos, op)
        ctx.args = (tiles, halos, op, [len(r) for r in received], layer, alone)
        ctx.save_for_backward(x, weight, *kept, *(t for r in received for t in r))
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        tiles, halos, op, counts, layer, alone = ctx.args
        x, weight, *rest = ctx.saved_tensors
        kept, received = rest[:op.kept], rest[op.kept:]
        grad, needs = formats.dense(grad), ctx.needs_input_grad[:3]
        if alone is not None and op.linear and len(halos) == 1:
            return *_border_backward(grad, x, weight, received, tiles, halos[0], op, alone, needs, layer), \
                None, None, None
        levels = [x]          # the tile, then each halo's region
        for h, n in zip(halos, counts):
            levels.append(halo.assemble(levels[-1], tiles, h, received[:n]))
            received = received[n:]
        if not needs[0]:
            return *op.backward(grad, levels[-1], weight, kept, needs), None, None, None
        # the input's gradient first, its halo rows on their way back while the weight's is computed:
        # a neighbour a little behind costs this tile no wait
        g = op.backward(grad, levels[-1], weight, kept, (True, False, False))[0]
        returned = halo.start_return(g, tiles, halos[-1], tuple(levels[-2].shape), layer)
        gw, gb = None, None
        if any(needs[1:]):
            gw, gb = op.backward(grad, levels[-1], weight, kept, (False, *needs[1:]))[1:]
        g = returned()
        for h, below in zip(reversed(halos[:-1]), reversed(levels[:-2])):
            g = halo.give_back(g, tiles, h, tuple(below.shape), layer)
        return g, gw, gb, None, None, None


def _border_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, received: list[torch.Tensor],
                     tiles: TileGroup, h: Halo, op, alone, needs: tuple[bool, ...], layer: str) -> tuple:
    """The gradients of a linear ``op`` (a convolution) whose forward ran ``alone`` on the tile and
    wrote its border over, from the tile and the border alone, no region joined: the border's
    gradient first, on the halo's rows (the halo alone: the tile's rows zeroed), so the rows the
    other members fetched start back before the tile's own gradient is computed; then ``alone``'s
    backward on the tile -- its input gradient is the tile's own, since the border's rows read
    the tile's rows with the same weights; its weight gradient misses what the border read of
    the halo, which the border's adds."""
    members, me = tiles.line(h.dim)
    owns = parts(h.size, len(members))
    own, out = owns[me], h.outs[me]
    inner = h.window.inner(out, own, h.size)
    strips, extra = [], None   # (the halo's rows read, their gradient); the weight's gradient from them
    for rows in ((out[0], inner[0]), (inner[1], out[1])):
        if rows[0] >= rows[1]:
            continue
        need = h.window.need(rows)
        source = halo.assemble(x, tiles, h, received, need)
        mine = intersect(own, need)
        if mine:
            halo.narrow_rows(source, h.dim, mine, need[0]).zero_()
        g, gw, _ = op.backward(grad.narrow(h.dim, rows[0] - out[0], rows[1] - rows[0]), source, weight, (),
                               (needs[0], needs[1], False))
        strips.append((need, g))
        extra = gw if extra is None else extra + gw
    sends, recvs = [], []
    for q, peer in enumerate(members):
        back, give = intersect(owns[q], h.needs[me]), intersect(own, h.needs[q])
        if q == me or not needs[0]:
            continue
        if back:
            need, g = next((need, g) for need, g in strips if intersect(need, back) == back)
            sends.append((peer, halo.narrow_rows(g, h.dim, back, need[0])))
        if give:
            shape = list(x.shape)
            shape[h.dim] = give[1] - give[0]
            recvs.append((peer, formats.empty_as(x, shape), give))
    requests = tiles.post(sends, [(peer, b) for peer, b, _ in recvs])
    gx, gw, gb = alone.backward(grad, x, weight, (), needs)
    if needs[1] and extra is not None:
        gw = gw + extra
    if requests:
        tiles.wait(requests, "the gradient of a tile's halo", f"halo-grad {layer}")
    for _, b, give in recvs:
        halo.narrow_rows(gx, h.dim, give, own[0]).add_(b)
    return gx, gw, gb


def _alone(op, halos: tuple[Halo, ...], tiles: TileGroup, x: torch.Tensor, weight: torch.Tensor | None):
    """``op`` padded along every split axis as the layer pads the image, where that makes this
    tile's every output row from its own rows alone (``Sliding.alone``) and leaves it an interior
    (rows reading no halo), and where the border's own convolutions cost less than joining the
    region (``worth_alone``); None otherwise (then the tile waits for its halo before computing)."""
    if not worth_alone(x.shape[2] * x.shape[3] // (op.stride[0] * op.stride[1]),
                       None if weight is None else weight[0].numel()):
        return None
    padding = list(op.padding)
    for h in halos:
        members, me = tiles.line(h.dim)
        own = parts(h.size, len(members))[me]
        if h.window is None or not h.window.alone(h.outs[me], own):
            return None
        inner = h.window.inner(h.outs[me], own, h.size)
        if inner[0] >= inner[1]:
            return None
        padding[h.dim - 2] = h.window.pad
    return dataclasses.replace(op, padding=tuple(padding))


def worth_alone(outputs: int, filter_size: int | None) -> bool:
    """Whether a tile of about ``outputs`` values per channel computes alone and then its border,
    rather than on the joined region, for a window whose one output channel's filter holds
    ``filter_size`` weights (None: a pooling). The border's convolutions, forward and backward
    (its weight gradient above all), cost about a pass over the weights each, the joined region a
    pass over the tile: on CPU, resnet18's 3x3 convolutions on 2x1 tiles at 512^2 ran faster
    alone on tiles of 64x128 and 32x64 (64 and 128 channels), slower on 16x32 and 8x16 (256, 512;
    by half in backward)."""
    return filter_size is None or outputs >= filter_size


def _border(y: torch.Tensor, kept: tuple, x: torch.Tensor, region: torch.Tensor | None, got: list[torch.Tensor],
            weight, bias, tiles: TileGroup, halos: tuple[Halo, ...], op) -> tuple:
    """Overwrite the border of ``y`` (``_alone``'s output) -- the rows and columns whose windows
    read a halo -- with ``op`` on the halo and the rows next to it: from the halo received
    (``got``) with one halo, from the whole ``region`` with two. Returns ``kept`` (``op``'s saved
    tensors) as for the whole region, the border's written in."""
    at, full = [0, 0], x.shape[3]    # where x lies in the region, and the region's width
    for h in halos:
        members, me = tiles.line(h.dim)
        at[h.dim - 2] = parts(h.size, len(members))[me][0] - h.needs[me][0]
        if h.dim == 3:
            full = h.needs[me][1] - h.needs[me][0]
    kept = op.place(kept, tuple(at), x.shape[3], full)
    for h in halos:
        members, me = tiles.line(h.dim)
        own, out, start = parts(h.size, len(members))[me], h.outs[me], h.needs[me][0]
        inner = h.window.inner(out, own, h.size)
        for rows in ((out[0], inner[0]), (inner[1], out[1])):
            if rows[0] >= rows[1]:
                continue
            need = h.window.need(rows)
            source = halo.assemble(x, tiles, h, got, need) if region is None else \
                region.narrow(h.dim, need[0] - start, need[1] - need[0])
            part, part_kept = op.forward(source, weight, bias)
            at = [0, 0]
            at[h.dim - 2] = need[0] - start
            for whole, piece in zip((y, *kept), (part, *op.place(part_kept, tuple(at), source.shape[3], full))):
                whole.narrow(h.dim, rows[0] - out[0], rows[1] - rows[0]).copy_(piece)
    return kept


def window(x: torch.Tensor, tiles: TileGroup, halos: list[Halo], op, weight=None, bias=None) -> torch.Tensor:
    """``op`` (``Conv``, ``MaxPool``) on ``x`` joined with its ``halos`` (module docstring);
    halos every member needs nothing for are skipped."""
    halos = tuple(h for h in halos if not h.trivial(tiles))
    if not halos:
        return op.forward(x, weight, bias)[0]
    return _Window.apply(x, weight, bias, tiles, halos, op)
