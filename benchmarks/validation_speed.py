"""Validation throughput: gems' forward-only schedule on the launch's ranks vs one unpartitioned rank.

    OMP_NUM_THREADS=1 mpiexec -n 2 .venv/bin/python benchmarks/validation_speed.py \\
        --model unet --model-arg width=16 --model-arg depth=4 --image-size 512 --batch-size 4 --batches 6

In one launch, on the same synthetic batches and weights:

- one rank: rank 0 runs the whole model in eval mode under ``torch.no_grad`` on each global batch
  while the other ranks wait at a barrier (the unpartitioned baseline, the same threads per rank);
- gems: ``Engine.evaluate`` over the same batches, K = world / D stages under the chosen schedule
  (mast: both mirrored replicas run forwards, so every rank computes from the start).

Each is timed between two barriers after one warm-up batch; the script prints both images/s and
their ratio, and checks that the loss over the batches agrees. Not part of the installed package.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import gems
from gems import comm as comm_lib
from gems import models, partition
from gems.train.config import model_kwargs
from gems.train.losses import make_loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="unet")
    p.add_argument("--model-arg", action="append", default=[])
    p.add_argument("--num-classes", type=int, default=3)
    p.add_argument("--image-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--schedule", default="mast")
    args = p.parse_args()
    comm = comm_lib.create("mpi")
    comm_lib.configure_threads(comm)
    torch.manual_seed(0)
    model = models.build(args.model, num_classes=args.num_classes, **model_kwargs(args.model_arg))
    S, B = args.image_size, args.batch_size
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(B, 3, S, S, generator=g), torch.randint(0, args.num_classes, (B, S, S), generator=g))
               for _ in range(args.batches + 1)]
    loss = make_loss("segmentation", "cross-entropy", args.num_classes)
    ready = torch.zeros(1, dtype=torch.float64)

    # one unpartitioned rank
    single = None
    if comm.rank == 0:
        reference = copy.deepcopy(model).eval()
        with torch.no_grad():
            reference(batches[0][0])
            start = time.perf_counter()
            total = sum(float(loss(reference(x), y)) for x, y in batches[1:])
            single = time.perf_counter() - start
        count = sum(float(loss.normaliser(y).sum()) for _, y in batches[1:])
    comm.allreduce(ready, None, "the barrier after the single-rank run")

    plan = partition.plan(model, input_shape=(3, S, S), batch_size=B, stages=args.stages, schedule=args.schedule,
                          groups=comm.size // args.stages)
    engine = gems.Engine(model, plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0), loss_fn=loss, comm=comm)
    engine.evaluate(batches[:1])
    comm.allreduce(ready, None, "the barrier before the pipelined run")
    start = time.perf_counter()
    scores = engine.evaluate(batches[1:])
    comm.allreduce(ready, None, "the barrier after the pipelined run")
    pipelined = time.perf_counter() - start
    if comm.rank == 0:
        images = B * args.batches
        print(f"model {args.model} {' '.join(args.model_arg)}, {S}x{S}, batch {B}, {args.batches} batches, "
              f"{comm.size} ranks, K={args.stages} {args.schedule}")
        print(f"one unpartitioned rank : {images / single:8.3f} images/s  ({single:.2f} s)")
        print(f"gems evaluate          : {images / pipelined:8.3f} images/s  ({pipelined:.2f} s)")
        print(f"ratio                  : {single / pipelined:8.2f}x")
        print(f"loss: one rank {total / count:.6f}, gems {scores['loss']:.6f}")


if __name__ == "__main__":
    main()
