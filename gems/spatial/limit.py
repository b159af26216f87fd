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
from gems.spatial.geometry import Sliding, halo, parts
from gems.spatial.ops import _pair, conv_padding
from gems.spatial.stage import check_grid, flatten, input_shapes
from gems.spatial.unit import Unsized, analyse, record_sizes
from gems.spatial.window import worth_alone

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
    kind: str = "conv"     # "conv", "max" or "avg" pooling: how gems.spatial runs it (``copies``)

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
        that ``fetched`` counts twice in backward; (forward, backward). ``gems.spatial.window``
        joins the tile with each halo in turn (one per split axis): forward holds the joined
        region while it computes, a tile more; backward rebuilds the regions and cuts the
        gradient of each from the one above it -- one halo: the region, the region's gradient and
        the tile's, two tiles more; two: both regions, the outer one's gradient and the inner's,
        two inner regions and a tile more. Where every tile computes alone while its one halo
        travels (``alone``), forward joins no region (the border's rows only), nor does a
        convolution's backward."""
        (hr, hc), (tr, tc) = self.halos(grid), (math.ceil(self.size_in[0] / grid[0]),
                                                math.ceil(self.size_in[1] / grid[1]))
        tile = tr * tc
        if not (hr or hc):
            return 0, 0
        if self.alone(grid):
            return 0, 0 if self.kind == "conv" else 2 * self.batch * self.channels * tile
        inner = (tr + hr) * tc if hr else tr * (tc + hc)   # the region after the first halo
        backward = 2 * inner + tile if hr and hc else 2 * tile
        return self.batch * self.channels * tile, self.batch * self.channels * backward

    def alone(self, grid: HW) -> bool:
        """Whether every tile of ``grid`` computes this layer from its own rows while its halo, along
        one axis, travels (``gems.spatial.window._alone``: its output rows start where its rows do,
        some of them read no halo, and the border's convolutions cost less than joining the region:
        ``worth_alone``, here for a filter of ``channels`` input channels)."""
        halos = self.halos(grid)
        if self.kind == "avg" or sum(1 for h in halos if h) != 1:   # average pooling fetches its halo first
            return False
        outputs = math.ceil(self.size_out[0] / grid[0]) * math.ceil(self.size_out[1] / grid[1])
        filter_size = self.channels * self.kernel[0] * self.kernel[1] if self.kind == "conv" else None
        if not worth_alone(outputs, filter_size):
            return False
        a = 0 if halos[0] else 1
        w = Sliding(self.kernel[a], self.stride[a], self.pad[a], self.dilation[a])
        for own, out in zip(parts(self.size_in[a], grid[a]), parts(self.size_out[a], grid[a])):
            inner = w.inner(out, own, self.size_in[a])
            if not w.alone(out, own) or inner[0] >= inner[1]:
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
                         list(names))
        found = shapes[k]
        try:
            plan, tiled_in = analyse(unit, names[k], found, tiled_in)
        except GemsError as error:
            return Reach(k, str(error), windows, sizes, list(names))
        sizes.append([node.size_out for node in plan.values() if node.tiled] + [tuple(image[2:])])
        windows += [w for n in plan for w in _window(unit, n, k, found)]
        if not any(tiled_in):
            return Reach(k + 1, f"unit {names[k]} leaves no value tiled (it pools the whole image), so nothing after "
                                f"it is worth tiling; end the spatial part at most {k + 1} units in, after unit "
                                f"{names[k]}", windows, sizes, list(names))
    return Reach(len(units), None, windows, sizes, list(names))


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
    return Reach(len(units), None, windows, sizes, list(names), start)


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
    return [Window(k, tuple(source[2:]), tuple(shapes[n][2:]), *geometry, source[0], source[1], kind)]
