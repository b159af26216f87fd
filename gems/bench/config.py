"""gems-bench's options (``BenchConfig``: the flags, the counts derived from them for a world of
ranks, and their validation) and each schedule's micro-batch count.

Micro-batches: ``mp`` always runs one; by default the others use micro-batches of one image
per group and replica (batch 2 on 2 ranks: gpipe/1f1b m = 2, mast m = 1 per replica), so
every schedule except mp handles the same micro-batch size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gems import partition
from gems.errors import GemsError
from gems.partition.backward import split_mode
from gems.schedule import generators as sch
from gems.schedule.topology import ranks_per_group
from gems.plan import PLACEMENT_CHOICES
from gems.train.config import (MODEL_ARG_HELP, MODEL_HELP, PLACEMENT_HELP, SPATIAL_HELP, SPLIT_CHOICES, SPLIT_HELP,
                               Recipe, model_kwargs, opt, tile_count)


@dataclass
class BenchConfig(Recipe):
    model: str = opt("resnet18", MODEL_HELP)
    model_arg: tuple[str, ...] = opt((), MODEL_ARG_HELP, metavar="KEY=VALUE")
    image_size: int = opt(512, "side of the square synthetic images, in pixels")
    batch_size: int = opt(2, "global batch: images per optimizer step over all ranks")
    schedules: str = opt("mp,gpipe,1f1b,mast", "comma-separated schedules to run, in this order")
    steps: int = opt(10, "measured steps per schedule")
    warmup: int = opt(2, "steps run before measuring (allocator, caches, first messages)")
    micro_batches: int | None = opt(None, "micro-batches per replica for gpipe/1f1b/mast (mp always 1); "
                                          "default: micro-batches of one image")
    stages: int | None = opt(None, "K, stages per pipeline (default: all ranks, one group; with --spatial: 1)")
    spatial: str | None = opt(None, SPATIAL_HELP)
    split_backward: str = opt("off", SPLIT_HELP + "; auto chooses per schedule", choices=SPLIT_CHOICES, const="on",
                              negative="off")
    shard_optimizer: bool = opt(False, "share the optimizer step and state across each sync group")
    state_placement: str = opt("device", PLACEMENT_HELP, choices=PLACEMENT_CHOICES)
    balance_by: str = opt("time", "what the partitioner balances", choices=partition.BALANCE_BY)
    num_classes: int = opt(10, "classes the model outputs (per image, or per pixel for a segmentation model)")
    lr: float = opt(0.01, "SGD learning rate (momentum 0.9), the same for every run")
    seed: int = opt(0, "seed of the model and the synthetic batch")
    reference: bool = opt(True, "time the unpartitioned single-rank reference on rank 0")
    comm: str = opt("mpi", "communication backend", choices=("mpi", "torch"))
    allow_shared_gpu: bool = opt(False, "let several ranks of a node share a GPU (timings then measure the "
                                 "sharing); without it more ranks than visible GPUs stops the run")
    timeout: float = opt(600.0, "seconds a rank waits for a peer before aborting the job")
    json: str | None = opt(None, "write all results to this JSON file")
    trace_dir: str | None = opt(None, "write a Perfetto trace (SCHEDULE.json) and, with matplotlib, "
                                      "a picture of the last step (SCHEDULE.png) per schedule here")

    def schedule_list(self) -> list[str]:
        names = [s.strip() for s in self.schedules.split(",") if s.strip()]
        unknown = [s for s in names if s not in sch.SCHEDULES]
        if not names or unknown:
            raise GemsError(f"--schedules takes a comma-separated subset of {','.join(sch.SCHEDULES)}, "
                            f"got {self.schedules!r}")
        return names

    def tiles(self) -> int:
        """P, the ranks of a tile group (1 without --spatial); GemsError unless P or RxC."""
        return tile_count(self.spatial, "gems-bench")

    def stage_count(self, world: int) -> int:
        """K: --stages, else one group of all ranks (with --spatial: 1, every group one tile group)."""
        return self.stages or (1 if self.spatial else world)

    def group_count(self, world: int, name: str) -> int:
        """D of schedule ``name``: the world over its ranks per group (K, plus P-1 per tile group)."""
        return world // ranks_per_group(self.stage_count(world), name, self.tiles())

    def validate(self, world: int) -> None:
        self.schedule_list()
        split_mode(self.split_backward)
        P = self.tiles()
        model_kwargs(self.model_arg)
        for name in ("image_size", "batch_size", "steps", "num_classes"):
            if getattr(self, name) < 1:
                raise GemsError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise GemsError(f"--warmup cannot be negative, got {self.warmup}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise GemsError(f"--micro-batches must be at least 1, got {self.micro_batches}")
        K = self.stage_count(world)
        if K < 1 or (P == 1 and world % K):
            raise GemsError(f"--stages {K} does not divide the {world} ranks: use a divisor of {world}")
        sizes = {name: ranks_per_group(K, name, P) for name in self.schedule_list()}
        if any(world % size for size in sizes.values()):
            by_size = [f"{size} ranks ({', '.join(n for n in sizes if sizes[n] == size)})"
                       for size in sorted(set(sizes.values()))]
            raise GemsError(f"--spatial {self.spatial} at --stages {K} takes groups of {' and '.join(by_size)}, "
                            f"which {world} ranks cannot form: launch a multiple of {math.lcm(*sizes.values())} "
                            f"ranks" + (" or benchmark these schedules separately" if len(by_size) > 1 else ""))
        if self.lr <= 0 or self.timeout <= 0:
            raise GemsError("--lr and --timeout must be positive")
        for name in self.schedule_list():
            groups = self.group_count(world, name)
            m = micro_batches_for(self, name, groups)
            parts = groups * sch.replicas(name) * m
            if self.batch_size % parts:
                raise GemsError(f"--batch-size {self.batch_size} does not split into {groups} group(s) x "
                                f"{sch.replicas(name)} replica(s) x {m} micro-batch(es) for {name}: "
                                f"use a multiple of {parts}")


def micro_batches_for(cfg: BenchConfig, name: str, groups: int) -> int:
    """m for one schedule: 1 for mp; else --micro-batches, or as many as make one image each."""
    if name == "mp":
        return 1
    if cfg.micro_batches is not None:
        return cfg.micro_batches
    parts = groups * sch.replicas(name)
    if cfg.batch_size % parts:
        raise GemsError(f"--batch-size {cfg.batch_size} does not split into {groups} group(s) x "
                        f"{sch.replicas(name)} replica(s) for {name}: use a multiple of {parts}")
    return cfg.batch_size // parts
