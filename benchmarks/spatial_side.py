"""The largest image side that trains within a per-rank memory budget, with and without splitting
each image across a tile group (spatial parallelism), from measured peaks:

    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 1 .venv/bin/python benchmarks/spatial_side.py --budget 512MiB
    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/spatial_side.py --budget 512MiB --spatial 4

One launch searches one configuration: K = 1 (schedule mp) on one rank, or with ``--spatial P``
the planner's spatial part (its grid and end, ``partition.plan(..., spatial=P)``) on P ranks.
For a side S (a multiple of ``--granularity``), it builds the engine (SGD with momentum, as
gems-train and the planner's "sgd"), runs one step, then meters one more
(``gems.obs.memory.PeakMeter``: tensors held at the start + the CPU allocator's high-water mark,
every tensor PyTorch allocates) and takes the largest peak over the ranks. A
bisection finds the largest S whose peak is within ``--budget``; each probe prints the measured
peak beside the plan's estimate. The issue's figure: the largest side with P = 4 >= 1.8x the
largest without (2x is the ideal: memory grows as S^2). Correctness and memory only -- steps on
4 ranks of 2 cores are slow. Not part of the installed package.
"""
from __future__ import annotations

import argparse
import json

import torch
from torch import nn

import gems
from gems import comm as comm_lib
from gems import models, partition
from gems.obs import memory
from gems.units import parse_size

MIB = 2 ** 20


def peak(model_name: str, side: int, batch: int, spatial: str | None, comm) -> tuple[int, int, str]:
    """(largest measured peak over the ranks, the plan's largest estimate, the spatial part) of one
    metered step at ``side`` after one unmetered."""
    torch.manual_seed(0)
    model = models.build(model_name, num_classes=10)
    plan = partition.plan(model, (3, side, side), batch, stages=1, schedule="mp", device="cpu", spatial=spatial)
    engine = gems.Engine(model, plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                         loss_fn=nn.CrossEntropyLoss(), comm=comm)
    x, y = torch.randn(batch, 3, side, side), torch.randint(0, 10, (batch,))
    engine.step(x, y)
    meter = memory.PeakMeter("cpu")
    meter.start(memory.engine_tensors(engine))
    engine.step(x, y)
    peaks = torch.zeros(comm.size, dtype=torch.float64)
    peaks[comm.rank] = meter.stop()
    comm.allreduce(peaks, None, "every rank's peak")
    part = f"grid {plan.spatial_grid[0]}x{plan.spatial_grid[1]}, units [0, {plan.spatial_end})" \
        if plan.spatial_grid else "no spatial part"
    return int(peaks.max()), plan.peak_bytes, part


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--budget", default="512MiB", help="bytes per rank, e.g. 512MiB")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--spatial", default=None, help="tile count P or grid RxC (default: none, one rank)")
    p.add_argument("--granularity", type=int, default=32, help="sides tried are multiples of this")
    p.add_argument("--low", type=int, default=128, help="a side known to fit")
    p.add_argument("--high", type=int, default=4096, help="a side known not to fit")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args()
    comm = comm_lib.create("mpi")
    torch.set_num_threads(1)
    budget, g = parse_size(args.budget), args.granularity
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"{args.model}, batch {args.batch_size}, {comm.size} rank(s), "
        f"{'--spatial ' + args.spatial if args.spatial else 'no spatial part'}, budget {budget / MIB:.0f} MiB per rank")
    lo, hi = args.low // g, -(-args.high // g)
    probes = []
    while hi - lo > 1:
        mid = (lo + hi) // 2
        measured, estimated, part = peak(args.model, mid * g, args.batch_size, args.spatial, comm)
        fits = measured <= budget
        probes.append({"side": mid * g, "measured": measured, "estimated": estimated, "fits": fits})
        say(f"  side {mid * g:5d}: {measured / MIB:8.2f} MiB measured, {estimated / MIB:8.2f} MiB estimated "
            f"({memory.estimate_error(measured, estimated)}), {part}: {'fits' if fits else 'over'}")
        lo, hi = (mid, hi) if fits else (lo, mid)
    say(f"largest side within {budget / MIB:.0f} MiB per rank: {lo * g}")
    if args.json and comm.rank == 0:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "ranks": comm.size, "spatial": args.spatial, "budget": budget,
                       "largest_side": lo * g, "probes": probes}, f, indent=1)


if __name__ == "__main__":
    main()
