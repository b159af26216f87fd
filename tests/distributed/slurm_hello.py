"""Checks the launch plumbing under Slurm without gems: every rank reports itself, rank 0
prints one line per rank and then "slurm_hello: done".

    srun --mpi=pmi2 -n 2 .venv/bin/python tests/distributed/slurm_hello.py

What it proves: srun's PMI server and the MPI library mpi4py was built against found each
other (the world size is the task count, not 1 per process) and collectives work. A size-1
world under ``srun -n 2`` means the PMI flavours do not match.

Given gems-train's flags (``--steps N --checkpoint-dir DIR [--resume] [--metrics F]``; the
others are ignored) it also stands in for gems-train in the job scripts, so that
tests/test_slurm.py can check them -- the requeue path included -- before gems-train is
installed: it "trains" N steps of 0.3 s, appends one JSON line per step to the metrics
file, and on SIGUSR1 or SIGTERM saves the step reached and exits 3, the code gems-train
uses for "preempted, checkpoint saved, requeue me"; with --resume it continues from there.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import time
from pathlib import Path

from mpi4py import MPI

PREEMPTED = 3  # gems-train's exit code after saving a checkpoint on SIGTERM / SIGUSR1


def hello(comm: MPI.Comm) -> None:
    me = {
        "rank": comm.Get_rank(),
        "size": comm.Get_size(),
        "host": socket.gethostname(),
        "local": os.environ.get("SLURM_LOCALID", "?"),
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
    }
    for r in comm.allgather(me):
        if me["rank"] == 0:
            print(f"slurm_hello: rank {r['rank']}/{r['size']} on {r['host']} "
                  f"(local id {r['local']}), {r['mpi']}", flush=True)


def train(comm: MPI.Comm, args: argparse.Namespace) -> int:
    """Steps of sleep that stop together, at a step boundary, once any rank was signalled."""
    signalled = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda num, _frame: signalled.append(num))
    saved = Path(args.checkpoint_dir or ".") / "slurm_hello-step.txt"
    first = int(saved.read_text()) if args.resume and saved.exists() else 0
    rank0 = comm.Get_rank() == 0
    if rank0 and args.steps:
        print(f"slurm_hello: steps {first}..{args.steps}" + (" (resumed)" if first else ""), flush=True)
    for step in range(first, args.steps):
        if comm.allreduce(len(signalled), op=MPI.SUM):
            if rank0:
                saved.parent.mkdir(parents=True, exist_ok=True)
                saved.write_text(str(step))
                print(f"slurm_hello: preempted at step {step}, checkpoint saved", flush=True)
            return PREEMPTED
        time.sleep(0.3)
        if rank0 and args.metrics:
            with open(args.metrics, "a") as f:
                f.write(json.dumps({"step": step + 1}) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--metrics")
    parser.add_argument("--resume", action="store_true")
    args, _ = parser.parse_known_args()
    comm = MPI.COMM_WORLD
    hello(comm)
    code = train(comm, args)
    if code == 0 and comm.Get_rank() == 0:
        print("slurm_hello: done", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
