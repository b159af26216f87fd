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

import weakref
from collections import OrderedDict
from typing import Sequence

import torch
from torch import fx, nn

from gems.errors import GemsError
from gems.graph.trace import TRACING
from gems.spatial.tiles import TileGroup, gather
from gems.spatial.unit import Node, analyse, record_sizes


class TiledUnit(nn.Module):
    """One unit run on tiles (see the module docstring). ``plan``: {node: Node} of its nodes with
    tiled inputs; ``gathers``: for the spatial part's last unit, per output the global (H, W) it
    is gathered at, None for a replicated one."""

    def __init__(self, unit: nn.Module, flat: fx.GraphModule, tiles: TileGroup, plan: dict[fx.Node, Node],
                 gathers: list[tuple[int, int] | None] | None) -> None:
        super().__init__()
        object.__setattr__(self, "flat", flat)   # not a child: its modules are ours (same keys)
        self._modules, self._parameters, self._buffers = unit._modules, unit._parameters, unit._buffers
        self.meta = unit.meta
        self.tiles, self.plan, self.gathers = tiles, plan, gathers

    def forward(self, x):
        out = _Tiled(self.flat, self).run(x)
        if self.gathers is None:
            return out
        outs = out if isinstance(out, tuple) else (out,)
        done = tuple(self._gather(t, size) for t, size in zip(outs, self.gathers))
        return done if isinstance(out, tuple) or not self.tiles.leader else done[0]

    def _gather(self, t: torch.Tensor, size: tuple[int, int] | None) -> torch.Tensor:
        if size is None:   # replicated: the leader's copy goes on; a member's copy feeds nothing
            return t if self.tiles.leader else t.sum() * 0
        return gather(t, self.tiles, (t.shape[0], t.shape[1], *size))


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
               image: Sequence[int]) -> nn.Sequential:
    """``stage`` (units numbered from ``first``, which must be 0: the spatial part starts at the
    image) with units ``[first, end)`` tiled, taking this rank's tile of the images; on a member of
    the group, only those units. ``names``: the model's unit names; ``image``: the (N, C, H, W) of
    a whole image batch (N: any)."""
    units = list(stage.children())
    keys = list(stage._modules)
    spatial = units[:end - first]
    if first != 0:
        raise GemsError("the spatial part of a plan starts at the image: tile the first stage")
    flats = [flatten(unit) for unit in spatial]
    sizes = record_sizes(flats, torch.Size(image))
    tiled_in, made = [True], []
    for k, (unit, flat, shapes) in enumerate(zip(spatial, flats, sizes)):
        plan, tiled_out = analyse(flat, names[first + k], shapes, tiled_in)
        check_grid([node.size_out for node in plan.values() if node.tiled] + [tuple(image[2:])], names[first + k],
                   tiles.grid)
        gathers = None
        if k == len(spatial) - 1:
            out = next(n for n in flat.graph.nodes if n.op == "output").args[0]
            outs = out if isinstance(out, (tuple, list)) else (out,)
            gathers = [tuple(shapes[o][2:]) if tiled else None for o, tiled in zip(outs, tiled_out)]
        made.append(TiledUnit(unit, flat, tiles, plan, gathers=gathers))
        tiled_in = tiled_out
    kept = made + (units[end - first:] if tiles.leader else [])
    return nn.Sequential(OrderedDict(zip(keys, kept)))


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
