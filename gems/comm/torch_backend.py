"""The torch.distributed backend: gloo for CPU tensors, NCCL for CUDA tensors.

The job is still launched by ``mpiexec``/``srun``: mpi4py supplies rank, size and the node-local
ranks, and rank 0 opens the rendezvous store on a free port (port 0: the OS picks one, so no
fixed port can collide) on its host (or MASTER_ADDR if set), whose port it broadcasts with MPI.

Completion is polled like in the MPI backend, with one twist: gloo marks a point-to-point work
complete only inside ``wait()``, so each gloo send/recv request gets a small thread that blocks in
``wait()`` (releasing the GIL, without spinning) while the caller polls the thread. NCCL works
report completion through ``is_completed()``. NCCL ignores tags: between two ranks, its messages
match in the order they were posted.
"""
from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import Tensor

from gems.comm.base import (TENSORS_PER_MESSAGE, Backoff, Comm, Group, Request, check_group_ranks, message_tag,
                             placement)
from gems.errors import GemsError

TAG_UB = 2**31 - 1  # tags are C ints in the gloo bindings
# The waiter thread must not time out on its own: a receive may be posted long before it is
# waited for, and Comm.wait measures the timeout from the wait, not from the post.
_NO_TIMEOUT = timedelta(days=7)


class _Waiter:
    """Calls ``wait()`` on gloo works in a thread, since gloo completes p2p works only there."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gems-comm-wait", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for work in self._works:
                work.wait(_NO_TIMEOUT)
        except BaseException as exc:  # noqa: BLE001 -- handed to the polling thread
            self._error = exc

    def done(self) -> bool:
        if self._thread.is_alive():
            return False
        if self._error is not None:
            raise self._error
        return True


def _p2p_test(works: list[Any], on_cuda: list[bool]) -> Any:
    """The completion test of a p2p request: a waiter thread for gloo works, is_completed for NCCL."""
    gloo = [w for w, cuda in zip(works, on_cuda) if not cuda]
    nccl = [w for w, cuda in zip(works, on_cuda) if cuda]
    waiter = _Waiter(gloo) if gloo else None
    return lambda: (waiter is None or waiter.done()) and all(_finished(w) for w in nccl)


def _finished(work: Any) -> bool:
    # gloo reports a failed work as completed; wait() then raises its error (and returns at once
    # otherwise). For NCCL, wait() orders the current stream after the transfer.
    return work.is_completed() and (work.wait() or True)


def _collective_test(work: Any) -> Any:
    return lambda: _finished(work)


def _check_count(n: int) -> None:
    if n >= TENSORS_PER_MESSAGE:   # one wire tag of each message carries the sizes
        raise GemsError(f"the torch backend moves at most {TENSORS_PER_MESSAGE - 1} tensors per message; "
                        f"pack the stage boundary into fewer tensors (got {n})")


def _sizes(wires: list[Tensor]) -> Tensor:
    """The byte sizes of a message's tensors, on their device (NCCL carries only CUDA tensors)."""
    device = wires[0].device if wires else torch.device("cpu")
    return torch.tensor([w.numel() * w.element_size() for w in wires], dtype=torch.int64, device=device)


def _rendezvous(world: Any, timeout: float) -> dist.TCPStore:
    """The TCP store every rank connects to, opened by rank 0 on a port the OS chooses."""
    if world.rank == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        store = dist.TCPStore(host, 0, world.size, True, timedelta(seconds=timeout),
                              wait_for_workers=False)
        address = (host, store.port)
    else:
        address = None
    host, port = world.bcast(address, root=0)
    if world.rank != 0:
        store = dist.TCPStore(host, port, world.size, False, timedelta(seconds=timeout))
    return store


class TorchComm(Comm):
    """Communicator on torch.distributed's default process group, initialised from MPI."""

    backend = "torch"

    def __init__(self, device: torch.device, timeout: float, backoff: Backoff) -> None:
        if dist.is_initialized():
            raise GemsError("torch.distributed is already initialised; create one 'torch' "
                            "communicator per process")
        world = MPI.COMM_WORLD
        super().__init__(*placement(world, device), timeout, backoff)
        if self.device.type == "cuda":
            backend = "cpu:gloo,cuda:nccl"  # gloo still carries CPU tensors (allgather_object)
        else:
            backend = "gloo"
        dist.init_process_group(backend, store=_rendezvous(world, timeout), rank=self.rank,
                                world_size=self.size, timeout=timedelta(seconds=timeout))
        atexit.register(self._close)

    @staticmethod
    def _close() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def _members(self, group: Group | None) -> str:
        return f"all {self.size} ranks" if group is None else f"ranks {group.ranks}"

    @staticmethod
    def _pg(group: Group | None) -> Any:
        return None if group is None else group.handle

    def isend(self, tensors: tuple[Tensor, ...], dst: int, tag: int) -> Request:
        _check_count(len(tensors))
        wires = [t.detach().contiguous() for t in tensors]
        wires = [_sizes(wires), *wires]   # byte sizes first: see irecv
        tags = [message_tag(tag, i, TAG_UB) for i in range(len(wires))]
        works = [dist.isend(w, dst, tag=wire_tag) for w, wire_tag in zip(wires, tags)]
        return Request(_p2p_test(works, [w.is_cuda for w in wires]),
                       f"send to rank {dst}, tag {tag}", wires)

    def irecv(self, buffers: tuple[Tensor, ...], src: int, tag: int) -> Request:
        """Gloo fills a larger buffer with a smaller message and reports success, and NCCL does
        not check sizes at all, so every message starts with its tensors' byte sizes, checked
        on completion: a mismatch is a clear error, never a silently short tensor."""
        _check_count(len(buffers))
        wires = [t.detach() if t.is_contiguous() else
                 torch.empty_like(t, memory_format=torch.contiguous_format) for t in buffers]
        expected = [w.numel() * w.element_size() for w in wires]
        sizes = torch.empty_like(_sizes(wires))
        wires = [sizes, *wires]
        tags = [message_tag(tag, i, TAG_UB) for i in range(len(wires))]
        works = [dist.irecv(w, src, tag=wire_tag) for w, wire_tag in zip(wires, tags)]
        pairs = [(t, w) for t, w in zip(buffers, wires[1:]) if not t.is_contiguous()]

        def finish() -> None:
            for i, (got, want) in enumerate(zip(sizes.tolist(), expected)):
                if got != want:
                    raise GemsError(f"tensor {i} from rank {src} brought {got} bytes for a {want}-byte buffer; the "
                                    "ranks disagree on the boundary shapes or dtypes: give every rank the same plan")
            for t, w in pairs:
                t.detach().copy_(w)
        return Request(_p2p_test(works, [w.is_cuda for w in wires]),
                       f"recv from rank {src}, tag {tag}", wires, finish)

    def group(self, ranks: list[int]) -> Group | None:
        ranks = check_group_ranks(ranks, self.size)
        self.check_same_group(ranks)
        handle = dist.new_group(sorted(ranks), timeout=timedelta(seconds=self.timeout))
        if self.rank not in ranks:
            return None
        return Group(ranks, ranks.index(self.rank), handle)

    def _inplace(self, tensor: Tensor) -> tuple[Tensor, Any]:
        """A contiguous tensor holding ``tensor``'s data, and the copy back (None if it is ``tensor``)."""
        t = tensor.detach()
        if t.is_contiguous():
            return t, None
        wire = t.contiguous()
        return wire, lambda: t.copy_(wire)

    def iallreduce(self, tensor: Tensor, group: Group | None) -> Request:
        wire, copy_back = self._inplace(tensor)
        work = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=self._pg(group), async_op=True)
        return Request(_collective_test(work), f"allreduce over {self._members(group)}", (wire,), copy_back)

    def ibroadcast(self, tensor: Tensor, root: int, group: Group | None) -> Request:
        if group is not None and root not in group.ranks:
            raise GemsError(f"broadcast root {root} is not in the group {group.ranks}")
        wire, copy_back = self._inplace(tensor)
        work = dist.broadcast(wire, src=root, group=self._pg(group), async_op=True)
        return Request(_collective_test(work), f"broadcast from rank {root} to {self._members(group)}",
                       (wire,), copy_back)

    def iallgather_bytes(self, data: Tensor, group: Group | None) -> tuple[Request, Tensor]:
        members = group.size if group is not None else self.size
        rows = torch.empty(members, data.numel(), dtype=torch.uint8)
        # torch numbers a group's members in sorted order; rows are wanted in Group.ranks order.
        order = sorted(range(members), key=lambda i: group.ranks[i]) if group is not None else range(members)
        out = [rows[i] for i in order]
        work = dist.all_gather(out, data.contiguous(), group=self._pg(group), async_op=True)
        return Request(_collective_test(work), f"allgather over {self._members(group)}", (data, out)), rows

    def ibarrier(self) -> Request:
        # A one-element CPU allreduce: it always runs on gloo, whichever device backs the job.
        req = self.iallreduce(torch.zeros(1), None)
        req.describe = f"barrier over all {self.size} ranks"
        return req

    def abort(self, code: int = 1) -> NoReturn:
        # No destroy_process_group(): it may block on the very peer that failed. MPI_Abort has the
        # launcher end every rank.
        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(code)
        os._exit(code)  # not reached: Abort ends the process
