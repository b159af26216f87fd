"""gems.comm.ring: the ring allreduce/allgather's steps in-process (members polled in turn over a
mailbox, any member count and chunk sizes), and the MPI backend's use of it in one launch."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from gems.comm.ring import Ring, Scratch, even_bounds

WORKER = Path(__file__).parent / "distributed" / "ring_worker.py"


def run_rings(flats: list[torch.Tensor], bounds: list[int], reduce: bool, gather: bool = True) -> int:
    """Run one Ring per member over a mailbox; returns the polls it took. Messages are clones, so
    a member that changes a chunk after sending it cannot change what was sent."""
    n = len(flats)
    mailbox: dict[tuple[int, int], torch.Tensor] = {}
    sent = [0] * n
    received = [0] * n

    def member(me: int) -> Ring:
        def exchange(send: torch.Tensor, into: torch.Tensor):
            mailbox[(me, sent[me])] = send.clone()
            sent[me] += 1
            return into

        def finished(into: torch.Tensor) -> bool:
            key = ((me - 1) % n, received[me])
            if key not in mailbox:
                return False
            into.copy_(mailbox.pop(key))
            received[me] += 1
            return True
        scratch = torch.full((max(b - a for a, b in zip(bounds, bounds[1:])),), 12345, dtype=flats[me].dtype)
        return Ring(flats[me], bounds, me, exchange, finished, reduce, scratch, gather)

    rings = [member(me) for me in range(n)]
    for ring in rings:
        ring.start()
    polls = 0
    while not all([ring.poll() for ring in rings]):
        polls += 1
        assert polls < 10 * n, "the ring does not progress"
    assert not mailbox
    return polls


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("numel", [0, 1, 7, 64])
def test_ring_allreduce_sums_on_every_member_with_the_same_bits(n, numel):
    g = torch.Generator().manual_seed(n * 100 + numel)
    flats = [torch.randn(numel, generator=g) for _ in range(n)]
    want = torch.stack(flats).double().sum(0) if numel else torch.zeros(0, dtype=torch.float64)
    run_rings(flats, even_bounds(numel, n), reduce=True)
    for flat in flats:
        assert torch.equal(flat.view(torch.int32), flats[0].view(torch.int32))   # bit-identical
        assert torch.allclose(flat.double(), want, atol=1e-5)


@pytest.mark.parametrize("bounds", [[0, 10], [0, 3, 10], [0, 0, 10], [0, 10, 10], [0, 1, 1, 6, 10], [0, 0, 0, 0, 10]])
def test_ring_allgather_hands_every_run_to_every_member(bounds):
    n = len(bounds) - 1
    flats = []
    for me in range(n):
        flat = torch.full((10,), -1.0)
        flat[bounds[me]:bounds[me + 1]] = torch.arange(bounds[me], bounds[me + 1], dtype=torch.float32)
        flats.append(flat)
    run_rings(flats, bounds, reduce=False)
    for flat in flats:
        assert torch.equal(flat, torch.arange(10.0))


@pytest.mark.parametrize("bounds", [[0, 9], [0, 4, 9], [0, 0, 9], [0, 2, 2, 9], [0, 1, 3, 6, 9]])
def test_ring_reduce_scatter_leaves_each_member_the_sum_of_its_own_run(bounds):
    n = len(bounds) - 1
    flats = [torch.arange(9.0) * (me + 1) for me in range(n)]
    run_rings(flats, bounds, reduce=True, gather=False)
    total = n * (n + 1) / 2
    for me, flat in enumerate(flats):
        lo, hi = bounds[me], bounds[me + 1]
        assert torch.equal(flat[lo:hi], torch.arange(lo, hi, dtype=torch.float32) * total)


def test_integer_sums_are_exact_and_uneven_chunks_work():
    flats = [torch.arange(11, dtype=torch.int64) * (me + 1) for me in range(3)]
    run_rings(flats, [0, 5, 5, 11], reduce=True)
    for flat in flats:
        assert torch.equal(flat, torch.arange(11) * 6)


def test_even_bounds_and_scratch_reuse():
    assert even_bounds(10, 3) == [0, 3, 6, 10] and even_bounds(0, 2) == [0, 0, 0]
    pool = Scratch()
    a = pool.take(100, torch.float32)
    pool.give(a)
    assert pool.take(50, torch.float32) is a            # a large enough free buffer is reused
    assert pool.take(50, torch.float64) is not a       # never across dtypes


@pytest.mark.timeout(90)
def test_mpi_backend_sums_and_gathers_through_the_ring(run_mpi):
    # pieces of 16 bytes: the ring's messages also travel in pieces where the MPI needs them
    result = run_mpi(3, WORKER, timeout=75, env={"GEMS_MAX_MESSAGE_BYTES": "16"})
    found = {int(r): int(n) for r, n in re.findall(r"rank (\d+): ok, (\d+) rings", result.stdout)}
    assert sorted(found) == [0, 1, 2], result.tail()
    assert found[1] > 0 and found[0] > found[1], found   # rank 1 is in two of the three groups
