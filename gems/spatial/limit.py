"""How far a model's spatial part can reach, and what its layers exchange: ``gems.spatial.unit``'s
analysis seen from the planner, without running anything (one fake pass, ``record_sizes``).

    reach = spatial_limit(units, names, (2, 3, 16384, 16384))
    reach.end, reach.reason   # units [0, end) can be tiled; why no further (None: all units can)
    reach.windows             # the sliding windows (convolutions, pooling) of those units
    suffix_limit(units, names, image, start)   # units [start, n) on tiles, inputs scattered: a Reach, or None

The spatial part ends before the first unit that ``analyse`` refuses (its sentence is the
reason), and after the first unit that leaves nothing tiled (a global pooling: what follows runs
on one value, so tiling it saves nothing). A grid is only as fine as the smallest tiled
activation allows (``gems.spatial.stage.check_grid``): ``end_for`` shortens the reach for one.
Windows called as functions (``F.conv2d``) are tiled by the runtime but not listed here, so the
planner prices them without their halo.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import fx, nn

from gems.errors import GemsError
from gems.spatial.geometry import Sliding, halo, parts, window_need
from gems.spatial.ops import _pair, conv_padding
from gems.spatial.stage import check_grid, flatten, input_shapes
from gems.spatial.unit import Unsized, analyse, record_sizes
from gems.spatial.window import alone_cheaper, border_first

HW = tuple[int, int]


@dataclass(frozen=True)
class Window:
    """One tiled sliding-window layer of unit ``unit``: global input and output (H, W), its
    geometry per axis, and its input's (batch, channels)."""

    unit: int
    size_in: HW
    size_out: HW
    kernel: HW
    stride: HW
    pad: HW
    dilation: HW
    batch: int
    channels: int
    kind: str = "conv"     # "conv", "max" or "avg" pooling
    filters: int = 0       # a convolution's output channels, and the weights of one of its filters
    filter_size: int = 0

    def halos(self, grid: HW) -> HW:
        """The most rows and columns any tile of this layer's input fetches beyond its own."""
        return tuple(halo(self.size_in[a], grid[a], self.size_out[a], self.kernel[a], self.stride[a], self.pad[a],
                          self.dilation[a]) if grid[a] > 1 else 0 for a in (0, 1))

    def fetched(self, grid: HW) -> int:
        """Elements one rank fetches at most: its tile extended by the halo, less the tile."""
        (hr, hc), (tr, tc) = self.halos(grid), (math.ceil(self.size_in[0] / grid[0]),
                                                math.ceil(self.size_in[1] / grid[1]))
        return self.batch * self.channels * ((tr + hr) * (tc + hc) - tr * tc)

    def copies(self, grid: HW) -> tuple[int, int]:
        """Elements of the copies of its tile this layer holds at once beyond PyTorch's own layer
        (which reads its saved input in place and makes one input gradient) and beyond the halo
        that ``fetched`` counts (once in forward, twice in backward); (forward, backward), as
        ``gems.spatial.window`` runs it. Forward: a tile that computes alone and then its border
        joins no region (a large tile of few filters, ``alone_cheaper``); any other holds the tile
        joined with its halo while it computes, a tile more (priced for every other layer, also one that
        goes alone as ``worth_alone`` allows: a bound). Backward: a convolution
        that takes its border's gradients apart (``border_first``) joins none; any other rebuilds
        the regions, one per split axis, and makes the outer region's gradient, each tile's
        gradient a view of the one above it -- one halo: a tile more; two: the inner region and a
        tile more -- and where a strided window leaves some of a tile's rows unread, that gradient
        a copy: an inner region more."""
        (hr, hc), (tr, tc) = self.halos(grid), (math.ceil(self.size_in[0] / grid[0]),
                                                math.ceil(self.size_in[1] / grid[1]))
        tile = tr * tc
        if not (hr or hc):
            return 0, 0
        one = not (hr and hc)
        alone = one and self.alone(grid)
        rows = min(t for t, h in zip((tr, tc), (hr, hc)) if h)
        forward = 0 if alone and alone_cheaper(rows, self.filters or None) else tile
        if alone and self.kind == "conv" and border_first(tile // (self.stride[0] * self.stride[1]), self.filter_size):
            return self.batch * self.channels * forward, 0
        inner = (tr + hr) * tc if hr else tr * (tc + hc)   # the region after the first halo
        backward = tile if one else inner + tile
        if not self.reads_every_row(grid):
            backward += inner
        return self.batch * self.channels * forward, self.batch * self.channels * backward

    def alone(self, grid: HW) -> bool:
        """Whether every tile of ``grid`` can compute this layer from its own rows, padded as the
        image is, then its border (``gems.spatial.window._alone``): along each split axis its
        output rows start where its rows do, and some of them read no halo."""
        for a in (0, 1):
            if grid[a] == 1:
                continue
            w = Sliding(self.kernel[a], self.stride[a], self.pad[a], self.dilation[a])
            for own, out in zip(parts(self.size_in[a], grid[a]), parts(self.size_out[a], grid[a])):
                inner = w.inner(out, own, self.size_in[a])
                if not w.alone(out, own) or inner[0] >= inner[1]:
                    return False
        return True

    def reads_every_row(self, grid: HW) -> bool:
        """Whether every tile's output reads all of the tile's own rows and columns (a strided
        window may leave the last ones unread)."""
        for a in (0, 1):
            for own, out in zip(parts(self.size_in[a], grid[a]), parts(self.size_out[a], grid[a])):
                if out[0] < out[1] and grid[a] > 1:
                    lo, hi = window_need(out, self.kernel[a], self.stride[a], self.pad[a], self.dilation[a])
                    if lo > own[0] or hi < own[1]:
                        return False
        return True

    def traffic(self, grid: HW) -> int:
        """Elements the whole grid exchanges: halo rows x image width per border between rows of
        tiles, and halo columns x height per border between columns."""
        (hr, hc), (H, W) = self.halos(grid), self.size_in
        return self.batch * self.channels * (hr * W * (grid[0] - 1) + hc * H * (grid[1] - 1))


@dataclass(frozen=True)
class Reach:
    """What ``spatial_limit`` found (module docstring)."""

    end: int
    reason: str | None        # a sentence naming the unit that ends the reach; None: every unit is tiled
    windows: list[Window]
    sizes: list[list[HW]]     # per unit in [first, end): the global (H, W) of its tiled values
    names: list[str]
    first: int = 0            # a suffix's start (its inputs scattered); 0: a prefix from the image
    weights: tuple[int, ...] = ()   # per unit of the model, elements of its largest trainable parameter
                                    # (its gradient, and a kernel's copy of it, are whole on every tile)

    def end_for(self, grid: HW, end: int | None = None) -> int:
        """The longest prefix, up to ``end`` (default: the reach), whose tiled activations all hold
        a tile of ``grid``; GemsError (``check_grid``'s sentence) when not even unit 0's do."""
        end = self.end if end is None else end
        for k in range(end - self.first):
            try:
                check_grid(self.sizes[k], self.names[self.first + k], grid)
            except GemsError:
                if k == 0:
                    raise
                return self.first + k
        return end


def spatial_limit(units: Sequence[fx.GraphModule], names: Sequence[str], image: Sequence[int]) -> Reach:
    """How far the units (an image batch of ``image`` = (N, C, H, W) going in) can run on tiles,
    with the windows and tiled sizes of that prefix (module docstring)."""
    weights = largest_weights(units)
    units = [flatten(unit) for unit in units]   # as the runtime runs them: down to torch.nn's layers
    try:
        shapes, unsized = record_sizes(units, torch.Size(image)), None
    except Unsized as error:   # the units before it can still be tiled
        shapes, unsized = error.found, error
    tiled_in, windows, sizes = [True], [], []
    for k, unit in enumerate(units):
        if k == len(shapes):
            return Reach(k, f"unit {names[k]} does not run as traced on its own ({unsized.cause}), so it cannot be "
                            f"sized on tiles; end the spatial part at most {k} units in, before it", windows, sizes,
                         list(names), weights=weights)
        found = shapes[k]
        try:
            plan, tiled_in = analyse(unit, names[k], found, tiled_in)
        except GemsError as error:
            return Reach(k, str(error), windows, sizes, list(names), weights=weights)
        sizes.append([node.size_out for node in plan.values() if node.tiled] + [tuple(image[2:])])
        windows += [w for n in plan for w in _window(unit, n, k, found)]
        if not any(tiled_in):
            return Reach(k + 1, f"unit {names[k]} leaves no value tiled (it pools the whole image), so nothing after "
                                f"it is worth tiling; end the spatial part at most {k + 1} units in, after unit "
                                f"{names[k]}", windows, sizes, list(names), weights=weights)
    return Reach(len(units), None, windows, sizes, list(names), weights=weights)


def largest_weights(units: Sequence[nn.Module]) -> tuple[int, ...]:
    """Per unit, the elements of its largest trainable parameter (``Reach.weights``)."""
    return tuple(max((p.numel() for p in unit.parameters() if p.requires_grad), default=0) for unit in units)


def sizes_of(units: Sequence[nn.Module], image: Sequence[int]) -> list[dict]:
    """``record_sizes`` of all the units, flattened as the runtime runs them, from an image batch of
    ``image``: what ``suffix_limit`` takes to try many starts on one fake pass. Where a unit cannot be
    sized, those before it (no suffix reaches the model's end through that unit)."""
    try:
        return record_sizes([flatten(unit) for unit in units], torch.Size(image))
    except Unsized as error:
        return error.found


def suffix_limit(units: Sequence[nn.Module], names: Sequence[str], image: Sequence[int], start: int,
                 shapes: Sequence[dict] | None = None) -> Reach | None:
    """The Reach of units [start, n) run on tiles, their inputs (images, all of them) scattered
    from the leader; None when one of those units cannot be tiled, or leaves nothing tiled before
    the model's end (then a suffix there saves nothing). ``shapes``: ``sizes_of(units, image)``, for a
    caller trying many starts (one fake pass, not one each)."""
    tail = [flatten(unit) for unit in units[start:]]
    try:
        shapes = record_sizes(tail, torch.Size(image), units[:start]) if shapes is None else shapes[start:]
    except Unsized:
        return None
    if len(shapes) < len(tail):   # a unit of the suffix cannot be sized (sizes_of stopped before it)
        return None
    try:
        scattered = input_shapes(tail[0], shapes[0], names[start])
    except GemsError:
        return None
    tiled_in, windows, sizes = [True] * len(scattered), [], []
    for k, (unit, found) in enumerate(zip(tail, shapes)):
        try:
            plan, tiled_in = analyse(unit, names[start + k], found, tiled_in)
        except GemsError:
            return None
        sizes.append([node.size_out for node in plan.values() if node.tiled] + [tuple(s[2:]) for s in scattered])
        windows += [w for n in plan for w in _window(unit, n, start + k, found)]
        if not any(tiled_in) and k < len(tail) - 1:
            return None
    return Reach(len(units), None, windows, sizes, list(names), start, largest_weights(units))


def _window(unit: fx.GraphModule, n: fx.Node, k: int, shapes: dict) -> list[Window]:
    """The node as a Window if it is a convolution or pooling module (module docstring)."""
    if n.op != "call_module":
        return []
    m = unit.get_submodule(n.target)
    source = shapes[n.all_input_nodes[0]]
    if isinstance(m, nn.Conv2d):
        kernel, dilation = _pair(m.kernel_size), _pair(m.dilation)
        geometry = kernel, _pair(m.stride), conv_padding(m.padding, kernel, dilation), dilation
    elif isinstance(m, (nn.MaxPool2d, nn.AvgPool2d)):
        kernel = _pair(m.kernel_size)
        stride = _pair(m.stride) if m.stride not in (None, []) else kernel
        geometry = kernel, stride, _pair(m.padding), _pair(getattr(m, "dilation", 1))
    else:
        return []
    kind = "conv" if isinstance(m, nn.Conv2d) else "max" if isinstance(m, nn.MaxPool2d) else "avg"
    filters = (m.out_channels, m.weight[0].numel()) if kind == "conv" else (0, 0)
    return [Window(k, tuple(source[2:]), tuple(shapes[n][2:]), *geometry, source[0], source[1], kind, *filters)]
