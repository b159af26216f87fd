"""How a tensor meets MPI: what this MPI can take, views of a tensor's memory, pinned host staging.

The MPI backend (gems.comm.mpi_backend) hands MPI each tensor as a :class:`Wire`: the contiguous
tensor MPI reads or writes (the tensor itself or a staging copy), the event before which MPI must
not touch it, and what brings a staging copy back. This module says what the MPI can take: device
memory (:func:`cuda_aware`), 2**31 bytes or more in one call (:func:`large_count`), a sum over a
dtype (:func:`mpi_can_sum`). And it holds what a wire is made of: the buffer views MPI is given
(:func:`as_bytes`, :func:`as_typed`), copies on a side stream that never block the host
(:func:`copy_on`), and the bounded pool of pinned host buffers through which GPU tensors meet an
MPI that cannot read device memory (:class:`StagingPool`).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import mpi4py
import torch
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype
from torch import Tensor

# Pinned buffers kept for reuse: a rank holding two stages (mast) sends and receives at most
# eight distinct boundaries (activations and gradients, both directions, both stages).
STAGING_BUFFERS = 8
STAGING_BYTES = 2**31   # pinned memory cannot be paged out: cap what sits idle between steps


def cuda_aware() -> bool:
    """Whether MPI can read and write device memory (GEMS_CUDA_AWARE_MPI=0/1 overrides the query)."""
    override = os.environ.get("GEMS_CUDA_AWARE_MPI")
    if override is not None:
        return override == "1"
    query = getattr(MPI, "Query_cuda_support", None)
    return bool(query()) if query is not None else False


def large_count() -> bool:
    """Whether one MPI call can move 2**31 bytes or more: the MPI has MPI-4's large-count routines
    (``MPI_Isend_c`` ...), which mpi4py 4 calls for every buffer (mpi4py 3 passes C ints)."""
    return MPI.Get_version() >= (4, 0) and int(mpi4py.__version__.split(".")[0]) >= 4


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


def as_bytes(wire: Tensor) -> Any:
    """A uint8 view of the contiguous ``wire``: on the host a numpy array of ``wire``'s shape but for
    the last axis (not flattened: one torch call less, and tens of these are posted a step), on a GPU
    the flat tensor itself."""
    data = (wire if wire.dim() else wire.reshape(1)).view(torch.uint8)
    return data.reshape(-1) if data.is_cuda else data.numpy()


def as_typed(wire: Tensor) -> Any:
    """``wire`` with its element type visible to MPI (for reductions)."""
    return wire if wire.is_cuda else wire.numpy()


def copy_on(stream: Any, dst: Tensor, src: Tensor) -> Any:
    """Copy ``src`` into ``dst`` on ``stream`` without blocking the host; the event of its end.
    The device tensor of the two is marked used on ``stream`` (``record_stream``)."""
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    (src if src.is_cuda else dst).record_stream(stream)
    return event


class StagingPool:
    """Pinned host buffers through which GPU tensors meet an MPI that cannot read device memory.

    A boundary has the same byte size every micro-batch, so buffers are kept by exact size and lent
    again. At most ``max_buffers`` buffers and ``max_bytes`` bytes sit idle here (the oldest go
    first; a larger buffer is never kept): pinned pages cannot be swapped out, so what the pool
    keeps must stay small and known. ``held_bytes`` (idle here) and ``lent_bytes`` (in flight) say
    how much pinned memory staging takes, for the planner to report. A buffer comes back with the
    event after which its last copy has finished; it is lent again only once that event has
    passed. ``pin=False`` gives ordinary memory (tests without a GPU)."""

    def __init__(self, max_buffers: int = STAGING_BUFFERS, max_bytes: int = STAGING_BYTES, pin: bool = True) -> None:
        self.max_buffers, self.max_bytes, self.pin = max_buffers, max_bytes, pin
        self.held_bytes = self.lent_bytes = 0
        self._idle: list[tuple[Tensor, Any]] = []   # (uint8 buffer, event or None), oldest first

    def take(self, nbytes: int) -> Tensor:
        """A uint8 buffer of ``nbytes`` bytes, reused when an idle one of that size is free."""
        for i, (buf, copied) in enumerate(self._idle):
            if buf.numel() == nbytes and (copied is None or copied.query()):
                del self._idle[i]
                self.held_bytes -= nbytes
                break
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        self.lent_bytes += nbytes
        return buf

    def give(self, buf: Tensor, copied: Any = None) -> None:
        """Take back ``buf``, whose last copy finishes with the CUDA event ``copied`` (None: done)."""
        self.lent_bytes -= buf.numel()
        if buf.numel() > self.max_bytes:
            return
        self._idle.append((buf, copied))
        self.held_bytes += buf.numel()
        while len(self._idle) > self.max_buffers or self.held_bytes > self.max_bytes:
            self.held_bytes -= self._idle.pop(0)[0].numel()


class Wire:
    """How one tensor meets MPI: ``data``, the contiguous tensor MPI reads or writes (the tensor
    itself or a staging copy); ``ready``, a CUDA event that must pass before MPI may touch
    ``data`` (None: at once); ``done``, run on completion to bring a staging copy back."""

    def __init__(self, data: Tensor, ready: Any = None, done: Callable[[], Any] | None = None) -> None:
        self.data, self.ready, self.done = data, ready, done

