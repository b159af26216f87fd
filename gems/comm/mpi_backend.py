"""The default backend: mpi4py operating directly on the tensors' memory.

CPU tensors are handed to MPI as byte views of their storage: no copy, and every dtype works,
bfloat16 included. Copies happen only where they must: a non-contiguous tensor goes through a
contiguous staging tensor; a reduction over a dtype MPI cannot add (bfloat16, float8) runs in
float32 and is rounded back; a CUDA tensor is staged through pinned host memory unless the MPI is
CUDA-aware (``MPI.Query_cuda_support()`` or GEMS_CUDA_AWARE_MPI=1), in which case MPI gets the
device tensor itself through ``__cuda_array_interface__``.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, NoReturn

import torch
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype
from torch import Tensor

from gems.comm.base import Backoff, Comm, Group, Request, check_group_ranks, message_tag, placement
from gems.errors import GemsError


def cuda_aware() -> bool:
    """Whether MPI can read and write device memory (GEMS_CUDA_AWARE_MPI=0/1 overrides the query)."""
    override = os.environ.get("GEMS_CUDA_AWARE_MPI")
    if override is not None:
        return override == "1"
    query = getattr(MPI, "Query_cuda_support", None)
    return bool(query()) if query is not None else False


_REDUCIBLE: dict[torch.dtype, bool] = {}


def mpi_can_sum(dtype: torch.dtype) -> bool:
    """Whether MPI has a datatype it can add for ``dtype`` (numpy must know the dtype, MPI too)."""
    if dtype not in _REDUCIBLE:
        try:
            np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
            _REDUCIBLE[dtype] = from_numpy_dtype(np_dtype) != MPI.DATATYPE_NULL
        except Exception:  # noqa: BLE001 -- numpy or MPI lacks the type: sum in float32 instead
            _REDUCIBLE[dtype] = False
    return _REDUCIBLE[dtype]


def _as_bytes(wire: Tensor) -> Any:
    """A uint8 view of the contiguous ``wire``: numpy on the host, the tensor itself on a GPU."""
    flat = wire.reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()


def _as_typed(wire: Tensor) -> Any:
    """``wire`` with its element type visible to MPI (for reductions)."""
    return wire if wire.is_cuda else wire.numpy()


class MPIComm(Comm):
    """Communicator on a duplicate of MPI_COMM_WORLD (so no other MPI user's message can match ours)."""

    backend = "mpi"

    def __init__(self, device: torch.device, timeout: float, backoff: Backoff) -> None:
        world = MPI.COMM_WORLD
        super().__init__(*placement(world, device), timeout, backoff)
        self._comm = world.Dup()
        self._tag_ub: int = world.Get_attr(MPI.TAG_UB)
        self._cuda_aware = cuda_aware()
        self._groups_made = 0

    def _wire(self, t: Tensor, load: bool, reduce: bool = False) -> tuple[Tensor, Callable[[], Any] | None]:
        """A contiguous tensor MPI can use for ``t`` (``t`` itself when possible) and the copy back
        into ``t`` that an operation writing into it needs (None when the wire tensor is ``t``).
        ``load``: the operation reads the data, so a staging tensor must start with it."""
        t = t.detach()
        wire = t
        if reduce and not mpi_can_sum(t.dtype):
            wire = t.to(torch.complex64 if t.is_complex() else torch.float32,
                        memory_format=torch.contiguous_format)
        if wire.is_cuda and not self._cuda_aware:
            host = torch.empty(wire.shape, dtype=wire.dtype, pin_memory=True)
            wire = host.copy_(wire) if load else host
        elif not wire.is_contiguous():
            staged = torch.empty(wire.shape, dtype=wire.dtype, device=wire.device)
            wire = staged.copy_(wire) if load else staged
        if wire.is_cuda:
            torch.cuda.current_stream(wire.device).synchronize()  # MPI knows nothing of CUDA streams
        if wire is t:
            return t, None
        return wire, lambda: t.copy_(wire)

    def _mpi(self, group: Group | None) -> Any:
        return self._comm if group is None else group.handle

    def _members(self, group: Group | None) -> str:
        return f"all {self.size} ranks" if group is None else f"ranks {group.ranks}"

    def isend(self, tensors: tuple[Tensor, ...], dst: int, tag: int) -> Request:
        tags = [message_tag(tag, i, self._tag_ub) for i in range(len(tensors))]
        keep, reqs = [], []
        for t, wire_tag in zip(tensors, tags):
            wire, _ = self._wire(t, load=True)
            buf = _as_bytes(wire)
            keep += [wire, buf]
            reqs.append(self._comm.Isend([buf, MPI.BYTE], dst, wire_tag))
        return Request(lambda: MPI.Request.Testall(reqs), f"send to rank {dst}, tag {tag}", keep)

    def irecv(self, buffers: tuple[Tensor, ...], src: int, tag: int) -> Request:
        tags = [message_tag(tag, i, self._tag_ub) for i in range(len(buffers))]
        keep, reqs, copies, sizes = [], [], [], []
        for t, wire_tag in zip(buffers, tags):
            wire, copy_back = self._wire(t, load=False)
            buf = _as_bytes(wire)
            keep += [wire, buf]
            sizes.append(wire.numel() * wire.element_size())
            copies += [copy_back] if copy_back is not None else []
            reqs.append(self._comm.Irecv([buf, MPI.BYTE], src, wire_tag))
        statuses = [MPI.Status() for _ in reqs]
        describe = f"recv from rank {src}, tag {tag}"

        def test() -> bool:
            try:
                if not MPI.Request.Testall(reqs, statuses):
                    return False
            except MPI.Exception as exc:  # e.g. a message longer than its buffer
                errors = [MPI.Get_error_string(s.Get_error()) for s in statuses
                          if s.Get_error() != MPI.SUCCESS] or [exc.Get_error_string()]
                raise RuntimeError(f"rank {self.rank}: {describe} failed: {' '.join(errors[0].split())}; "
                                   f"the ranks disagree on the boundary shapes or dtypes") from exc
            for i, (status, size) in enumerate(zip(statuses, sizes)):
                got = status.Get_count(MPI.BYTE)
                if got != size:
                    raise RuntimeError(f"rank {self.rank}: {describe}: tensor {i} brought {got} bytes "
                                       f"for a {size}-byte buffer; the ranks disagree on the boundary "
                                       f"shapes or dtypes")
            return True

        finish = (lambda: [copy() for copy in copies]) if copies else None
        return Request(test, describe, keep, finish)

    def group(self, ranks: list[int]) -> Group | None:
        ranks = check_group_ranks(ranks, self.size)
        # Also waits, with the timeout, until every rank makes this call: Create_group itself
        # blocks, spinning, with no timeout, if a member never arrives.
        self.check_same_group(ranks)
        self._groups_made += 1  # tags this creation apart from groups being made concurrently
        if self.rank not in ranks:
            return None
        members = self._comm.Get_group().Incl(ranks)
        handle = self._comm.Create_group(members, tag=self._groups_made)
        members.Free()
        return Group(ranks, ranks.index(self.rank), handle)

    def iallreduce(self, tensor: Tensor, group: Group | None) -> Request:
        wire, copy_back = self._wire(tensor, load=True, reduce=True)
        buf = _as_typed(wire)
        req = self._mpi(group).Iallreduce(MPI.IN_PLACE, buf, MPI.SUM)
        return Request(req.Test, f"allreduce over {self._members(group)}", (wire, buf), copy_back)

    def ibroadcast(self, tensor: Tensor, root: int, group: Group | None) -> Request:
        ranks = group.ranks if group is not None else range(self.size)
        if root not in ranks:
            raise GemsError(f"broadcast root {root} is not in the group {list(ranks)}")
        is_root = root == self.rank
        wire, copy_back = self._wire(tensor, load=is_root)
        buf = _as_bytes(wire)
        req = self._mpi(group).Ibcast([buf, MPI.BYTE], root=list(ranks).index(root))
        return Request(req.Test, f"broadcast from rank {root} to {self._members(group)}", (wire, buf),
                       None if is_root else copy_back)

    def iallgather_bytes(self, data: Tensor, group: Group | None) -> tuple[Request, Tensor]:
        members = group.size if group is not None else self.size
        rows = torch.empty(members, data.numel(), dtype=torch.uint8)
        send, recv = data.contiguous().numpy(), rows.numpy()
        req = self._mpi(group).Iallgather([send, MPI.BYTE], [recv, MPI.BYTE])
        return Request(req.Test, f"allgather over {self._members(group)}", (send, recv)), rows

    def ibarrier(self) -> Request:
        return Request(self._comm.Ibarrier().Test, f"barrier over all {self.size} ranks")

    def abort(self, code: int = 1) -> NoReturn:
        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(code)
        os._exit(code)  # not reached: Abort ends the process
