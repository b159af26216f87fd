"""The MPI backend's ring allreduce and allgather (gems.comm.ring) in one launch of three ranks
(tests/test_ring.py), with the ring threshold lowered so small tensors take it:

    mpiexec -n 3 python tests/distributed/ring_worker.py

Over three groups (all ranks, all reversed, a pair without rank 1): sums of float32, float64 and
bfloat16 tensors of uneven sizes (one chunk empty, a non-contiguous one), equal to the sum each
rank computes from every rank's seeded values and bit-identical on every member; two rings in
flight on one group, waited in reverse order; allgathers and reduce-scatters of uneven runs, empty
ones included.
Prints "rank R: ok, N rings".
"""
from __future__ import annotations

import hashlib

import torch

import gems.comm
import gems.comm.mpi_backend as mpi_backend
from gems.comm.ring import Ring

mpi_backend.RING_BYTES = 8
rings = 0


class Counted(Ring):
    def __init__(self, *args, **kwargs) -> None:
        global rings
        rings += 1
        super().__init__(*args, **kwargs)


mpi_backend.Ring = Counted


def values(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * seed + rank), dtype=torch.float64).to(dtype)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> None:
    comm = gems.comm.create("mpi", timeout=60)
    groups = [comm.group([0, 1, 2]), comm.group([2, 1, 0]), comm.group([0, 2])]
    seed = 0
    for group in [g for g in groups if g is not None]:
        for numel, dtype in [(2, torch.float32), (3, torch.float32), (1001, torch.float32), (7, torch.float64),
                             (64, torch.bfloat16)]:
            seed += 1
            t = values(comm.rank, numel, dtype, seed)
            comm.allreduce(t, group, "a ring allreduce")
            want = sum(values(r, numel, torch.float64, seed).to(dtype).double() for r in group.ranks)
            tol = 5e-2 if dtype == torch.bfloat16 else 1e-6
            assert torch.allclose(t.double(), want, rtol=tol, atol=tol), (numel, dtype, group.ranks)
            assert len(set(comm.allgather_object(digest(t), group))) == 1, (numel, dtype, "members differ")
        base = torch.arange(60.0).reshape(6, 10) * (comm.rank + 1)
        t = base.t()   # non-contiguous
        comm.allreduce(t, group, "a non-contiguous ring allreduce")
        factor = sum(r + 1 for r in group.ranks)
        assert torch.equal(t, torch.arange(60.0).reshape(6, 10).t() * factor)
        a, b = torch.full((100,), float(comm.rank)), torch.full((50,), 2.0 * comm.rank)
        first, second = comm.iallreduce(a, group), comm.iallreduce(b, group)
        comm.wait(second, "the second ring")
        comm.wait(first, "the first ring")
        total = sum(group.ranks)
        assert torch.equal(a, torch.full((100,), float(total))) and torch.equal(b, torch.full((50,), 2.0 * total))
        n = group.size
        for bounds in ([0, 40, 41, 100][:n] + [100], [0, 0, 30, 100][:n] + [100], [0, 100, 100, 100][:n] + [100]):
            flat = torch.full((100,), -1.0)
            lo, hi = bounds[group.rank], bounds[group.rank + 1]
            flat[lo:hi] = torch.arange(lo, hi, dtype=torch.float32)
            comm.wait(comm.iallgather_runs(flat, bounds, group), "a ring allgather")
            assert torch.equal(flat, torch.arange(100.0)), (bounds, flat)
            grads = torch.arange(100.0) * (comm.rank + 1)
            comm.wait(comm.ireduce_scatter_runs(grads, bounds, group), "a ring reduce-scatter")
            assert torch.equal(grads[lo:hi], torch.arange(lo, hi, dtype=torch.float32) * factor), (bounds, grads)
    comm.barrier()
    print(f"rank {comm.rank}: ok, {rings} rings", flush=True)


if __name__ == "__main__":
    main()
