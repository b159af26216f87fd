"""Messages in pieces, on both backends in one launch (tests/test_comm_large.py):

    GEMS_MAX_MESSAGE_BYTES=64 mpiexec -n 2 python tests/distributed/comm_large_worker.py

Each rank creates an MPI and a torch (gloo) communicator, so one launch checks both: tensors of
many sizes around the limit exchanged both ways (non-contiguous sources and destinations,
bfloat16, empty, 0-dim), two messages in flight between the pair, ``ibatch``, a broadcast in
pieces; then what needs no peer: the MPI backend's posting order while a staging copy is
pending, the staging pool's bound, and the torch backend's header check. Prints "rank R: ok".
"""
from __future__ import annotations

import os

import torch

import gems.comm
from gems.comm import P2POp
from gems.comm.staging import StagingPool, large_count
from gems.comm.torch_backend import check_header
from gems.errors import GemsError

LIMIT = int(os.environ["GEMS_MAX_MESSAGE_BYTES"])


def message(rank: int, round_: int) -> tuple[torch.Tensor, ...]:
    """Tensors below, at, between and far above multiples of LIMIT, whose values name the sender."""
    g = torch.Generator().manual_seed(100 * rank + round_)
    return (torch.randn(5, 37, generator=g),                               # 740 bytes: 11 pieces and a rest
            torch.randn(3, 41, generator=g).to(torch.bfloat16),            # 246 bytes
            torch.randint(-2**40, 2**40, (LIMIT // 8 - 1,), generator=g),  # under the limit: one piece
            torch.randint(0, 256, (LIMIT,), generator=g, dtype=torch.uint8),  # exactly the limit
            torch.randn(2 * LIMIT // 4, generator=g),                      # exactly two pieces
            torch.randn(6, 40, generator=g).t(),                           # non-contiguous source
            torch.tensor(rank + round_ / 10),                              # 0-dim
            torch.empty(0, 3))                                             # empty


def buffers() -> tuple[torch.Tensor, ...]:
    return (torch.zeros(37, 5).t(),                                        # non-contiguous destination
            torch.zeros(41, 3, dtype=torch.bfloat16).t(),                   # bfloat16, non-contiguous
            torch.zeros(LIMIT // 8 - 1, dtype=torch.int64), torch.zeros(LIMIT, dtype=torch.uint8),
            torch.zeros(2 * LIMIT // 4), torch.zeros(40, 6), torch.zeros(()), torch.zeros(0, 3))


def same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            raise AssertionError(f"{what}: tensor {i} differs: got {a}, want {b}")


def exchange(comm: gems.comm.Comm) -> None:
    """Both ranks send to each other at once; then two messages in flight, received in the other
    order (tags, not arrival, decide); then, on the torch backend, both directions as one ibatch."""
    peer = 1 - comm.rank
    into = buffers()
    recv = comm.irecv(into, peer, tag=1)
    send = comm.isend(message(comm.rank, 1), peer, tag=1)
    comm.wait(send, "send in pieces")
    comm.wait(recv, "recv in pieces")
    same(into, message(peer, 1), f"{comm.backend}: exchange")

    first, second = buffers(), buffers()
    if comm.rank == 0:
        sends = [comm.isend(message(0, 3), 1, tag=3), comm.isend(message(0, 2), 1, tag=2)]
        for req in sends:
            comm.wait(req, "two messages in flight")
    else:
        recvs = [comm.irecv(first, 0, tag=2), comm.irecv(second, 0, tag=3)]
        for req in recvs:
            comm.wait(req, "two messages in flight")
        same(first, message(0, 2), f"{comm.backend}: tag 2")
        same(second, message(0, 3), f"{comm.backend}: tag 3")

    into = buffers()
    reqs = comm.ibatch([P2POp("recv", into, peer, 4), P2POp("send", message(comm.rank, 4), peer, 4)])
    for req in reqs:
        comm.wait(req, "ibatch in pieces")
    same(into, message(peer, 4), f"{comm.backend}: ibatch")


def broadcast(comm: gems.comm.Comm) -> None:
    t = torch.arange(250, dtype=torch.float32) if comm.rank == 1 else torch.zeros(250)
    comm.broadcast(t, 1, None)
    same((t,), (torch.arange(250, dtype=torch.float32),), f"{comm.backend}: broadcast in pieces")


class Gate:
    """Stands in for the CUDA event of a staging copy: ``query()`` is False until opened."""

    def __init__(self) -> None:
        self.opened = False

    def query(self) -> bool:
        return self.opened


def posting_order(comm: gems.comm.Comm) -> None:
    """A send whose staging copy is pending holds back every later operation, so a same-tag send
    behind it cannot overtake it; once the copy is done, both arrive in order (sent to self)."""
    gate, wire = Gate(), comm._wire

    def gated(t, load, store, reduce=False):
        w = wire(t, load, store, reduce)
        w.ready = gate
        return w
    a, b = torch.arange(100.0), -torch.arange(100.0)
    x, y = torch.zeros(100), torch.zeros(100)
    comm._wire = gated
    reqs = [comm.isend((a,), comm.rank, tag=9)]
    comm._wire = wire
    reqs += [comm.isend((b,), comm.rank, tag=9), comm.irecv((x,), comm.rank, tag=9), comm.irecv((y,), comm.rank, tag=9)]
    if any(comm.test(r) for r in reqs for _ in range(20)):
        raise AssertionError("an operation completed while the staging copy before it was pending")
    gate.opened = True
    for req in reqs:
        comm.wait(req, "the gated messages")
    same((x, y), (a, b), "posting order")


def staging_pool() -> None:
    """Buffers are reused by size once their copy is done; the idle ones stay within the bound."""
    pool, gate = StagingPool(max_buffers=2, max_bytes=100, pin=False), Gate()
    a, b = pool.take(40), pool.take(40)
    pool.give(a)
    pool.give(b, gate)                       # its copy back to the GPU is still running
    c, d = pool.take(40), pool.take(40)
    if c is not a or d is b or (pool.held_bytes, pool.lent_bytes) != (40, 80):
        raise AssertionError(f"reuse: held {pool.held_bytes}, lent {pool.lent_bytes}")
    gate.opened = True
    if pool.take(40) is not b:
        raise AssertionError("a buffer whose copy is done was not reused")
    for buf in (c, d, b):                    # three idle buffers, 120 bytes: over both bounds
        pool.give(buf)
    pool.give(pool.take(101))                # larger than the whole bound: never kept
    if (pool.held_bytes, pool.lent_bytes) != (80, 0) or pool.take(40) is not d:
        raise AssertionError(f"bound: held {pool.held_bytes}, lent {pool.lent_bytes}")


def header_check() -> None:
    check_header([7, 20, 0], 7, [20, 0], src=1, rank=0)
    for header, match in (([8, 20, 0], "rank 0 expected message tag 7 from rank 1 but got 8; the ranks posted"),
                          ([7, 16, 0], "tensor 0 from rank 1 brought 16 bytes for a 20-byte buffer")):
        try:
            check_header(header, 7, [20, 0], src=1, rank=0)
        except GemsError as exc:
            if match not in str(exc):
                raise AssertionError(f"{match!r} not in {exc}") from exc
        else:
            raise AssertionError(f"header {header} passed")


def main() -> None:
    mpi = gems.comm.create("mpi", timeout=30)
    with mpi.guard():
        tc = gems.comm.create("torch", timeout=30)
        for comm in (mpi, tc):
            if comm.message_limit != LIMIT:
                raise AssertionError(f"{comm.backend}: message_limit {comm.message_limit}, want {LIMIT}")
            exchange(comm)
            broadcast(comm)
        posting_order(mpi)
        staging_pool()
        header_check()
        mpi.barrier()
        print(f"rank {mpi.rank}: ok (MPI large count: {large_count()})")


if __name__ == "__main__":
    main()
