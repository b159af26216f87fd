"""A stage whose first units run on tiles: ``tile_stage`` turns units ``[first, end)`` of it into
``TiledUnit``s and gathers what crosses ``end`` on the tile group's leader.

    stage = tile_stage(units[0:hi], 0, end, names, tiles, image=(micro, 3, 2048, 2048))
    leader: stage(tiles.tile(images)) -> the stage's output;  member: stage(tiles.tile(images)) ->
    empty scalars whose backward waits for the tiles' gradients from the leader

A ``TiledUnit`` shares its unit's parameters, buffers and submodules (same state-dict keys, so
checkpoints stay keyed by ``model.state_dict()``) and runs the unit's graph node by node: tiled
nodes through their handlers (``gems.spatial.unit``), the rest as they are. The stage takes this
rank's tile of the image batch (``TileGroup.tile``: the engine cuts it before moving it to the
device, so a device holds its tile of the images only); the last unit gathers its tiled outputs
on the leader (``gems.spatial.tiles.gather``; a replicated one the
leader keeps), and only the leader runs the units after it.
"""
from __future__ import annotations

import operator
import weakref
from collections import OrderedDict
from typing import Sequence

import torch
from torch import fx, nn

from gems.errors import GemsError
from gems.graph.trace import TRACING
from gems.spatial.tiles import TileGroup, gather, scatter
from gems.spatial.unit import Node, analyse, record_sizes


class TiledUnit(nn.Module):
    """One unit run on tiles (see the module docstring). ``plan``: {node: Node} of its nodes with
    tiled inputs; ``gathers``: for a spatial part's last unit, per output the global (H, W) it is
    gathered at, None for a replicated one; ``scatters``: for a suffix's first unit, the global
    shapes of its inputs, which the leader scatters (a member's input is one scalar or a tuple
    of them, its graph's link to what came before)."""

    def __init__(self, unit: nn.Module, flat: fx.GraphModule, tiles: TileGroup, plan: dict[fx.Node, Node],
                 gathers: list[tuple[int, int] | None] | None,
                 scatters: list[tuple[int, ...]] | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "flat", flat)   # not a child: its modules are ours (same keys)
        self._modules, self._parameters, self._buffers = unit._modules, unit._parameters, unit._buffers
        self.meta = unit.meta
        self.tiles, self.plan, self.gathers, self.scatters = tiles, plan, gathers, scatters
        self.dtype = next((p.dtype for p in unit.parameters()), torch.float32)

    def forward(self, x):
        if self.scatters is not None:
            given = x if isinstance(x, tuple) else (x,)
            if not self.tiles.leader:   # one scalar tying the member's earlier graph (if any) to this one
                given = (sum(given[1:], given[0]).reshape(()),)
            tiles = scatter(given, self.tiles, self.scatters, self.dtype)
            x = tiles if len(self.scatters) > 1 else tiles[0]
        out = _Tiled(self.flat, self).run(x)
        if self.gathers is None:
            return out
        outs = out if isinstance(out, tuple) else (out,)
        tiled = [k for k, size in enumerate(self.gathers) if size is not None]
        whole = gather(tuple(outs[k] for k in tiled), self.tiles,
                       [(outs[k].shape[0], outs[k].shape[1], *self.gathers[k]) for k in tiled]) if tiled else ()
        done = list(outs)
        for k, t in zip(tiled, whole):
            done[k] = t
        for k, size in enumerate(self.gathers):   # replicated: the leader's copy goes on; a member's feeds nothing
            if size is None and not self.tiles.leader:
                done[k] = outs[k].sum() * 0
        return tuple(done) if isinstance(out, tuple) or not self.tiles.leader else done[0]


class _Tiled(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, owner: TiledUnit) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.owner = owner

    def run_node(self, n: fx.Node):
        node = self.owner.plan.get(n)
        if node is None:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        module = self.module.get_submodule(n.target) if n.op == "call_module" else None
        return node.run(self.owner.tiles, node, args, kwargs, module)


def tile_stage(stage: nn.Sequential, first: int, end: int, names: Sequence[str], tiles: TileGroup,
               image: Sequence[int], start: int = 0, before: Sequence[nn.Module] = ()) -> nn.Sequential:
    """``stage`` (units numbered from ``first``) with its spatial units tiled: the prefix
    ``[first, end)`` (``end`` > 0; then ``first`` must be 0: it starts at the image, this rank's
    tile of which the stage takes) and the suffix ``[start, first + len(stage))`` (``start`` > 0;
    its inputs scattered from the leader). ``names``: the model's unit names; ``image``: the
    (N, C, H, W) of a whole image batch (N: any); ``before``: the model's units before the stage
    (to size a suffix's inputs). On a member of the group the stage keeps only its tiled units,
    every other one a ``Pass`` (so units keep their numbers: recompute segments still apply)."""
    units, keys = list(stage.children()), list(stage._modules)
    if end and first != 0:
        raise GemsError("the spatial part of a plan starts at the image: tile the first stage")
    kept = list(units)
    if end:
        kept[:end - first] = _tiled(units[:end - first], first, names, tiles, image, (), scatter_in=False)
    if start:
        kept[start - first:] = _tiled(units[start - first:], start, names, tiles, image,
                                      list(before) + units[:start - first], scatter_in=True)
    if not tiles.leader:
        kept = [k if isinstance(k, TiledUnit) else Pass() for k in kept]
    return nn.Sequential(OrderedDict(zip(keys, kept)))


def _tiled(units: list[nn.Module], first: int, names: Sequence[str], tiles: TileGroup, image: Sequence[int],
           before: Sequence[nn.Module], scatter_in: bool) -> list[TiledUnit]:
    """``units`` (numbered from ``first``) as TiledUnits: their inputs tiled (the image's tile, or
    with ``scatter_in`` a boundary the first one scatters), the last one's outputs gathered."""
    flats = [flatten(unit) for unit in units]
    sizes = record_sizes(flats, torch.Size(image), before)
    tiled_in = [True] * (inputs_of(flats[0], sizes[0]) if scatter_in else 1)
    scatters = None
    if scatter_in:
        scatters = input_shapes(flats[0], sizes[0], names[first])
        check_grid([tuple(shape[2:]) for shape in scatters], names[first], tiles.grid)
    made = []
    for k, (unit, flat, shapes) in enumerate(zip(units, flats, sizes)):
        plan, tiled_out = analyse(flat, names[first + k], shapes, tiled_in)
        check_grid([node.size_out for node in plan.values() if node.tiled] + [tuple(image[2:])], names[first + k],
                   tiles.grid)
        gathers = None
        if k == len(units) - 1:
            out = next(n for n in flat.graph.nodes if n.op == "output").args[0]
            outs = out if isinstance(out, (tuple, list)) else (out,)
            gathers = [tuple(shapes[o][2:]) if tiled else None for o, tiled in zip(outs, tiled_out)]
        made.append(TiledUnit(unit, flat, tiles, plan, gathers=gathers, scatters=scatters if k == 0 else None))
        tiled_in = tiled_out
    return made


def inputs_of(flat: fx.GraphModule, shapes: dict) -> int:
    """How many tensors a unit takes: its placeholder's, or the tuple its getitems read."""
    placeholder = next(n for n in flat.graph.nodes if n.op == "placeholder")
    if placeholder in shapes:
        return 1
    return 1 + max((n.args[1] for n in placeholder.users if n.target is operator.getitem), default=0)


def input_shapes(flat: fx.GraphModule, shapes: dict, name: str) -> list[tuple[int, ...]]:
    """The global shapes of a suffix's inputs; GemsError unless every one is an image-like
    (N, C, H, W) tensor, the only kind a tile group can share out."""
    placeholder = next(n for n in flat.graph.nodes if n.op == "placeholder")
    if placeholder in shapes:
        found = [shapes[placeholder]]
    else:
        reads = {n.args[1]: shapes.get(n) for n in placeholder.users if n.target is operator.getitem}
        found = [reads.get(i) for i in range(inputs_of(flat, shapes))]
    if any(shape is None or len(shape) != 4 for shape in found):
        raise GemsError(f"the spatial suffix cannot start at unit {name}: its inputs are not all images (N, C, H, W) "
                        "that tiles can split; start it at another unit, or train without a suffix")
    return [tuple(shape) for shape in found]


class Pass(nn.Module):
    """A member's stand-in for a unit only its leader runs: its input goes on unchanged."""

    def forward(self, x):
        return x


_FLAT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def flatten(unit: nn.Module) -> fx.GraphModule:
    """``unit`` traced down to torch.nn's own layers (a zoo model's unit is a whole block or an
    ``nn.Sequential``), its modules shared: what ``analyse`` and ``TiledUnit`` go through. Kept per
    unit: fx patches nn.Module process-wide while it traces, so a caller running ranks as threads
    flattens the units first, in one thread."""
    if unit not in _FLAT:
        with TRACING:
            _FLAT[unit] = fx.GraphModule(unit, fx.Tracer().trace(unit))
    return _FLAT[unit]


def check_grid(sizes: list[tuple[int, int]], name: str, grid: tuple[int, int]) -> None:
    """GemsError if a tiled activation of unit ``name`` (global ``sizes``) is smaller than the grid
    (a tile would be empty)."""
    rows, cols = grid
    for h, w in sizes:
        if h < rows or w < cols:
            raise GemsError(f"a {rows}x{cols} tile grid is larger than the tile side allows: unit {name} makes a "
                            f"{h}x{w} activation; use fewer tiles (--spatial) or end the spatial part before unit "
                            f"{name}")
