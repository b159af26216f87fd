"""What a plan with a spatial part changes on a rank (``gems.spatial``): the tile groups, a
member's actions and its stages.

A tile group's leader runs its position's action list as any rank does; the forwards and
backwards of its tiled stages (stage 0, and the last with a suffix) are collective over its tile
group. A member runs only those, plus their reduces, the sync and the step (its parameters are
their tiled units'), in the leader's order -- so every member issues the tile exchanges in the
same order (``gems.schedule.members``). The leader gathers a prefix's boundary from the tiles and
sends it on, and scatters a suffix's inputs to them, but for the skips that go tile to tile
(``gems.pipeline.routes``): those each member sends and receives itself, to and from the member
holding the same tile on the other side. A member's stage keeps every unit's place
(``gems.spatial.stage.Pass`` for those only the leader runs), so its policy is the leader's.
"""
from __future__ import annotations

import torch
from torch import nn

from gems.graph.split import LIVE_IN
from gems.schedule.topology import Topology
from gems.spatial import TiledUnit, TileGroup, tile_stage
from gems.spatial.stage import tile_skips


def tile_groups(comm, topology: Topology, grid: list[int]) -> TileGroup | None:
    """This rank's tile group (None without a spatial part). COLLECTIVE: every rank creates every
    tile group's communicator, in the same order."""
    if topology.tiles == 1:
        return None
    mine = None
    for d in range(topology.groups):
        for p in topology.tiled:
            ranks = [topology.rank(d, p, t) for t in range(topology.tiles)]
            group = comm.group(ranks)
            if comm.rank in ranks:
                mine = TileGroup(comm, ranks, (grid[0], grid[1]), ranks.index(comm.rank), group)
    return mine


def tiled_stage(module: nn.Sequential, stage: int, plan, tiles: TileGroup, rows: int,
                model: nn.Sequential) -> nn.Sequential:
    """Stage ``stage`` with its spatial units tiled: stage 0's prefix ``[0, plan.spatial_end)``,
    the last stage's suffix ``[plan.spatial_start, ...)`` (``model``: every unit, to size it)."""
    first, last = plan.cuts[stage], plan.cuts[stage + 1]
    end = plan.spatial_end if stage == 0 else 0
    start = plan.spatial_start if stage == plan.stages - 1 else 0
    units = list(model)
    skips = tile_skips(units, plan.cuts, plan.spatial_end, plan.spatial_start)
    after = units[last].meta[LIVE_IN] if skips and last < len(units) else ()
    return tile_stage(module, first, end, plan.unit_names, tiles, torch.Size((rows, *plan.input_shape)), start,
                      units[:first], skips, after)


def sync_parts(topology: Topology, rank: int, stages: dict[int, nn.Module]) -> dict | None:
    """How a leader's stages sync when a tiled stage has units only the leader runs (``GradSync``'s
    ``parts``): its tiled units over every tile, the rest over the leaders alone (the members hold
    no copy of it); None where the default (each stage over its holders) is right."""
    if topology.tiles == 1 or topology.place(rank)[2]:
        return None
    parts = {s: [(m, topology.holders(s))] for s, m in stages.items()}
    split = False
    for s in sorted(topology.tiled_stages & set(stages)):
        units = list(stages[s].children())
        tiled = [u for u in units if isinstance(u, TiledUnit)]
        if len(tiled) < len(units):
            split = True
            parts[s] = [(nn.Sequential(*tiled), topology.holders(s)),
                        (nn.Sequential(*[u for u in units if not isinstance(u, TiledUnit)]), topology.leaders(s))]
    return parts if split else None
