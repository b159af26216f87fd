"""Where every rank sits: rank -> (group d, position r, tile), and who syncs with whom.

Ranks of one group are consecutive, so a pipeline stays on one node when nodes hold a multiple
of a group's ranks and its point-to-point traffic never crosses the network; only the gradient
allreduce does. Without a spatial part a group is K ranks (rank = d * K + r). With one
(``tiles`` = P > 1), every position holding stage 0 -- position 0, and under ``mast`` also
position K-1 -- is a tile group of P consecutive ranks, the first of them its *leader* (the
rank that exchanges the pipeline's messages and runs the position's other stages); the others
(*members*) hold stage 0 only and run its tiled units. With a spatial suffix (``suffix``: the
last stage's last units tiled too) every position holding the last stage is a tile group as
well, whose members also hold the last stage. A group is then K + (P-1) x (tile groups) ranks.
Tiles exchange halos at every layer: keep a group on one node.

Sync groups (the ranks whose gradients of a stage are summed each step): every rank holding the
stage, in every group (``holders``). Without tiles that is, for one-replica schedules, position
s of every group; for ``mast`` the mirror group ``{(d, r), (d, K-1-r) for all d}`` -- both
stages of a rank share it, so one allreduce of its bucket syncs both copies. For odd K the
middle position holds one shared copy. Pure and validated: no I/O, testable without a process group.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from gems.errors import GemsError
from gems.schedule import generators as sch


def tiled_positions(stages: int, schedule: str, tiles: int, suffix: bool = False) -> list[int]:
    """Positions that are tile groups: those holding stage 0, and with a spatial ``suffix`` those
    holding the last stage (none without tiles)."""
    tiled = {0, stages - 1} if suffix else {0}
    return [p for p in range(stages) if tiles > 1 and tiled & set(sch.holds(schedule, stages, p))]


def ranks_per_group(stages: int, schedule: str, tiles: int = 1, suffix: bool = False) -> int:
    """Ranks of one group: K, plus P - 1 for each position that is a tile group."""
    return stages + (tiles - 1) * len(tiled_positions(stages, schedule, tiles, suffix))


@dataclass(frozen=True)
class Topology:
    world: int
    stages: int
    schedule: str = "mast"
    tiles: int = 1
    suffix: bool = False   # the last stage's last units are tiled too (Plan.spatial_start)

    def __post_init__(self) -> None:
        K, W = self.stages, self.world
        if not isinstance(K, int) or K < 1:
            raise GemsError(f"the number of stages must be a positive integer, got {K!r}")
        if self.schedule not in sch.SCHEDULES:
            raise GemsError(f"unknown schedule {self.schedule!r}: choose one of "
                            f"{', '.join(sch.SCHEDULES)}")
        if W % self.size:
            if self.tiles > 1:
                raise GemsError(f"{W} ranks cannot form groups of {self.size} ranks ({K} positions, "
                                f"{len(self.tiled)} of them tile groups of {self.tiles}): launch a multiple of "
                                f"{self.size} ranks")
            raise GemsError(f"{W} ranks cannot form pipelines of {K} stages: launch a multiple of "
                            f"{K} ranks (world = stages x groups) or choose --stages dividing {W}")

    @classmethod
    def of(cls, plan, world: int) -> Topology:
        """The layout ``world`` ranks take to run ``plan`` (a ``gems.plan.Plan``): its stages,
        schedule, tile groups and whether a suffix is tiled."""
        return cls(world, plan.stages, plan.schedule, plan.tiles, bool(plan.spatial_start))

    @property
    def tiled(self) -> list[int]:
        """Positions that are tile groups (``tiled_positions``)."""
        return tiled_positions(self.stages, self.schedule, self.tiles, self.suffix)

    @property
    def tiled_stages(self) -> set[int]:
        """Stages a tile group's members hold (their tiled units): 0, and the last with a suffix."""
        return ({0, self.stages - 1} if self.suffix else {0}) if self.tiles > 1 else set()

    def width(self, position: int) -> int:
        """Ranks at ``position``: P for a tile group, else 1."""
        return self.tiles if position in self.tiled else 1

    @property
    def size(self) -> int:
        """Ranks per group."""
        return ranks_per_group(self.stages, self.schedule, self.tiles, self.suffix)

    @property
    def groups(self) -> int:
        """D: pipelines doing data parallelism."""
        return self.world // self.size

    def place(self, rank: int) -> tuple[int, int, int]:
        """(group d, position r, tile index) of a rank; tile 0 is the position's leader."""
        d, at = divmod(rank, self.size)
        for r in range(self.stages):
            if at < self.width(r):
                return d, r, at
            at -= self.width(r)
        raise AssertionError(rank)

    def coords(self, rank: int) -> tuple[int, int]:
        """(group d, position r) of a rank."""
        return self.place(rank)[:2]

    def rank(self, group: int, position: int, tile: int = 0) -> int:
        """The world rank of a tile of a position (tile 0: the leader)."""
        return group * self.size + sum(self.width(r) for r in range(position)) + tile

    def tile_ranks(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s tile group (just the rank where its position is not one)."""
        d, r, _ = self.place(rank)
        return [self.rank(d, r, t) for t in range(self.width(r))]

    def holds(self, position: int) -> list[int]:
        """Stages whose parameters a position's leader holds."""
        return sch.holds(self.schedule, self.stages, position)

    def stages_of(self, rank: int) -> list[int]:
        """Stages whose parameters ``rank`` holds: its position's, or for a member those of them with
        tiled units."""
        _, r, t = self.place(rank)
        return [s for s in self.holds(r) if s in self.tiled_stages] if t else self.holds(r)

    def peer(self, rank: int, position: int) -> int:
        """The leader of ``position`` in the same group as ``rank``."""
        return self.rank(self.coords(rank)[0], position)

    def holders(self, stage: int) -> list[int]:
        """Every rank holding ``stage``, in every group, ascending: the stage's sync group."""
        return list(_holders(self, stage))

    def leaders(self, stage: int) -> list[int]:
        """The ranks holding ``stage`` that lead their tile group (all its holders without tiles): the
        sync group of what a tiled stage 0 runs untiled on its leaders."""
        return [rank for rank in self.holders(stage) if self.place(rank)[2] == 0]

    def sync_group(self, rank: int) -> list[int]:
        """Ranks whose gradients (and BatchNorm statistics) are averaged with ``rank``'s, for a rank
        whose stages all sync with the same ranks (always so without tiles)."""
        groups = {tuple(self.holders(s)) for s in self.stages_of(rank)}
        if len(groups) > 1:
            raise GemsError("this rank's stages sync with different ranks (a tile group's leader): "
                            "use the per-stage sync groups (Topology.holders)")
        return list(groups.pop())

    def sync_groups(self) -> list[list[int]]:
        """Every distinct sync group (each stage's holders; with tiles also stage 0's leaders), in the
        same order on every rank (for collective creation)."""
        seen: list[list[int]] = []
        for g in [self.holders(s) for s in range(self.stages)] + [self.leaders(s) for s in sorted(self.tiled_stages)]:
            if g not in seen:
                seen.append(g)
        return seen


@lru_cache(maxsize=1024)
def _holders(topology: Topology, stage: int) -> tuple[int, ...]:
    """``Topology.holders``, once per (layout, stage): a scan of the whole world that the simulator
    and the planner ask for again and again."""
    return tuple(rank for rank in range(topology.world) if stage in topology.stages_of(rank))
