"""Received tensors of the wrong size, both cases on one launch, for tests/test_handshake.py:

    mpiexec -n 2 python tests/distributed/mismatch_worker.py BACKEND

Rank 0 sends 5 floats three times. Rank 1 receives the first into a buffer of 6, the second into
a strided buffer of 6 (every other float of 12: a backend stages it, another path than a dense
buffer's): the error each raises is caught and printed as "buffer of 6: MESSAGE" or "strided buffer
of 6: MESSAGE" on stderr (the message arrived whole, so the communicator stays usable). Then it
receives the third into a buffer of 4, inside comm.guard() as any gems program would: that error
ends the job (under gloo, by aborting the receiving process). A receive that completes instead
prints "... without an error" on stdout.
"""
from __future__ import annotations

import sys

import torch

import gems.comm


def main() -> None:
    comm = gems.comm.create(sys.argv[1], timeout=30.0)
    with comm.guard():
        buffers = {"buffer of 6": lambda: torch.zeros(6), "strided buffer of 6": lambda: torch.zeros(12)[::2],
                   "buffer of 4": lambda: torch.zeros(4)}
        for tag, (name, make) in enumerate(buffers.items(), start=7):
            if comm.rank == 0:
                comm.wait(comm.isend((torch.ones(5),), 1, tag=tag), "the odd-sized message")
            elif comm.rank == 1:
                into = (make(),)
                try:
                    comm.wait(comm.irecv(into, 0, tag=tag), "the odd-sized message")
                except Exception as error:  # noqa: BLE001 - each backend raises its own kind
                    if name == "buffer of 4":
                        raise
                    print(f"{name}: {error}", file=sys.stderr, flush=True)
                else:
                    print(f"rank 1: received {into[0].tolist()} into a {name} without an error", flush=True)
            comm.barrier()


if __name__ == "__main__":
    main()
