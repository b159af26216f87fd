"""The torch.distributed backend: gloo for CPU tensors, NCCL for CUDA tensors.

Who this rank is comes from its launcher (``gems.comm.launcher``). Under ``mpiexec`` (or ``srun
--mpi=pmi2``) mpi4py supplies rank, size and the node-local ranks, and rank 0 opens the
rendezvous store on a free port (port 0: the OS picks one, so no fixed port can collide) on its
host (or MASTER_ADDR if set), whose port it broadcasts with MPI. Under torchrun, or a Slurm step
launched without MPI, MPI is never imported: the store is torch's ``env://`` rendezvous (joining
the one torchrun's agent hosts) or one opened by rank 0 on the step's first host, the ranks of a
node find each other through it, and a failing rank ends the job by exiting (the launcher, told
``--kill-on-bad-exit`` under srun, ends the others).

Completion is polled like in the MPI backend, with one twist: gloo marks a point-to-point work
complete only inside ``wait()``, so each gloo send/recv request gets a small thread that blocks in
``wait()`` (releasing the GIL, without spinning) while the caller polls the thread. NCCL works
report completion through ``is_completed()``. NCCL ignores tags: between two ranks, its messages
match in the order they were posted.

A message is a header (its tag and its tensors' byte sizes) followed by its tensors, each in
pieces of at most ``message_limit`` bytes, all posted as one ``batch_isend_irecv`` call: under
NCCL one group, so a message's transfers, and those of all messages of one ``ibatch``, start
together. The receiver checks the header: a message that arrives where another was expected
(NCCL, matching by order, delivers whatever the peer posted at that place) is a clear error.
"""
from __future__ import annotations

import atexit
import os
import socket
import threading
from datetime import timedelta
from typing import Any, Callable, NoReturn, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from gems.comm import launcher
from gems.comm.abort import exit_abort, mpi_abort
from gems.comm.base import (TENSORS_PER_MESSAGE, Backoff, Comm, Group, P2POp, Request, byte_ranges,
                             check_group_ranks, max_message_bytes, message_tag)
from gems.comm.placement import placement, placement_by_store
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


def _p2p_test(gloo: list[Any], nccl: list[Any]) -> Callable[[], bool]:
    """The completion test of a p2p request: a waiter thread for gloo works, is_completed for NCCL."""
    waiter = _Waiter(gloo) if gloo else None
    return lambda: (waiter is None or waiter.done()) and all(_finished(w) for w in nccl)


def _finished(work: Any) -> bool:
    # gloo reports a failed work as completed; wait() then raises its error (and returns at once
    # otherwise). For NCCL, wait() orders the current stream after the transfer.
    return work.is_completed() and (work.wait() or True)


def _collective_test(work: Any) -> Any:
    return lambda: _finished(work)


def _check_count(n: int) -> None:
    if n >= TENSORS_PER_MESSAGE:   # one wire tag of each message carries the header
        raise GemsError(f"the torch backend moves at most {TENSORS_PER_MESSAGE - 1} tensors per message; "
                        f"pack the stage boundary into fewer tensors (got {n})")


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def check_header(header: list[int], tag: int, expected: list[int], src: int, rank: int) -> None:
    """GemsError unless a received header (tag, then byte sizes) is the one this receive expects.

    Gloo fills a larger buffer with a smaller message and reports success, NCCL checks no sizes
    and ignores tags: without this check, a short tensor or a swapped message (mast's activations
    and gradients between one pair have the same shapes) would go unnoticed."""
    got_tag, *sizes = header
    if got_tag != tag:
        raise GemsError(f"rank {rank} expected message tag {tag} from rank {src} but got {got_tag}; the ranks "
                        f"posted their transfers in different orders: derive every rank's transfers from the "
                        f"same schedule")
    for i, (got, want) in enumerate(zip(sizes, expected)):
        if got != want:
            raise GemsError(f"tensor {i} from rank {src} brought {got} bytes for a {want}-byte buffer; the "
                            "ranks disagree on the boundary shapes or dtypes: give every rank the same plan")


def _rendezvous(world: Any, timeout: float) -> dist.TCPStore:
    """Under MPI: the TCP store every rank connects to, opened by rank 0 on a port the OS chooses."""
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


def _launcher_store(me: launcher.Identity, timeout: float) -> dist.Store:
    """Without MPI: the store of torchrun's ``env://`` rendezvous, or one rank 0 of a Slurm step
    opens at the address and port the step's variables give."""
    wait = timedelta(seconds=timeout)
    try:
        if me.launcher == "torchrun":
            store, _, _ = next(dist.rendezvous("env://", me.rank, me.size, timeout=wait))
            return store
        return dist.TCPStore(me.master_addr, me.master_port, me.size, me.rank == 0, wait,
                             wait_for_workers=False)
    except (RuntimeError, ValueError, OSError) as error:
        raise GemsError(f"rank {me.rank} cannot reach the rendezvous at {me.master_addr}:{me.master_port} "
                        f"({' '.join(str(error).split())[:200]}): check MASTER_ADDR and MASTER_PORT") from None


class TorchComm(Comm):
    """Communicator on torch.distributed's default process group, its ranks named by MPI or by the
    launcher's environment (torchrun, a Slurm step).

    ``message_limit``: the byte size above which a tensor travels in pieces."""

    backend = "torch"
    polls_freely = True

    def __init__(self, device: torch.device, timeout: float, backoff: Backoff,
                 allow_shared_gpu: bool = False) -> None:
        if dist.is_initialized():
            raise GemsError("torch.distributed is already initialised; create one 'torch' "
                            "communicator per process")
        me = launcher.identity()
        self._mpi = me is None
        if me is None:
            world = launcher.mpi().COMM_WORLD
            super().__init__(*placement(world, device, allow_shared_gpu), timeout, backoff)
            store = _rendezvous(world, timeout)
        else:
            store = _launcher_store(me, timeout)
            super().__init__(*placement_by_store(store, me.rank, me.size, device, allow_shared_gpu), timeout,
                             backoff)
        # NCCL kernels of the sync groups' communicators and the point-to-point one may wait on
        # each other when ranks start them in different orders: no reduce overlaps a step there
        self.overlaps_collectives = self.device.type != "cuda"
        if self.device.type == "cuda":
            backend = "cpu:gloo,cuda:nccl"  # gloo still carries CPU tensors (allgather_object)
        else:
            backend = "gloo"
        # gloo's and NCCL's counts are 64-bit, but their transports are not all so generous (gloo
        # over ibverbs stops at the device's largest message): the same pieces as MPI's.
        self.message_limit = max_message_bytes()
        self._side: Any = None   # the CUDA stream on which received headers are read
        # device_id forms the NCCL communicator now: batch_isend_irecv may then involve only some
        # ranks (a pipeline's first transfer is between two), which as the first NCCL call it may not.
        dist.init_process_group(backend, store=store, rank=self.rank,
                                world_size=self.size, timeout=timedelta(seconds=timeout),
                                device_id=self.device if self.device.type == "cuda" else None)
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

    def _read(self, header: Tensor) -> list[int]:
        """The values of a received header; on a GPU copied on a side stream, so the host waits for
        a few bytes, not for the compute stream (the transfer itself has completed)."""
        if not header.is_cuda:
            return header.tolist()
        if self._side is None:
            self._side = torch.cuda.Stream(header.device)
        with torch.cuda.stream(self._side):
            return header.tolist()

    def _pieces(self, header: Tensor, wires: list[Tensor], tag: int) -> list[tuple[Tensor, int]]:
        """(piece, wire tag) of a message in posting order: the header, then each tensor's pieces.
        Pieces of one tensor share its wire tag: gloo matches one tag's messages between a pair in
        the order they were sent, NCCL matches everything in posting order."""
        parts = [(header, message_tag(tag, 0, TAG_UB))]
        for i, w in enumerate(wires, start=1):
            flat = w.reshape(-1).view(torch.uint8)
            parts += [(flat[a:b], message_tag(tag, i, TAG_UB)) for a, b in byte_ranges(_nbytes(w), self.message_limit)]
        return parts

    def _send(self, op: P2POp) -> tuple[list[tuple[Tensor, int]], Any]:
        _check_count(len(op.tensors))
        wires = [t.detach().contiguous() for t in op.tensors]
        device = wires[0].device if wires else torch.device("cpu")   # NCCL carries only CUDA tensors
        header = torch.tensor([op.tag, *map(_nbytes, wires)], dtype=torch.int64, device=device)
        return self._pieces(header, wires, op.tag), None

    def _recv(self, op: P2POp) -> tuple[list[tuple[Tensor, int]], Any]:
        _check_count(len(op.tensors))
        buffers = [t.detach() for t in op.tensors]
        self.count_received(buffers, op.tag)
        wires = [t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
                 for t in buffers]
        device = wires[0].device if wires else torch.device("cpu")
        header = torch.empty(1 + len(wires), dtype=torch.int64, device=device)

        def finish() -> None:
            check_header(self._read(header), op.tag, list(map(_nbytes, wires)), op.peer, self.rank)
            for t, w in zip(buffers, wires):
                if w is not t:
                    t.copy_(w)
        return self._pieces(header, wires, op.tag), finish

    def ibatch(self, ops: Sequence[P2POp]) -> list[Request]:
        """All transfers of ``ops`` in one ``batch_isend_irecv`` call per device type: under NCCL
        one group, so no receive of the call can hold up a send of it."""
        posted = [self._send(op) if op.op == "send" else self._recv(op) for op in ops]
        works: list[tuple[list[Any], list[Any]]] = [([], []) for _ in ops]   # (gloo, NCCL) works of each op
        flat = [(i, piece, wire_tag) for i, (parts, _) in enumerate(posted) for piece, wire_tag in parts]
        for kind in dict.fromkeys(piece.device.type for _, piece, _ in flat):
            mine = [(i, dist.P2POp(dist.isend if ops[i].op == "send" else dist.irecv, piece, ops[i].peer,
                                   tag=wire_tag)) for i, piece, wire_tag in flat if piece.device.type == kind]
            got = dist.batch_isend_irecv([p2p for _, p2p in mine])
            # gloo returns one work per transfer; NCCL one work for the whole group, shared by all.
            pairs = zip((i for i, _ in mine), got) if len(got) == len(mine) else \
                [(i, work) for i in dict.fromkeys(i for i, _ in mine) for work in got]
            for i, work in pairs:
                works[i][1 if kind == "cuda" else 0].append(work)
        return [Request(_p2p_test(*works[i]),
                        f"{'send to' if op.op == 'send' else 'recv from'} rank {op.peer}, tag {op.tag}",
                        [piece for piece, _ in parts], finish)
                for i, (op, (parts, finish)) in enumerate(zip(ops, posted))]

    def isend(self, tensors: tuple[Tensor, ...], dst: int, tag: int) -> Request:
        return self.ibatch([P2POp("send", tuple(tensors), dst, tag)])[0]

    def irecv(self, buffers: tuple[Tensor, ...], src: int, tag: int) -> Request:
        """Every message starts with a header (tag and byte sizes), checked on completion (see
        :func:`check_header`): a mismatch is a clear error, never a silently short or swapped tensor."""
        return self.ibatch([P2POp("recv", tuple(buffers), src, tag)])[0]

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
        # launcher end every rank; without MPI the launcher does so when this rank exits.
        if self._mpi:
            mpi_abort(code)
        exit_abort(code)
