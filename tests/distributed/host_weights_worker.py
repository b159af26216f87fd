"""Run under mpiexec (tests/test_host_weights.py): the transparency model under mast, K = 2, AdamW with a
sharded optimizer, groups of one unit: --state-placement host equals device bit for bit on every rank
after three steps (the host copies summed by MPI). Prints one "ok" line on rank 0.

    mpiexec -n 2 python tests/distributed/host_weights_worker.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: run as a script from the repo root

from gems import comm as comm_lib  # noqa: E402

from equivalence import build, check_same_run, make_plan, train  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    comm = comm_lib.create("mpi", timeout=60)
    with comm.guard():
        K, D = 2, comm.size // 2
        device, host = [train(comm, build("transparency"),
                              make_plan("transparency", "mast", K, 1, D, shard=True, placement=placement,
                                        group_units=1 if placement == "host" else 0), 3, optim="adamw")
                        for placement in ("device", "host")]
        check_same_run(f"rank {comm.rank}, host against device", device, host)
        if comm.rank == 0:
            print(f"ok host weights mast K={K} D={D} adamw shard: host equals device bit for bit", flush=True)


if __name__ == "__main__":
    main()
