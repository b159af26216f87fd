"""gems against torch.distributed.pipelining on the same model, cut points, data and ranks.

    OMP_NUM_THREADS=1 mpiexec -n 2 .venv/bin/python benchmarks/peer_pipelining.py \\
        --model resnet18 --image-size 512 --batches 2,8 --steps 10 --warmup 2

For every global batch B, in one launch:

- torch: ``PipelineStage`` + ``ScheduleGPipe`` and ``Schedule1F1B`` (gloo, process group set
  up by ``gems.comm.create("torch")`` from the MPI ranks), K = world stages cut where
  ``gems.partition.plan`` cuts the model for 1f1b with one-image micro-batches, mean
  cross-entropy, SGD; every micro-batch count m from K to B that divides B is run and the
  best kept;
- gems: the Engine (MPI backend) with each of ``--gems-schedules`` (each with its own plan,
  micro-batches of one image except mp), and the best of them.

Both run the same initial weights on the same synthetic batch, with the same threads per rank.
Throughput = B x measured steps / the time between two barriers around the measured steps
(the same clock for both). Not part of the installed package; needs the repository's venv.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import gems
from gems import comm as comm_lib
from gems import models, partition
from gems.bench import BenchConfig, micro_batches_for

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def timed(comm, step, steps: int, warmup: int) -> float:
    """Seconds per step: ``warmup`` untimed steps, then ``steps`` between two barriers."""
    for _ in range(warmup):
        step()
    comm.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    comm.barrier()
    return (time.perf_counter() - start) / steps


def run_torch(name: str, model: nn.Sequential, cuts: list[int], images, labels, n: int, args, comm) -> float:
    """One torch.distributed.pipelining schedule with ``n`` micro-batches on stage ``rank`` of ``world``."""
    K, r = comm.size, comm.rank
    stage_module = copy.deepcopy(model)[cuts[r]:cuts[r + 1]]
    stage = PipelineStage(stage_module, r, K, torch.device("cpu"))
    schedule = TORCH_SCHEDULES[name](stage, n_microbatches=n, loss_fn=nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=args.lr, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad()
        if r == 0:
            schedule.step(images)
        elif r == K - 1:
            schedule.step(target=labels, return_outputs=False)
        else:
            schedule.step()
        optimizer.step()

    return timed(comm, step, args.steps, args.warmup)


def run_gems(name: str, model: nn.Sequential, images, labels, args, comm) -> tuple[float, int, list[int]]:
    """One gems schedule with its own plan; returns (seconds per step, m, cuts)."""
    B, K = len(images), comm.size
    m = micro_batches_for(BenchConfig(batch_size=B), name, 1)
    plan = partition.plan(model, (3, args.image_size, args.image_size), B, K, name, m, balance_by="time",
                          model_name=args.model)
    engine = gems.Engine(copy.deepcopy(model), plan, optimizer=lambda p: torch.optim.SGD(p, lr=args.lr, momentum=0.9),
                         loss_fn=nn.CrossEntropyLoss(), comm=comm)
    return timed(comm, lambda: engine.step(images, labels), args.steps, args.warmup), m, plan.cuts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=512)
    p.add_argument("--batches", default="2,8", help="global batch sizes to compare")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gems-schedules", default="mp,gpipe,1f1b,mast")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()

    comm = comm_lib.create("mpi", timeout=900)
    threads = comm_lib.configure_threads(comm)
    comm_lib.create("torch", timeout=900)   # the default process group torch's pipelining uses
    results = []
    with comm.guard():
        for B in map(int, args.batches.split(",")):
            torch.manual_seed(0)
            model = models.build(args.model, num_classes=10)
            g = torch.Generator().manual_seed(1)
            images = torch.randn(B, 3, args.image_size, args.image_size, generator=g)
            labels = torch.randint(0, 10, (B,), generator=g)
            cuts = partition.plan(model, (3, args.image_size, args.image_size), B, comm.size, "1f1b", B,
                                  balance_by="time", model_name=args.model).cuts
            row = {"batch": B, "cuts": cuts, "torch": {}, "gems": {}}
            # torch's pipelining gets every micro-batch count from K to B, and its best is kept
            for name in TORCH_SCHEDULES:
                for n in [n for n in range(comm.size, B + 1) if B % n == 0]:
                    row["torch"][f"{name} m={n}"] = B / run_torch(name, model, cuts, images, labels, n, args, comm)
            for name in args.gems_schedules.split(","):
                seconds, m, gems_cuts = run_gems(name, model, images, labels, args, comm)
                row["gems"][name] = B / seconds
                row.setdefault("gems_setup", {})[name] = {"micro_batches": m, "cuts": gems_cuts}
            results.append(row)
            if comm.rank == 0:
                print(f"batch {B}: torch cuts {cuts}; images/s " +
                      ", ".join(f"torch {k} {v:.3f}" for k, v in row["torch"].items()) + "; " +
                      ", ".join(f"gems {k} {v:.3f}" for k, v in row["gems"].items()), flush=True)
    if comm.rank != 0:
        return
    print(f"\n{args.model} {args.image_size}x{args.image_size}, {comm.size} ranks x {threads} thread(s), "
          f"{args.steps} steps after {args.warmup} warm-up; gems: micro-batches of 1 image (mp: the whole batch)")
    print(f"{'batch':>5}  {'torch best (images/s)':>26}  {'gems best (images/s)':>21}  {'gems/torch':>10}")
    for row in results:
        torch_name, best_torch = max(row["torch"].items(), key=lambda kv: kv[1])
        gems_name, best_gems = max(row["gems"].items(), key=lambda kv: kv[1])
        row["ratio"] = best_gems / best_torch
        print(f"{row['batch']:>5}  {best_torch:>9.3f} ({torch_name:>14})  {best_gems:>9.3f} ({gems_name:>8})  "
              f"{row['ratio']:>9.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": threads, "results": results}, indent=2))


if __name__ == "__main__":
    main()
