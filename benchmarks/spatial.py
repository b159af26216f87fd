"""Spatial parallelism's speed: one image split across 2 ranks against one rank and against plain
model parallelism (mp), the same model and image, in one launch.

    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/spatial.py --model resnet18 --image-size 512

Four runs of ``--steps`` training steps (after ``--warmup``), one image per step (``--batch-size``):
``one rank`` (plain PyTorch on rank 0 while rank 1 waits), ``spatial`` (K = 1, the conv trunk --
every unit before the global pooling -- on a 1x2 or 2x1 tile grid of both ranks, the head on the
leader) and ``mp`` (K = 2, the planner's cut); and the ceiling: each rank a half image, plain PyTorch,
both at once. Prints the median step of each and the ratios. The
issue's figures: spatial >= 1.7x one rank and >= 1.6x mp. Not part of the installed package.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import gems
from gems import comm as comm_lib
from gems import models, partition
from gems.train.optim import sgd

LR = 0.01   # every run's SGD (gems-bench's: momentum 0.9, fused where torch can)


def _steps(step, steps: int, warmup: int, comm) -> float:
    """Median seconds of ``steps`` calls of ``step`` after ``warmup``, every rank in step."""
    times = []
    for i in range(warmup + steps):
        comm.barrier()
        start = time.perf_counter()
        step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--grid", default="2x1", help="the tile grid of the two ranks: 2x1 (rows) or 1x2")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--spin", action="store_true", help="waits poll without sleeping (a core per rank)")
    p.add_argument("--shard-optimizer", action="store_true",
                   help="the spatial run's tiles share the optimizer step (reduce-scatter, half the update each)")
    args = p.parse_args()
    comm = comm_lib.create("mpi", backoff=comm_lib.Backoff(0, 0) if args.spin else comm_lib.Backoff())
    torch.set_num_threads(1)
    S, B = args.image_size, args.batch_size
    torch.manual_seed(0)
    model = models.build(args.model, num_classes=10)
    x, y = torch.randn(B, 3, S, S), torch.randint(0, 10, (B,))
    loss_fn = nn.CrossEntropyLoss()

    one = copy.deepcopy(model)
    opt = sgd(one.parameters(), LR)

    def single() -> None:
        if comm.rank == 0:
            opt.zero_grad()
            loss_fn(one(x), y).backward()
            opt.step()
    t_one = _steps(single, args.steps, args.warmup, comm)

    rows, cols = (int(v) for v in args.grid.split("x"))
    # the ceiling on these cores: each rank its own half of the image (no halo, no sums, no
    # gradient allreduce), both at once -- what two ranks can do at best, shared memory bandwidth included
    half = x[:, :, :S // 2] if rows == 2 else x[:, :, :, :S // 2]
    own = copy.deepcopy(model)
    own_opt = sgd(own.parameters(), LR)

    def halves() -> None:
        own_opt.zero_grad()
        loss_fn(own(half), y).backward()
        own_opt.step()
    t_half = _steps(halves, args.steps, args.warmup, comm)
    plan = partition.plan(copy.deepcopy(model), (3, S, S), B, stages=1, schedule="mp", device="cpu")
    plan.spatial_grid = [rows, cols]
    plan.spatial_end = next(i for i, n in enumerate(plan.unit_names) if "avgpool" in n or n == "head")
    plan.shard_optimizer = args.shard_optimizer
    plan.check()
    engine = gems.Engine(copy.deepcopy(model), plan, optimizer=lambda p: sgd(p, LR), loss_fn=loss_fn, comm=comm)
    t_spatial = _steps(lambda: engine.step(x, y), args.steps, args.warmup, comm)

    mp_plan = partition.plan(copy.deepcopy(model), (3, S, S), B, stages=2, schedule="mp", device="cpu")
    mp = gems.Engine(copy.deepcopy(model), mp_plan, optimizer=lambda p: sgd(p, LR), loss_fn=loss_fn, comm=comm)
    t_mp = _steps(lambda: mp.step(x, y), args.steps, args.warmup, comm)
    if comm.rank == 0:
        print(f"{args.model} {S}x{S}, batch {B}, median of {args.steps} steps (after {args.warmup}):")
        print(f"  one rank          {t_one * 1e3:9.1f} ms")
        sharded = ", sharded" if args.shard_optimizer else ""
        print(f"  spatial {rows}x{cols} (2 ranks{sharded}) {t_spatial * 1e3:9.1f} ms   "
              f"{t_one / t_spatial:5.2f}x one rank   {t_mp / t_spatial:5.2f}x mp")
        print(f"  mp K=2 (2 ranks)  {t_mp * 1e3:9.1f} ms   {t_one / t_mp:5.2f}x one rank")
        print(f"  ceiling: a half image on each rank at once, plain PyTorch {t_half * 1e3:9.1f} ms   "
              f"{t_one / t_half:5.2f}x one rank")


if __name__ == "__main__":
    main()
