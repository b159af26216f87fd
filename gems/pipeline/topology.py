"""Where every rank sits: world = K x D, rank -> (group d, position r), and who syncs with whom.

Ranks of one group are consecutive (rank = d * K + r), so a pipeline stays on one node
when nodes hold a multiple of K ranks and its point-to-point traffic never crosses the
network; only the gradient allreduce does.

Sync groups (the ranks whose gradients are summed each step):
- one-replica schedules: position r of every group, ``{(d, r) for all d}``;
- ``mast``: the mirror group ``{(d, r), (d, K-1-r) for all d}`` -- all of them hold the same
  stages {r, K-1-r}, so one allreduce of a rank's whole gradient bucket syncs both copies.
  For odd K the middle position holds one shared copy and its group is ``{(d, mid)}``.
Pure and validated: no I/O, testable without a process group.
"""
from __future__ import annotations

from dataclasses import dataclass

from gems.pipeline import schedule as sch
from gems.errors import GemsError


@dataclass(frozen=True)
class Topology:
    world: int
    stages: int
    schedule: str = "mast"

    def __post_init__(self) -> None:
        K, W = self.stages, self.world
        if not isinstance(K, int) or K < 1:
            raise GemsError(f"the number of stages must be a positive integer, got {K!r}")
        if W % K:
            raise GemsError(f"{W} ranks cannot form pipelines of {K} stages: launch a multiple of "
                            f"{K} ranks (world = stages x groups) or choose --stages dividing {W}")
        if self.schedule not in sch.SCHEDULES:
            raise GemsError(f"unknown schedule {self.schedule!r}: choose one of "
                            f"{', '.join(sch.SCHEDULES)}")

    @property
    def groups(self) -> int:
        """D: pipelines doing data parallelism."""
        return self.world // self.stages

    def coords(self, rank: int) -> tuple[int, int]:
        """(group d, position r) of a rank."""
        return divmod(rank, self.stages)

    def rank(self, group: int, position: int) -> int:
        return group * self.stages + position

    def holds(self, position: int) -> list[int]:
        """Stages whose parameters a position holds."""
        return sch.holds(self.schedule, self.stages, position)

    def peer(self, rank: int, position: int) -> int:
        """The rank at ``position`` in the same group as ``rank``."""
        return self.rank(self.coords(rank)[0], position)

    def sync_group(self, rank: int) -> list[int]:
        """Ranks whose gradients (and BatchNorm statistics) are averaged with ``rank``'s."""
        r = self.coords(rank)[1]
        positions = {r, self.stages - 1 - r} if sch.replicas(self.schedule) == 2 else {r}
        return sorted(self.rank(d, p) for d in range(self.groups) for p in positions)

    def sync_groups(self) -> list[list[int]]:
        """Every distinct sync group, in the same order on every rank (for collective creation)."""
        seen: list[list[int]] = []
        for rank in range(self.world):
            g = self.sync_group(rank)
            if g not in seen:
                seen.append(g)
        return seen
