"""Run under mpiexec -n 2: rank 1 runs out of memory in its first step; the job must end on
every rank with one line from rank 1 naming the action, the plan's estimate and the fixes.

    mpiexec -n 2 python tests/distributed/oom_worker.py cpu    # a real allocator failure
    mpiexec -n 2 python tests/distributed/oom_worker.py cuda   # torch.OutOfMemoryError, injected

cpu:  the plan is made for a 1 GiB budget, which it fits; rank 1 then enforces a limit of 2 MiB
      (trainer.enforce_memory_budget, as --enforce-memory-budget does) and its first forward
      needs 4 MiB for one activation, so the CPU allocator fails for real.
cuda: rank 1's first backward raises the error CUDA raises (on any device: only the message is tested).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from gems import comm as comm_lib
from gems import partition
from gems.pipeline.engine import Engine
from gems.pipeline.executor import Executor
from gems.train.trainer import enforce_memory_budget

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "assets"))
from tiny_model import tiny  # noqa: E402

SIDE, BATCH = 64, 64  # the first activation of a replica's 32 images: 32 x 8 x 64 x 64 floats = 4 MiB


def main(mode: str) -> None:
    comm = comm_lib.create("mpi", timeout=60)
    with comm.guard():
        torch.manual_seed(0)
        model = tiny()
        plan = partition.plan(model, input_shape=(3, SIDE, SIDE), batch_size=BATCH, stages=2, schedule="mast",
                              memory_budget="1GiB")
        assert plan.fits
        if mode == "cuda" and comm.rank == 1:
            def fail(self, action):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                             "capacity of 79.10 GiB of which 1.06 GiB is free.")
            Executor._backward = fail
        engine = Engine(model, plan, lambda p: torch.optim.SGD(p, lr=0.01), nn.CrossEntropyLoss(), comm)
        images, labels = torch.randn(BATCH, 3, SIDE, SIDE), torch.randint(0, 10, (BATCH,))
        if mode == "cpu" and comm.rank == 1:
            enforce_memory_budget(engine, 2 << 20)
        engine.step(images, labels)
        print(f"rank {comm.rank}: finished although rank 1 should have run out of memory", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
