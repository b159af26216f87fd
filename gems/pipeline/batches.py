"""Which rows of a global batch each group, replica and micro-batch takes.

The global batch of B images is split D ways over groups, then, inside a group, into
``replicas x m`` micro-batches of ``B / (D x replicas x m)`` images (replica-major). How their
losses add up to the global batch's is ``gems.pipeline.loss``'s business.
"""
from __future__ import annotations

import torch

from gems.errors import GemsError


class MicroBatches:
    def __init__(self, batch_size: int, groups: int, group: int, replicas: int, m: int, rank: int) -> None:
        parts = groups * replicas * m
        if batch_size % parts:
            raise GemsError(f"a global batch of {batch_size} cannot be split into {groups} groups x "
                            f"{replicas} replicas x {m} micro-batches: use a multiple of {parts}")
        self.batch_size, self.groups, self.group, self.m, self.rank = batch_size, groups, group, m, rank
        self.rows_per_micro = batch_size // parts

    def shard(self, x: torch.Tensor | None, what: str, needed: bool) -> torch.Tensor | None:
        """This group's rows of ``x`` (the global batch or already this group's shard); None
        when this rank does not need ``what``. GemsError when ``x`` has the wrong rows, or is
        None where it is needed (checked on every rank, so all ranks reject the same bad call)."""
        B, D = self.batch_size, self.groups
        if not needed and x is None:
            return None
        if x is None or len(x) not in (B, B // D):
            got = "None" if x is None else f"{len(x)} rows"
            need = "needs" if needed else "was given"
            raise GemsError(f"rank {self.rank} {need} {what}: pass the global batch ({B} rows) "
                            f"or this group's shard ({B // D} rows), got {got}")
        if not needed:
            return None
        return x[self.group * (B // D):(self.group + 1) * (B // D)] if len(x) == B and D > 1 else x

    def rows(self, replica: int, micro: int) -> slice:
        """The rows of this group's shard that micro-batch ``micro`` of ``replica`` takes."""
        index = replica * self.m + micro
        return slice(index * self.rows_per_micro, (index + 1) * self.rows_per_micro)
