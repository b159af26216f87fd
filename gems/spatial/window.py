"""A sliding window (convolution, max pooling) on tiles: ``window`` joins the operation with the
halos it needs (``gems.spatial.halo``) in one autograd function, keeping for backward the tile and
the halo rows it received rather than a joined region (the tile is usually kept anyway by the
layer before: a ReLU keeps its output).

A window does not wait for its halo before it computes where it need not. It posts the halo's
messages, runs the operation on the tile alone, padded as the layer pads the image -- every output
row, the *interior* (rows whose windows read only the tile, or the image's padding) right, the
*border* (rows whose windows reach into a neighbour's) wrong -- and only then waits; the border
rows are computed again from the halo and the rows next to it and written over::

      neighbour's rows | tile's rows                                       | neighbour's rows
      halo ~~~~~~~~~~~~|  border | interior: computed while the halo travels | border |~~~~~~~~ halo

So a neighbour up to one tile's computation behind costs no wait, and forward joins no region.
Which way costs less work depends on the layer: the joined region is a copy of the tile, the
border a second convolution of a few rows (a pass over the weights). A large tile of few filters
computes alone always (``alone_cheaper``); a smaller one alone too where that costs only a little
more (``worth_alone``), else on the joined region. The choice is the layer's geometry alone, never
whether a halo has landed yet: the two ways round differently, and a run must compute the same
values every time (a resume is bit for bit). Where the tile's rows do not line up with its
output rows under the layer's padding (uneven tiles of a strided window), or a tile has no
interior, the window waits for its halo and runs on the joined region.

A convolution's backward does the same the other way where that costs less (``border_first``,
``_border_backward``): the border's gradient first, its halo rows sent back at once, then the
tile's own gradients from the tile alone. Otherwise it runs on the joined region rebuilt from the
tile and the rows received: the input's gradient first, its halo rows sent back at once, then the
weight's gradient while they travel. A max pooling's backward sends each gradient where its indices
(into the region) point and reads the region's shape alone: it gets an empty tensor of that shape.

On a 2-D grid the rows travel first; the columns are joined after (the corners come through the
row neighbour: ``gems.spatial.halo``). Whichever way each tile computes, its messages are the
same, in the same order.
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
    reads_region = True   # its backward reads the region's values (``MaxPool``'s only its shape)

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
    """F.max_pool2d on a region (its indices kept for backward), in NHWC blocks of channels where
    that is faster (``nhwc_block``); the values and indices (row x width + column, whatever the
    layout) are the same either way."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    kept = 1
    reads_region = False   # the gradient goes where the indices point: the region's shape is all it needs

    def forward(self, region, weight, bias):
        per = nhwc_block(region, self.kernel)
        if not per:
            y, indices = torch.ops.aten.max_pool2d_with_indices(region, self.kernel, self.stride, self.padding,
                                                                self.dilation, False)
            return y, (indices,)
        y = indices = None
        for c in range(0, region.shape[1], per):
            block_y, block_indices = torch.ops.aten.max_pool2d_with_indices(
                region[:, c:c + per].contiguous(memory_format=torch.channels_last), self.kernel, self.stride,
                self.padding, self.dilation, False)
            if y is None:
                y = region.new_empty((region.shape[0], region.shape[1], *block_y.shape[2:]))
                indices = torch.empty(y.shape, dtype=block_indices.dtype, device=region.device)
            y[:, c:c + per].copy_(block_y)
            indices[:, c:c + per].copy_(block_indices)
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


# Channels an NHWC block of a pooling holds (``nhwc_block``), and the most bytes they may span: a block and
# its copies stay in the cache. Regions under NHWC_MIN_BYTES gain less than a millisecond: left NCHW.
NHWC_CHANNELS = 8
NHWC_BLOCK_BYTES = 4 << 20
NHWC_MIN_BYTES = 1 << 20


def nhwc_block(region: torch.Tensor, kernel: tuple[int, int]) -> int:
    """How many channels at a time a max pooling of the NCHW CPU tensor ``region`` with windows of
    ``kernel`` takes in NHWC (each block copied to NHWC, pooled, its results copied into the NCHW
    output), 0 for none. PyTorch's NCHW kernel walks one channel's plane at a time, about 30 ns a
    3 x 3 window; its NHWC one vectorises over the channels, and copies of blocks of 8 channels
    stay in the cache (whole tensors take fresh pages). In a 2-rank step of resnet18 at 512^2 the
    stem pooling (3 x 3, stride 2, 64 channels of 129 x 256) took 15.8 ms NCHW, 2.6 ms in blocks
    and 2 ms more copying (one rank alone: 19 -> 5-8 ms; copied whole 15 ms, in blocks of 16 9 ms).
    Windows of fewer than 9 stay NCHW: the U-Net's 2 x 2 poolings gained alone (43 -> 15 ms on
    64 x 256 x 512) but in its 2-rank step the copies cost what they saved (35 ms NCHW, 29-50 ms in
    blocks). One block's copies are all a pooling holds more than in NCHW (the plan's estimate
    leaves them out): taken for regions of two blocks or more, of at least ``NHWC_MIN_BYTES``."""
    if (region.device.type != "cpu" or region.dim() != 4 or kernel[0] * kernel[1] < 9
            or formats.format_of(region) is not torch.contiguous_format):
        return 0
    plane = region.shape[0] * region.shape[2] * region.shape[3] * region.element_size()
    fits = NHWC_CHANNELS * plane <= NHWC_BLOCK_BYTES and region.shape[1] * plane >= NHWC_MIN_BYTES
    return NHWC_CHANNELS if fits and region.shape[1] >= 2 * NHWC_CHANNELS else 0


class _Window(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, tiles: TileGroup, halos: tuple[Halo, ...], op):
        layer = tiles.layer
        alone = _alone(op, halos, tiles)
        requests, got = halo.post(x, tiles, halos[0])
        if alone is not None and not _alone_first(x, weight, op, halos):
            alone = None
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
        ctx.args = (tiles, halos, op, [len(r) for r in received], layer)
        ctx.save_for_backward(x, weight, *kept, *(t for r in received for t in r))
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        tiles, halos, op, counts, layer = ctx.args
        x, weight, *rest = ctx.saved_tensors
        kept, received = rest[:op.kept], rest[op.kept:]
        grad, needs = formats.dense(grad), ctx.needs_input_grad[:3]
        if isinstance(op, Conv) and len(halos) == 1 and border_first(_outputs(x, op), weight[0].numel()):
            alone = _alone(op, halos, tiles)
            if alone is not None:
                return *_border_backward(grad, x, weight, received, tiles, halos[0], op, alone, needs, layer), \
                    None, None, None
        levels = [x]          # the tile, then each halo's region (its shape alone where that is all op reads)
        for h, n in zip(halos, counts):
            levels.append(halo.assemble(levels[-1], tiles, h, received[:n]) if op.reads_region
                          else _region_like(levels[-1], tiles, h))
            received = received[n:]
        if not needs[0]:
            return *op.backward(grad, levels[-1], weight, kept, needs), None, None, None
        # the input's gradient first, its halo rows on their way back while the weight's is computed:
        # a neighbour a little behind costs this tile no wait
        g = op.backward(grad, levels[-1], weight, kept, (True, False, False))[0]
        returned = halo.start_return(g, tiles, halos[-1], tuple(levels[-2].shape), layer, owned=True)
        gw, gb = None, None
        if any(needs[1:]):
            gw, gb = op.backward(grad, levels[-1], weight, kept, (False, *needs[1:]))[1:]
        g = returned()
        for h, below in zip(reversed(halos[:-1]), reversed(levels[:-2])):
            g = halo.start_return(g, tiles, h, tuple(below.shape), layer, owned=True)()
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


def _region_like(x: torch.Tensor, tiles: TileGroup, h: Halo) -> torch.Tensor:
    """An uninitialised tensor of the shape and format of ``halo.assemble``'s region of ``x`` for
    ``h``: what a max pooling's backward takes (no rows copied: ~2 ms a step for resnet18's stem
    pooling at 512^2 on two CPU ranks)."""
    need = h.needs[tiles.line(h.dim)[1]]
    shape = list(x.shape)
    shape[h.dim] = need[1] - need[0]
    return formats.empty_as(x, shape)


def _alone(op, halos: tuple[Halo, ...], tiles: TileGroup):
    """``op`` padded along every split axis as the layer pads the image, where that makes this
    tile's every output row from its own rows alone (``Sliding.alone``) and leaves it an interior
    (rows reading no halo); None otherwise (then the tile computes on the joined region only).
    Worked out once per layer geometry (``TileGroup.memo``)."""
    return tiles.memo(("alone", op, halos), _alone_op, op, halos, tiles)


def _alone_op(op, halos: tuple[Halo, ...], tiles: TileGroup):
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


def _outputs(x: torch.Tensor, op) -> int:
    """About how many values per channel ``op`` makes of the tile ``x``."""
    return x.shape[2] * x.shape[3] // (op.stride[0] * op.stride[1])


def _alone_first(x: torch.Tensor, weight: torch.Tensor | None, op, halos: tuple[Halo, ...]) -> bool:
    """Whether the tile computes alone, then its border (rather than on the joined region): where
    that costs less (``alone_cheaper``), or only a little more (``worth_alone``), so the tile
    computes while its halo travels."""
    rows = min(x.shape[h.dim] for h in halos)
    return (alone_cheaper(rows, None if weight is None else weight.shape[0])
            or worth_alone(_outputs(x, op), None if weight is None else weight[0].numel()))


def alone_cheaper(rows: int, out_channels: int | None) -> bool:
    """Whether a window computes a tile ``rows`` long along its split axes with less work alone and
    then its border than on the joined region, for ``out_channels`` filters (None: a pooling, whose
    border costs next to nothing). The region is a copy of the tile (its input channels x rows x
    width), the border a convolution of a few rows (input channels x width x filters x its window):
    on CPU, 3x3 convolutions of 64 filters on tiles of 256 rows cost 17 ms less alone (of 80),
    of 256 filters on 64 rows 1.4 ms more, of 128 on 32 rows about the same."""
    return out_channels is None or 2 * rows >= out_channels


def worth_alone(outputs: int, filter_size: int | None) -> bool:
    """Whether a tile of about ``outputs`` values per channel may compute alone and then its border
    while its halo travels, rather than wait for it, for a window whose one output channel's filter
    holds ``filter_size`` weights (None: a pooling): the border's convolution costs about a pass
    over the weights. On CPU, resnet18's 3x3 convolutions on 2x1 tiles at 512^2 cost 5-15% more
    alone on tiles of 16x32 and 8x16 (256, 512 channels) than on the joined region."""
    return filter_size is None or outputs >= filter_size


def border_first(outputs: int, filter_size: int) -> bool:
    """Whether a convolution's backward takes the border's gradients apart (``_border_backward``:
    the border's weight gradient costs a pass over the weights and more) rather than on the
    joined region (a copy of the tile): on CPU, with ``outputs`` values per channel of the tile and
    ``filter_size`` weights per filter, the border cost 1-20 ms less at 4 or more times as many
    outputs (64 channels on 64x128 tiles to 256 on 64x128), 2-26 ms more at 2 times or fewer
    (128 channels on 32x64, 512 on 32x64)."""
    return outputs >= 3 * filter_size


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


def _needed(halos: tuple[Halo, ...], tiles: TileGroup) -> tuple[Halo, ...]:
    return tuple(h for h in halos if not h.trivial(tiles))


def window(x: torch.Tensor, tiles: TileGroup, halos: tuple[Halo, ...], op, weight=None, bias=None) -> torch.Tensor:
    """``op`` (``Conv``, ``MaxPool``) on ``x`` joined with its ``halos`` (module docstring);
    halos every member needs nothing for are skipped."""
    halos = tuple(halos)
    halos = tiles.memo(("needed", halos), _needed, halos, tiles)
    if not halos:
        return op.forward(x, weight, bias)[0]
    return _Window.apply(x, weight, bias, tiles, halos, op)
