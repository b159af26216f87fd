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
leader keeps), and only the leader runs the units after it. A skip that goes from the prefix
straight to a suffix on another stage (``tile_skips``: no unit between reads it) is neither
gathered nor scattered: every rank keeps its tile of it, and the pipeline sends it tile to tile.
"""
from __future__ import annotations

import operator
import weakref
from collections import OrderedDict
from typing import Sequence

import torch
from torch import fx, nn

from gems.errors import GemsError
from gems.graph.split import LIVE_IN, READS
from gems.graph.trace import TRACING
from gems.spatial.tiles import TileGroup, gather, scatter
from gems.spatial.unit import Node, analyse, record_sizes


class TiledUnit(nn.Module):
    """One unit run on tiles (see the module docstring). ``plan``: {node: Node} of its nodes with
    tiled inputs; ``gathers``: for a spatial part's last unit, per output the global (H, W) it is
    gathered at, None for a replicated one; ``scatters``: for a suffix's first unit, the global
    shapes of its inputs, which the leader scatters (a member's input is one scalar or a tuple
    of them, its graph's link to what came before); ``kept``: outputs of a spatial part's last unit
    that stay tiles, ``given``: inputs of a suffix's first unit that arrive as tiles (``tile_skips``:
    a member's others are scalars then)."""

    def __init__(self, unit: nn.Module, flat: fx.GraphModule, tiles: TileGroup, plan: dict[fx.Node, Node],
                 gathers: list[tuple[int, int] | None] | None,
                 scatters: list[tuple[int, ...]] | None = None, kept: frozenset[int] = frozenset(),
                 given: frozenset[int] = frozenset()) -> None:
        super().__init__()
        object.__setattr__(self, "flat", flat)   # not a child: its modules are ours (same keys)
        self._modules, self._parameters, self._buffers = unit._modules, unit._parameters, unit._buffers
        self.meta = unit.meta
        self.tiles, self.plan, self.gathers, self.scatters = tiles, plan, gathers, scatters
        self.kept, self.given = kept, given
        self.dtype = next((p.dtype for p in unit.parameters()), torch.float32)

    def forward(self, x):
        if self.scatters is not None:
            x = self._scattered(x if isinstance(x, tuple) else (x,))
        out = _Tiled(self.flat, self).run(x)
        if self.gathers is None:
            return out
        outs = out if isinstance(out, tuple) else (out,)
        tiled = [k for k, size in enumerate(self.gathers) if size is not None and k not in self.kept]
        whole = gather(tuple(outs[k] for k in tiled), self.tiles,
                       [(outs[k].shape[0], outs[k].shape[1], *self.gathers[k]) for k in tiled]) if tiled else ()
        done = list(outs)
        for k, t in zip(tiled, whole):
            done[k] = t
        for k, size in enumerate(self.gathers):   # replicated: the leader's copy goes on; a member's feeds nothing
            if size is None and not self.tiles.leader:
                done[k] = outs[k].sum() * 0
        return tuple(done) if isinstance(out, tuple) or not self.tiles.leader else done[0]

    def _scattered(self, given: tuple):
        """A suffix's input tuple on this rank's tiles: those ``given`` as tiles as they are, the
        others scattered from the leader (a member's tied into one scalar for it)."""
        moved = [k for k in range(len(self.scatters)) if k not in self.given]
        if self.tiles.leader:
            whole = tuple(given[k] for k in moved)
        else:   # one scalar tying the member's earlier graph (if any) to this one
            links = [t for k, t in enumerate(given) if k not in self.given]
            whole = (sum(links[1:], links[0]).reshape(()),)
        tiles = iter(scatter(whole, self.tiles, [self.scatters[k] for k in moved], self.dtype) if moved else ())
        x = tuple(given[k] if k in self.given else next(tiles) for k in range(len(self.scatters)))
        return x if len(x) > 1 else x[0]


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


def tile_skips(units: Sequence[nn.Module], cuts: Sequence[int], end: int, start: int) -> frozenset[str]:
    """The names of the tensors that go from a spatial prefix's tiles (units ``[0, end)``) straight
    to a suffix's (from ``start``) on another stage of ``cuts``: alive where the prefix ends and
    where the suffix starts, read by no unit between, so no rank needs them whole. None without a
    suffix, with one stage, or for units without graph metadata (an ``nn.Sequential``'s)."""
    metas = [getattr(u, "meta", None) for u in units[end:start + 1]]
    if not start or len(cuts) < 3 or not all(isinstance(m, dict) and LIVE_IN in m for m in metas):
        return frozenset()
    read = {m[LIVE_IN][q] for m in metas[:-1] for q in m[READS]}
    return frozenset(set(metas[0][LIVE_IN]) & set(metas[-1][LIVE_IN]) - read)


def tile_stage(stage: nn.Sequential, first: int, end: int, names: Sequence[str], tiles: TileGroup,
               image: Sequence[int], start: int = 0, before: Sequence[nn.Module] = (),
               skips: frozenset[str] = frozenset(), after: Sequence[str] = ()) -> nn.Sequential:
    """``stage`` (units numbered from ``first``) with its spatial units tiled: the prefix
    ``[first, end)`` (``end`` > 0; then ``first`` must be 0: it starts at the image, this rank's
    tile of which the stage takes) and the suffix ``[start, first + len(stage))`` (``start`` > 0;
    its inputs scattered from the leader). ``names``: the model's unit names; ``image``: the
    (N, C, H, W) of a whole image batch (N: any); ``before``: the model's units before the stage
    (to size a suffix's inputs); ``skips``: ``tile_skips``, kept as tiles; ``after``: the names
    alive after the stage's last unit. On a member of the group the stage keeps only its tiled
    units, every other one a ``Pass`` (so units keep their numbers: recompute segments still
    apply), which with ``skips`` keeps each tensor at its name's place."""
    units, keys = list(stage.children()), list(stage._modules)
    if end and first != 0:
        raise GemsError("the spatial part of a plan starts at the image: tile the first stage")
    live = [u.meta[LIVE_IN] for u in units] + [tuple(after)] if skips else None
    kept = list(units)
    if end:
        out = live[end - first] if skips else ()
        kept[:end - first] = _tiled(units[:end - first], first, names, tiles, image, (), scatter_in=False,
                                    skips=frozenset(k for k, name in enumerate(out) if name in skips))
    if start:
        given = live[start - first] if skips else ()
        kept[start - first:] = _tiled(units[start - first:], start, names, tiles, image,
                                      list(before) + units[:start - first], scatter_in=True,
                                      skips=frozenset(k for k, name in enumerate(given) if name in skips))
    if not tiles.leader:
        kept = [k if isinstance(k, TiledUnit) else Pass(live[i:i + 2] if live else None) for i, k in enumerate(kept)]
    return nn.Sequential(OrderedDict(zip(keys, kept)))


def _tiled(units: list[nn.Module], first: int, names: Sequence[str], tiles: TileGroup, image: Sequence[int],
           before: Sequence[nn.Module], scatter_in: bool, skips: frozenset[int] = frozenset()) -> list[TiledUnit]:
    """``units`` (numbered from ``first``) as TiledUnits: their inputs tiled (the image's tile, or
    with ``scatter_in`` a boundary the first one scatters but for the tiles ``skips`` it is given),
    the last one's outputs gathered but for those ``skips`` keeps (without ``scatter_in``)."""
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
            if not scatter_in and any(gathers[o] is None for o in skips):
                raise GemsError(f"unit {names[first + k]} hands a suffix a tensor that is not tiled: end the spatial "
                                "part elsewhere, or train without a suffix")
        made.append(TiledUnit(unit, flat, tiles, plan, gathers=gathers, scatters=scatters if k == 0 else None,
                              kept=skips if gathers is not None and not scatter_in else frozenset(),
                              given=skips if scatter_in and k == 0 else frozenset()))
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
    """A member's stand-in for a unit only its leader runs: its input goes on unchanged; or, given
    the ``names`` of the unit's input and output tuples, each tensor it passes on at its name's
    place and what the unit makes as one scalar tying those it drops (so that their backward --
    a gather's, receiving the tiles' gradients -- still runs)."""

    def __init__(self, names: Sequence[Sequence[str]] | None = None) -> None:
        super().__init__()
        self.names = names

    def forward(self, x):
        if self.names is None:
            return x
        taken, given = self.names
        xs = x if isinstance(x, tuple) else (x,)
        dropped = [t.sum() for name, t in zip(taken, xs) if name not in given]
        link = sum(dropped[1:], dropped[0]) * 0 if dropped else xs[0].new_zeros(())
        out = tuple(xs[taken.index(name)] if name in taken else link for name in given)
        return out if len(out) > 1 else out[0]


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
