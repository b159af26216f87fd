"""What a plan with a spatial part changes on a rank (``gems.spatial``): the tile groups, a
member's actions, its stage and its policy.

A tile group's leader runs its position's action list as any rank does; the stage-0 forward
and backward it runs are collective over its tile group. A member runs only those, plus the
reduces of stage 0, the sync and the step (its parameters are stage 0's), in the leader's order
-- so every member issues the tile exchanges in the same order -- and exchanges no pipeline
message: the leader gathers the boundary from the tiles and sends it on.
"""
from __future__ import annotations

import torch
from torch import nn

from gems.errors import GemsError
from gems.pipeline import ir
from gems.pipeline.topology import Topology
from gems.plan import StagePolicy
from gems.spatial import TileGroup, tile_stage


class NoMessages:
    """A member's messenger: it exchanges no pipeline message (its leader does)."""

    def __init__(self, position: int) -> None:
        self.position = position

    def begin_step(self) -> None:
        pass

    def finish_sends(self) -> None:
        pass


def check_spatial(tiles: int, shard_optimizer: bool, batch_norm: str) -> None:
    """GemsError for what a spatial part (tile groups of ``tiles`` ranks; 1: none) does not combine with yet."""
    if tiles == 1:
        return
    if shard_optimizer:
        raise GemsError("a plan with a spatial part cannot shard the optimizer (its stages sync over different "
                        "groups): train without --shard-optimizer")
    if batch_norm == "deferred":
        raise GemsError("a plan with a spatial part computes BatchNorm statistics over each micro-batch's whole "
                        "images: use --batch-norm micro-batch or frozen, not deferred")


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


def member_actions(actions: list[ir.Action]) -> list[ir.Action]:
    """A member's actions: its leader's stage-0 compute and reduces, the sync and the step."""
    return [a for a in actions if a.op in (ir.SYNC, ir.STEP) or (a.stage == 0 and (a.op in ir.COMPUTE
                                                                                 or a.op == ir.REDUCE))]


def tiled_stage(module: nn.Sequential, plan, tiles: TileGroup, rows: int) -> nn.Sequential:
    """Stage 0 with units ``[0, plan.spatial_end)`` tiled (a member keeps only those)."""
    return tile_stage(module, 0, plan.spatial_end, plan.unit_names, tiles, torch.Size((rows, *plan.input_shape)))


def sync_parts(topology: Topology, rank: int, stages: dict[int, nn.Module], end: int) -> dict | None:
    """How a leader's stages sync when its tiled stage 0 has an untiled rest (``GradSync``'s
    ``parts``): the tiled units over every tile of stage 0, the rest over the leaders alone (the
    members hold no copy of it); None where the default (each stage over its holders) is right."""
    if topology.tiles == 1 or topology.place(rank)[2] or 0 not in stages or end == len(stages[0]):
        return None
    units = list(stages[0].children())
    parts = {s: [(m, topology.holders(s))] for s, m in stages.items()}
    parts[0] = [(nn.Sequential(*units[:end]), topology.holders(0)), (nn.Sequential(*units[end:]), topology.leaders(0))]
    return parts


def member_policy(policy: StagePolicy, end: int) -> StagePolicy:
    """Stage 0's policy on a member, which runs units ``[0, end)`` only."""
    return StagePolicy([list(seg) for seg in policy.recompute if seg[1] <= end], policy.offload)
