"""Run under mpiexec: a GroupNorm CNN trained on a tile grid of this launch's ranks equals one
process training the whole images, on CPU or on CUDA.

    mpiexec -n 2 python tests/distributed/spatial_worker.py --device cuda

K = 1, schedule mp, the 2-D grid ``--grid`` (default: world x 1), side 100 (not a power of two),
batch 2, three SGD steps with momentum. Halo exchanges, group sums and the gathered head run
through MPI between real processes. Real processes are what CUDA needs here: a tile's backward
exchanges halos from inside autograd, and the autograd engine runs every CUDA backward of one
process on that device's one worker thread, so two loopback ranks sharing a GPU would wait on
each other there forever. Convolutions run in float32 (TF32 off: it rounds tiles and whole images
differently). Rank 0 trains the reference in-process on a one-rank loopback world, compares
losses and every floating state entry (rtol 1e-5) and prints one "ok ..." line; a mismatch raises
and aborts the job.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: run as a script from the repo root

from gems import comm as comm_lib, partition  # noqa: E402
from gems.comm import loopback  # noqa: E402
from gems.graph import graph_units  # noqa: E402
from gems.pipeline.engine import Engine  # noqa: E402
from gems.spatial import flatten  # noqa: E402

from spatial_models import GroupNormNet  # noqa: E402

SIDE, CLASSES, BATCH, STEPS = 100, 5, 2, 3


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        out.append((torch.randn(BATCH, 3, SIDE, SIDE, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)))
    return out


def train(comm, model, plan, device: torch.device):
    engine = Engine(model, plan, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), nn.CrossEntropyLoss(),
                    comm=comm, device=device)
    losses = [engine.step(x, y) for x, y in batches()]
    return losses, {k: v.detach().cpu() for k, v in engine.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--grid", default=None, help="RxC tile grid (default: world x 1)")
    args = p.parse_args()
    comm = comm_lib.create("mpi", device=args.device, timeout=120, allow_shared_gpu=True)
    with comm.guard():
        device = comm.device
        torch.backends.cudnn.allow_tf32 = False
        grid = tuple(int(n) for n in args.grid.split("x")) if args.grid else (comm.size, 1)
        torch.manual_seed(0)
        model = GroupNormNet(CLASSES)
        whole = partition.plan(model, (3, SIDE, SIDE), batch_size=BATCH, stages=1, schedule="mp", device=args.device)
        tiled = partition.plan(model, (3, SIDE, SIDE), batch_size=BATCH, stages=1, schedule="mp", device=args.device,
                               spatial=grid)
        units = graph_units(copy.deepcopy(model), (3, SIDE, SIDE), BATCH)
        for unit in units:
            flatten(unit)
        losses, state = train(comm, units, tiled, device)
        if comm.rank == 0:
            ref_losses, ref_state = loopback.run(1, train, copy.deepcopy(model), whole, device, timeout=120)[0]
            for got, want in zip(losses, ref_losses):
                if abs(got - want) > 1e-5 * abs(want):
                    raise AssertionError(f"losses {losses} differ from one process's {ref_losses}")
            for key, want in ref_state.items():
                if want.is_floating_point():
                    torch.testing.assert_close(state[key], want, rtol=1e-5, atol=1e-6 * want.abs().max().item(),
                                               msg=lambda m, key=key: f"{key}: {m}")
            print(f"ok spatial {grid[0]}x{grid[1]} on {comm.size} ranks ({device}): losses {losses}", flush=True)
        comm.barrier()


if __name__ == "__main__":
    main()
