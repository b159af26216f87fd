"""Buffers the ranks of one node share, and the collectives that work on them where they lie.

Why by hand: between two ranks of one node, summing 45 MB of float32 (resnet18's gradients) took
16-20 ms through point-to-point messages (gems.comm.ring) and 31 ms through MPI_Allreduce: each
message is a copy into the MPI's shared memory and one out of it. In memory both ranks map (an
MPI-3 shared window, ``MPI_Win_allocate_shared``) the same sum took 4-7 ms: member k of n adds
chunk k of every member's buffer, reading them where they lie, and writes the sum into each -- no
message, no copy in or out. So a host buffer that a group sums again and again (a gradient
bucket, ``Comm.bucket``; a sharded optimizer's parameters) is allocated here, and
``NodeBuffers.collective`` sums it when every member of the group is on this node -- or sums
only each member's run (a reduce-scatter), or gives each member's run to all (an allgather: the
sharded optimizer's parameters, each copied once, by the members that read it).

Every member passes a buffer of the same size, each at its own place in its own window segment:
the first step gathers those places -- and is the barrier after which every member's buffer holds
its addend --, the last a barrier after which every chunk's sum is in every buffer (and no member
still reads another's). Each chunk's sum is computed once, by its member (its own addend first,
then the others' in member order), and copied to the others: every member ends with the same bits.

Freeing a window is collective (``MPI_Win_free``) and the end of an engine is not, so windows
stay: a later request takes one whose buffers no rank of the node still holds (agreed in one
allgather), else allocates another. A node whose shared memory (/dev/shm) lacks the room gets plain
tensors, summed by the ring: a full tmpfs kills a process with SIGBUS when it first touches a page.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Sequence

import numpy as np
import torch
from mpi4py import MPI
from torch import Tensor

from gems.comm.ring import even_bounds

SHM = "/dev/shm"
ROOM = 0.5   # the most of the free shared memory a node's new window may take
PAGE = 4096
# A member adds its chunk this many bytes at a time, copying each piece's sum to the others while it is
# still in the cache: 45 MB of float32 between two ranks took 6.2-7.1 ms in pieces of 256 KiB, 8.3-8.6 ms
# whole (a second pass over memory).
CHUNK_BYTES = 256 << 10


class _Window:
    """One shared window of the node: this rank's segment of ``capacity`` bytes, and the array
    handed out as the current buffer (a weak reference: free once no tensor uses its memory)."""

    def __init__(self, node: Any, capacity: int) -> None:
        self.win = MPI.Win.Allocate_shared(capacity, 1, comm=node)
        self.win.Lock_all(MPI.MODE_NOCHECK)   # one passive epoch for the window's life: loads and stores
        self.capacity = capacity
        self.base = self._segment(node.Get_rank()).ctypes.data
        self.held: weakref.ref | None = None
        self._peers: dict[int, Tensor] = {}

    def _segment(self, node_rank: int, count: int = -1) -> np.ndarray:
        """The first ``count`` bytes (-1: all) of node rank ``node_rank``'s segment."""
        mem, _ = self.win.Shared_query(node_rank)
        return np.frombuffer(mem, dtype=np.uint8, count=count)

    def peer(self, node_rank: int) -> Tensor:
        if node_rank not in self._peers:
            self._peers[node_rank] = torch.from_numpy(self._segment(node_rank))
        return self._peers[node_rank]

    def free(self) -> bool:
        return self.held is None or self.held() is None

    def hand_out(self, numel: int, dtype: torch.dtype, node_rank: int) -> Tensor:
        """Zeros of ``numel`` x ``dtype`` at the start of this rank's segment. The tensor keeps the
        array it is made from alive, so the weak reference to that array says whether any tensor
        (a view of it included) still uses the memory."""
        array = self._segment(node_rank, numel * dtype.itemsize)
        self.held = weakref.ref(array)
        return torch.from_numpy(array).view(dtype).zero_()


class NodeBuffers:
    """The shared windows of this rank's node, over ``world`` (an MPI communicator)."""

    def __init__(self, world: Any) -> None:
        self._world = world
        self._node: Any = None          # the node's communicator, made at the first ``zeros``
        self._of: dict[int, int] = {}   # world rank -> node rank, for the ranks of this node
        self._windows: list[_Window] = []

    def zeros(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A zeroed 1-D host tensor in a window of the node, or a plain one where the node's shared
        memory lacks the room. COLLECTIVE: every rank of the world calls it, in one order."""
        if self._node is None:
            self._node = self._world.Split_type(MPI.COMM_TYPE_SHARED)
            self._of = {w: i for i, w in enumerate(self._node.allgather(self._world.Get_rank()))}
        nbytes = max(numel * dtype.itemsize, 1)
        usable = [i for i, w in enumerate(self._windows) if w.free() and w.capacity >= nbytes]
        told = self._node.allgather((usable, nbytes, _shared_room()))
        common = set.intersection(*(set(u) for u, _, _ in told))
        if common:
            window = self._windows[min(common)]
        elif sum(n for _, n, _ in told) <= ROOM * min(room for _, _, room in told):
            window = _Window(self._node, -(-nbytes // PAGE) * PAGE)   # segments apart by whole pages: no line shared
            self._windows.append(window)
        else:
            return torch.zeros(numel, dtype=dtype)
        return window.hand_out(numel, dtype, self._node.Get_rank())

    def collective(self, kind: str, tensor: Tensor, bounds: Sequence[int] | None, ranks: Sequence[int], me: int,
                   handle: Any) -> _NodeCollective | None:
        """``kind`` (``KINDS``) of ``tensor`` over the group of world ``ranks`` (this rank ``me`` among
        them, over the communicator ``handle``), member k's run ``bounds[k]:bounds[k + 1]`` (None:
        even runs), as a ``_NodeCollective``, where ``tensor`` lies in a window and every member is
        on this node; None otherwise (every member answers alike: a window's buffer is asked for by
        all ranks of the node, and membership is the node's)."""
        if tensor.is_cuda or not tensor.is_contiguous():
            return None
        start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for index, window in enumerate(self._windows):
            if window.base <= start and start + size <= window.base + window.capacity:
                if any(r not in self._of for r in ranks):
                    return None
                return _NodeCollective(kind, window, index, tensor, start - window.base,
                                       list(bounds) if bounds is not None else even_bounds(tensor.numel(), len(ranks)),
                                       [self._of[r] for r in ranks], me, handle)
        return None


# What a group does with its members' buffers in node memory, member k working on its run k:
# "allreduce": adds every member's run k and writes the sum into each; "reduce-scatter": adds them
# into its own only (the rest of its buffer is left as it was); "allgather": copies every other
# member's run of theirs into its own buffer.
KINDS = ("allreduce", "reduce-scatter", "allgather")


class _NodeCollective:
    """One ``KINDS`` operation on a window's buffers over a group (module docstring): ``start`` posts
    the gathering of the members' places, ``poll`` does this member's part once it is done, then
    waits for the last barrier."""

    def __init__(self, kind: str, window: _Window, index: int, tensor: Tensor, offset: int, bounds: list[int],
                 node_ranks: list[int], me: int, handle: Any) -> None:
        self.kind, self.bounds = kind, bounds
        self.window, self.tensor, self.node_ranks, self.me, self.handle = window, tensor, node_ranks, me, handle
        self.sent = np.array([index, offset, tensor.numel()], dtype=np.int64)   # which window, where, how many
        self.places = np.zeros((len(node_ranks), 3), dtype=np.int64)
        self.request: Any = None
        self.done = False

    def start(self) -> list[Any]:
        self.window.win.Sync()   # this member's buffer, written before, visible to the others
        self.request = self.handle.Iallgather(self.sent, self.places)
        return [self.request]

    def poll(self) -> bool:
        if not self.request.Test():
            return False
        if self.done:
            self.window.win.Sync()   # what the others wrote before their barrier, seen
            return True
        self.window.win.Sync()
        numel, dtype = self.tensor.numel(), self.tensor.dtype
        if any((int(w), int(n)) != (self.sent[0], numel) for w, _, n in self.places):
            raise RuntimeError(f"the members of node ranks {self.node_ranks} pass buffers of windows and sizes "
                               f"{sorted({(int(w), int(n)) for w, _, n in self.places})}: they disagree on the bucket")
        views = [self.window.peer(q)[int(at):int(at) + numel * dtype.itemsize].view(dtype)
                 for q, (_, at, _) in zip(self.node_ranks, self.places)]
        if self.kind == "allgather":
            for q, view in enumerate(views):
                if q != self.me:
                    views[self.me][self.bounds[q]:self.bounds[q + 1]].copy_(view[self.bounds[q]:self.bounds[q + 1]])
        else:
            self._add(views, self.kind == "allreduce")
        self.window.win.Sync()
        self.done = True
        self.request = self.handle.Ibarrier()
        return self.poll()

    def _add(self, views: list[Tensor], back: bool) -> None:
        """This member's run, the sum of every member's, in its own buffer (and with ``back`` in
        every other member's): each piece added, then copied out while it is still in the cache."""
        step = max(CHUNK_BYTES // views[0].element_size(), 1)
        for lo in range(self.bounds[self.me], self.bounds[self.me + 1], step):
            hi = min(lo + step, self.bounds[self.me + 1])
            total = views[self.me][lo:hi]
            for q, view in enumerate(views):
                if q != self.me:
                    total.add_(view[lo:hi])
            if back:
                for q, view in enumerate(views):
                    if q != self.me:
                        view[lo:hi].copy_(total)


def _shared_room() -> int:
    """Bytes free in the node's shared memory (0 where there is none to see)."""
    try:
        stat = os.statvfs(SHM)
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize
