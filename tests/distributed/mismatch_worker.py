"""Received tensors of the wrong size, both cases on one launch, for tests/test_handshake.py:

    mpiexec -n 2 python tests/distributed/mismatch_worker.py BACKEND

Rank 0 sends 5 floats twice. Rank 1 receives the first into a buffer of 6: the error it raises is
caught and printed as "buffer of 6: MESSAGE" on stderr (the message arrived whole, so the
communicator stays usable). Then it receives the second into a buffer of 4, inside comm.guard() as
any gems program would: that error ends the job (under gloo, by aborting the receiving process).
A receive that completes instead prints "... without an error" on stdout.
"""
from __future__ import annotations

import sys

import torch

import gems.comm


def main() -> None:
    comm = gems.comm.create(sys.argv[1], timeout=30.0)
    with comm.guard():
        for tag, elements in enumerate((6, 4), start=7):
            if comm.rank == 0:
                comm.wait(comm.isend((torch.ones(5),), 1, tag=tag), "the odd-sized message")
            elif comm.rank == 1:
                into = (torch.zeros(elements),)
                try:
                    comm.wait(comm.irecv(into, 0, tag=tag), "the odd-sized message")
                except Exception as error:  # noqa: BLE001 - each backend raises its own kind
                    if elements != 6:
                        raise
                    print(f"buffer of {elements}: {error}", file=sys.stderr, flush=True)
                else:
                    print(f"rank 1: received {into[0].tolist()} into a buffer of {elements} without an error",
                          flush=True)
            comm.barrier()


if __name__ == "__main__":
    main()
