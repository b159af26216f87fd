"""Run under mpiexec: trains tiny models with every schedule on this launch's ranks and
checks the result against one process training on the same global batch.

    mpiexec -n 2 python tests/distributed/engine_worker.py transparency --schedules mast,1f1b

The models, data, reference and comparisons are tests/equivalence.py's, shared with the
in-process matrix (tests/test_equivalence.py, one thread per rank); this worker runs the few
launches that need real processes (tests/test_engine.py).

Modes:
  transparency  BatchNorm-free model: state dict and losses after 3 SGD steps equal the
                single-process reference within --rtol, for every schedule and m in {1, 2}.
  batchnorm     model with BatchNorm: every copy of every stage identical after the steps.
  tuples        AmoebaNet-D (tuple boundaries), eval-mode BatchNorm, against the reference.
  --policy P    with these modes: every stage gets memory policy P (recompute: one segment
                per unit; segment: one segment per stage; offload; recompute+offload), and
                each rank checks that its units ran exactly as often as the recompute rule
                of gems.pipeline.stage says.
  raise / kill  the last rank raises in (or is SIGKILLed during) its second forward: the
                job must end, non-zero, on every rank.
  --placements  after the mode's runs, the transparency model under mast (K = 2, D = ranks / 2), SGD
                with momentum and AdamW, sharded or not: --state-placement host-optimizer equals
                device bit for bit on every rank after the steps (one launch pays the start-up).
Prints one "ok ..." line per configuration on rank 0; any mismatch raises (and aborts).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: run as a script from the repo root

import gems  # noqa: E402
from gems import comm as comm_lib  # noqa: E402
from gems.schedule.generators import SCHEDULES  # noqa: E402

from equivalence import (OPTIMIZERS, POLICIES, SIDE, build, check_same_run, data, make_plan,  # noqa: E402
                         optimizer, run, train)


def fail(comm, how: str) -> None:
    """Train mast on K = world; the last rank fails inside its second forward."""
    plan = make_plan("transparency", "mast", comm.size, 1, 1, batch=2)
    engine = gems.Engine(build("transparency"), plan, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss(), comm=comm)
    calls = 0

    def forward_hook(module, inputs):
        nonlocal calls
        calls += 1
        if comm.rank == comm.size - 1 and calls == 2:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure in forward")

    for stage in engine.stages.values():
        stage.register_forward_pre_hook(forward_hook)
    for step in range(3):
        engine.step(*data(2, step))
    print(f"rank {comm.rank} finished although a rank failed", flush=True)


def placements(comm, steps: int, K: int = 2) -> None:
    """``--placements`` (module docstring): one "ok" line per configuration on rank 0."""
    D = comm.size // K
    for optim in OPTIMIZERS:
        for shard in (False, True):
            device, host = [train(comm, build("transparency"), make_plan("transparency", "mast", K, 1, D, shard=shard,
                                                                         placement=placement), steps, optim=optim)
                            for placement in ("device", "host-optimizer")]
            check_same_run(f"rank {comm.rank}, host-optimizer against device under mast {optim} shard={shard}",
                           device, host)
            if comm.rank == 0:
                print(f"ok placements mast K={K} D={D} {optim} shard={shard}: host-optimizer equals device bit for bit",
                      flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["transparency", "batchnorm", "tuples", "raise", "kill"])
    p.add_argument("--placements", action="store_true", help="then host-optimizer against device, bit for bit")
    p.add_argument("--stages", default="2")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--micro-batches", default="1,2")
    p.add_argument("--backend", default="mpi")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--clip", type=float, default=None, help="clip the global gradient norm to this")
    p.add_argument("--side", type=int, default=SIDE, help="image height and width")
    p.add_argument("--policy", choices=POLICIES, default="none", help="memory policy of every stage")
    p.add_argument("--memory-formats", default="contiguous", help="comma-separated plan memory formats to run")
    args = p.parse_args()
    torch.set_num_threads(1)
    comm = comm_lib.create(args.backend, timeout=60)
    with comm.guard():
        if args.mode in ("raise", "kill"):
            return fail(comm, args.mode)
        for K in map(int, args.stages.split(",")):
            for schedule in args.schedules.split(","):
                for m in map(int, args.micro_batches.split(",")):
                    if schedule == "mp" and m > 1:
                        continue
                    for memory_format in args.memory_formats.split(","):
                        line = run(comm, args.mode, schedule, K, m, args.steps, args.rtol, args.clip,
                                   args.side, args.policy, memory_format)
                        if comm.rank == 0:
                            print(line, flush=True)
        if args.placements:
            placements(comm, args.steps)


if __name__ == "__main__":
    main()
