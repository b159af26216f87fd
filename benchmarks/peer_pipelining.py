"""gems against torch.distributed.pipelining on the same model, cut points, data and ranks.

    OMP_NUM_THREADS=1 mpiexec -n 2 .venv/bin/python benchmarks/peer_pipelining.py \\
        --model resnet18 --image-size 512 --batches 2,8 --steps 10 --warmup 2

For every global batch B, in one launch:

- torch: ``PipelineStage`` + ``ScheduleGPipe``, ``Schedule1F1B`` (K = world stages) and
  ``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV`` (2K stages, two
  per rank: looped, or in a V) (gloo, process group set up by ``gems.comm.create("torch")`` from
  the MPI ranks), cut where ``gems.partition.plan`` cuts the model into K or 2K stages for 1f1b
  with one-image micro-batches, balanced by time, mean cross-entropy, SGD; every micro-batch
  count m from K to B that divides B and the schedule accepts is run and the best kept;
- gems: the Engine (MPI backend) with each of ``--gems-schedules`` (each with its own plan,
  micro-batches of one image except mp; ``mast-split``: mast with the backward split), and the
  best of them.

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
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)

import gems
from gems import comm as comm_lib
from gems import models, partition
from gems.bench import BenchConfig, micro_batches_for
from gems.train.optim import sgd

# name -> (class, stages per rank, placement of a rank's stages)
TORCH_SCHEDULES = {"gpipe": (ScheduleGPipe, 1, "loop"), "1f1b": (Schedule1F1B, 1, "loop"),
                   "interleaved1f1b": (ScheduleInterleaved1F1B, 2, "loop"),
                   "zbv": (ScheduleZBVZeroBubble, 2, "v"), "dualpipev": (ScheduleDualPipeV, 2, "v")}


def held(K: int, r: int, per_rank: int, style: str) -> list[int]:
    """The stages rank r of K runs: r (+ K) looped, or r and 2K-1-r in a V."""
    if per_rank == 1:
        return [r]
    return [r, r + K] if style == "loop" else [r, 2 * K - 1 - r]


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


def run_torch(name: str, model: nn.Sequential, cuts: list[int], images, labels, n: int, args, comm) -> float | None:
    """One torch.distributed.pipelining schedule with ``n`` micro-batches; None if it refuses ``n``."""
    K, r = comm.size, comm.rank
    cls, per_rank, style = TORCH_SCHEDULES[name]
    mine = held(K, r, per_rank, style)
    copied = copy.deepcopy(model)
    modules = [copied[cuts[s]:cuts[s + 1]] for s in mine]
    stages = [PipelineStage(m, s, K * per_rank, torch.device("cpu")) for m, s in zip(modules, mine)]
    try:
        schedule = cls(stages[0] if per_rank == 1 else stages, n_microbatches=n, loss_fn=nn.CrossEntropyLoss())
    except ValueError:   # e.g. DualPipeV wants at least 2K micro-batches
        return None
    optimizer = sgd([q for m in modules for q in m.parameters()], args.lr)
    first, last = 0 in mine, K * per_rank - 1 in mine

    def step() -> None:
        optimizer.zero_grad()
        kwargs = {"target": labels, "return_outputs": False} if last else {}
        schedule.step(*([images] if first else []), **kwargs)
        optimizer.step()

    return timed(comm, step, args.steps, args.warmup)


def run_gems(name: str, model: nn.Sequential, images, labels, args, comm) -> tuple[float, int, list[int]]:
    """One gems schedule with its own plan; returns (seconds per step, m, cuts)."""
    B, K = len(images), comm.size
    schedule, split = name.removesuffix("-split"), name.endswith("-split")
    m = micro_batches_for(BenchConfig(batch_size=B), schedule, 1)
    plan = partition.plan(model, (3, args.image_size, args.image_size), B, K, schedule, m, balance_by="time",
                          model_name=args.model, split_backward=split)
    engine = gems.Engine(copy.deepcopy(model), plan, optimizer=lambda p: sgd(p, args.lr),
                         loss_fn=nn.CrossEntropyLoss(), comm=comm)
    return timed(comm, lambda: engine.step(images, labels), args.steps, args.warmup), m, plan.cuts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=512)
    p.add_argument("--batches", default="2,8", help="global batch sizes to compare")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gems-schedules", default="mp,gpipe,1f1b,mast,mast-split")
    p.add_argument("--torch-schedules", default=",".join(TORCH_SCHEDULES))
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
            cuts = {k: partition.plan(model, (3, args.image_size, args.image_size), B, k, "1f1b", B,
                                      balance_by="time", model_name=args.model).cuts
                    for k in (comm.size, 2 * comm.size)}
            row = {"batch": B, "cuts": cuts[comm.size], "torch": {}, "gems": {}}
            # torch's pipelining gets every micro-batch count from K to B, and its best is kept
            for name in args.torch_schedules.split(","):
                per_rank = TORCH_SCHEDULES[name][1]
                for n in [n for n in range(comm.size, B + 1) if B % n == 0]:
                    seconds = run_torch(name, model, cuts[per_rank * comm.size], images, labels, n, args, comm)
                    if seconds is not None:
                        row["torch"][f"{name} m={n}"] = B / seconds
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
