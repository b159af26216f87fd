"""The default backend: mpi4py operating directly on the tensors' memory.

CPU tensors are handed to MPI as byte views of their storage: no copy, and every dtype works,
bfloat16 included. Copies happen only where they must: a non-contiguous tensor goes through a
contiguous staging tensor; a reduction over a dtype MPI cannot add (bfloat16, float8) runs in
float32 and is rounded back; a CUDA tensor is staged through pinned host memory unless the MPI is
CUDA-aware (``MPI.Query_cuda_support()`` or GEMS_CUDA_AWARE_MPI=1), in which case MPI gets the
device tensor itself through ``__cuda_array_interface__``. This module decides which a tensor
needs; gems.comm.staging holds the parts: what the MPI can take, the views MPI is given, the
side-stream copies and the pool of pinned buffers.

MPI knows nothing of CUDA streams, so no operation is started before the GPU work it depends on
is done, and the host never waits for the whole compute stream to find out::

    compute stream  ──[kernels making t]──●produced──────────────────────────────────────▶
    side stream                           └─wait──[t → pinned host]──●ready
    host (polling)                                                    └─ready? Isend pieces…

A receive is the mirror image: MPI fills a pinned buffer, a host-to-device copy on the side
stream fills the tensor, and the consumer's stream waits on that copy's event. Operations enter
MPI in the order gems posted them (one queue), so a send that waits for its copy is never
overtaken by a later one with the same tag, and every rank starts its collectives in one order.
A send or receive of contiguous host tensors posted while nothing is queued goes to MPI at once,
without the queue's bookkeeping (``_at_once``): the tiles' halos, tens of them a step.

A tensor larger than ``message_limit`` bytes travels as consecutive pieces of at most that size
(MPIs without MPI-4 large-count routines take C int counts); with large-count support there is
no limit unless GEMS_MAX_MESSAGE_BYTES sets one.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, NoReturn, Sequence

import torch
from mpi4py import MPI
from torch import Tensor

from gems.comm.abort import mpi_abort
from gems.comm.base import (MAX_MESSAGE_BYTES, Backoff, Comm, Group, Request, byte_ranges, check_group_ranks,
                            max_message_bytes, message_tag)
from gems.comm.placement import placement
from gems.comm.ring import Ring, Scratch, even_bounds
from gems.comm.shared import NodeBuffers
from gems.comm.staging import StagingPool, Wire, as_bytes, as_typed, copy_on, cuda_aware, large_count, mpi_can_sum
from gems.errors import GemsError

# Host buffers of a group from this size on are summed and gathered by gems.comm.ring (measured there);
# below it MPI's own collectives, whose fewer steps win where latency dominates.
RING_BYTES = 2**20


class _Pending:
    """An operation in the queue: ``start`` gives its MPI requests once every wire is ready."""

    def __init__(self, wires: Sequence[Wire], start: Callable[[], list[Any]]) -> None:
        self.wires, self.start = wires, start
        self.reqs: list[Any] | None = None

    def ready(self) -> bool:
        return all(w.ready is None or w.ready.query() for w in self.wires)


class MPIComm(Comm):
    """Communicator on a duplicate of MPI_COMM_WORLD (so no other MPI user's message can match ours).

    ``message_limit``: the byte size above which a tensor travels in pieces (None: no limit);
    ``staging``: the :class:`StagingPool` of pinned host buffers for GPU tensors."""

    backend = "mpi"
    polls_freely = True

    def __init__(self, device: torch.device, timeout: float, backoff: Backoff,
                 allow_shared_gpu: bool = False) -> None:
        world = MPI.COMM_WORLD
        super().__init__(*placement(world, device, allow_shared_gpu), timeout, backoff)
        self.message_limit = max_message_bytes(None if large_count() else MAX_MESSAGE_BYTES)
        self.staging = StagingPool()
        self._comm = world.Dup()
        self._tag_ub: int = world.Get_attr(MPI.TAG_UB)
        self._cuda_aware = cuda_aware()
        self._groups_made = 0
        self._queue: deque[_Pending] = deque()
        self._side: dict[torch.device, Any] = {}
        self._ring_ops: dict[int, int] = {}   # id(group) -> rings started on it: their tags
        self._scratch = Scratch()
        self._node = NodeBuffers(self._comm)

    # -- staging ---------------------------------------------------------------------------------
    def _wire(self, t: Tensor, load: bool, store: bool, reduce: bool = False) -> Wire:
        """How ``t`` meets MPI. ``load``: the operation reads ``t``, so a staging copy starts with
        its data; ``store``: the operation writes ``t``, so a staging copy is copied back."""
        t = t.detach()
        data = t
        if reduce and not mpi_can_sum(t.dtype):
            data = t.to(torch.complex64 if t.is_complex() else torch.float32, memory_format=torch.contiguous_format)
        if data.is_cuda and not self._cuda_aware:
            return self._host_staged(t, data, load, store)
        if not data.is_contiguous():
            staged = torch.empty(data.shape, dtype=data.dtype, device=data.device)
            data = staged.copy_(data) if load else staged
        ready = None
        if data.is_cuda:  # CUDA-aware MPI touches the memory once the GPU work before it is done
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(data.device))
        return Wire(data, ready, (lambda: t.copy_(data)) if store and data is not t else None)

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device)
        return self._side[device]

    def _host_staged(self, t: Tensor, data: Tensor, load: bool, store: bool) -> Wire:
        """Stage the device tensor ``data`` (``t`` or its float32 copy) through a pinned buffer.

        Copies run on a side stream that first waits for an event on the current stream (the work
        that made ``t``, or still reads it before a receive overwrites it), so they overlap later
        compute; nothing synchronizes a whole stream."""
        device = data.device
        raw = self.staging.take(data.numel() * data.element_size())
        host = raw.view(data.dtype).view(data.shape)
        side = self._side_stream(device)
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(device))
        side.wait_event(produced)
        # record_stream: the allocator must not reuse the device tensor before the side copy is done
        ready = copy_on(side, host, data) if load else None

        def done() -> None:
            copied = copy_on(side, t, host) if store else None
            if copied is not None:
                torch.cuda.current_stream(device).wait_event(copied)  # the consumer, not the host, waits
            self.staging.give(raw, copied)
        return Wire(host, ready, done)

    def _pieces(self, data: Tensor) -> list[Any]:
        """MPI buffers for consecutive byte ranges of ``data``, each at most ``message_limit``."""
        ranges, whole = byte_ranges(data.numel() * data.element_size(), self.message_limit), as_bytes(data)
        if len(ranges) == 1:
            return [whole]
        flat = whole.reshape(-1)
        return [flat[a:b] for a, b in ranges]

    def _at_once(self, tensors: Sequence[Tensor]) -> bool:
        """Whether an operation on ``tensors`` goes to MPI as it is, now, without the queue: nothing
        is queued before it (posting order), and each tensor is contiguous host memory that travels
        in one message. Tile halos, host pipelines and small host sums are posted this way, tens of
        times a step: ~10 us a send or receive against ~50 through the queue's wires and closures."""
        limit = self.message_limit
        return not self._queue and all(not t.is_cuda and t.is_contiguous() and (limit is None or t.nbytes <= limit)
                                       for t in tensors)

    def _tested(self, reqs: list[Any]) -> Callable[[], bool]:
        """The test of MPI requests posted at once (``_at_once``): whether all are complete, moving
        on any operation queued after them while they are waited for."""
        def test() -> bool:
            if self._queue:
                self._progress()
            return MPI.Request.Testall(reqs)
        return test

    # -- the queue -------------------------------------------------------------------------------
    def _progress(self) -> None:
        """Start queued operations, in posting order, while the one at the head is ready."""
        while self._queue and self._queue[0].ready():
            op = self._queue.popleft()
            op.reqs = op.start()

    def _post(self, wires: Sequence[Wire], start: Callable[[], list[Any]], describe: str,
              check: Callable[[list[Any]], None] | None = None, advance: Callable[[], bool] | None = None,
              release: Callable[[], Any] | None = None) -> Request:
        """Queue an operation and return its Request. ``check``, for receives, inspects the
        statuses on completion; an MPI error of a receive becomes a RuntimeError naming it.
        ``advance``: tests (and moves on) an operation of several steps once started, instead
        of its first requests; ``release``: run on completion, after the wires' copies."""
        op = _Pending(wires, start)
        self._queue.append(op)
        self._progress()
        statuses: list[Any] = []

        def test() -> bool:
            self._progress()
            if op.reqs is None:
                return False
            if advance is not None:
                return advance()
            if check is None:
                return MPI.Request.Testall(op.reqs)
            statuses[:] = statuses or [MPI.Status() for _ in op.reqs]
            if not self._received(op.reqs, statuses, describe):
                return False
            check(statuses)
            return True

        dones = [w.done for w in wires if w.done is not None] + ([release] if release is not None else [])
        return Request(test, describe, wires, (lambda: [d() for d in dones]) if dones else None)

    def _received(self, reqs: list[Any], statuses: list[Any], describe: str) -> bool:
        """Whether the receives ``reqs`` are complete (their ``statuses`` filled); an MPI error of
        one becomes a RuntimeError naming ``describe`` and the likely cause."""
        try:
            return MPI.Request.Testall(reqs, statuses)
        except MPI.Exception as exc:  # a message longer than its buffer, or a peer gone
            codes = [s.Get_error() for s in statuses if s.Get_error() != MPI.SUCCESS] or [exc.Get_error_code()]
            why = ("the ranks disagree on the boundary shapes or dtypes"
                   if MPI.Get_error_class(codes[0]) == MPI.ERR_TRUNCATE else "the sending rank may have died")
            raise RuntimeError(f"rank {self.rank}: {describe} failed: "
                               f"{' '.join(MPI.Get_error_string(codes[0]).split())}; {why}") from exc

    def _check_counts(self, statuses: list[Any], index: list[int], sizes: list[int], describe: str) -> None:
        """RuntimeError unless the received pieces (``statuses``; ``index``: the tensor of each) brought
        each tensor its ``sizes`` bytes: a shorter message leaves a buffer partly unwritten."""
        got = [0] * len(sizes)
        for i, status in zip(index, statuses):
            got[i] += status.Get_count(MPI.BYTE)
        for i, (n, size) in enumerate(zip(got, sizes)):
            if n != size:
                raise RuntimeError(f"rank {self.rank}: {describe}: tensor {i} brought {n} bytes for a "
                                   f"{size}-byte buffer; the ranks disagree on the boundary shapes or dtypes")

    def _mpi(self, group: Group | None) -> Any:
        return self._comm if group is None else group.handle

    def _members(self, group: Group | None) -> str:
        return f"all {self.size} ranks" if group is None else f"ranks {group.ranks}"

    # -- operations ------------------------------------------------------------------------------
    # Pieces of one tensor share its wire tag (message_tag keeps the tensors of all messages
    # apart): MPI's non-overtaking rule matches messages with one tag between one pair in the
    # order they were sent, and the queue posts both sides' pieces in order, so piece k always
    # lands in the k-th slice of the receive buffer.
    def isend(self, tensors: tuple[Tensor, ...], dst: int, tag: int) -> Request:
        tags = [message_tag(tag, i, self._tag_ub) for i in range(len(tensors))]
        describe = f"send to rank {dst}, tag {tag}"
        if self._at_once(tensors):
            reqs = [self._comm.Isend([as_bytes(t), MPI.BYTE], dst, wire_tag) for t, wire_tag in zip(tensors, tags)]
            return Request(self._tested(reqs), describe, tensors)
        wires = [self._wire(t, load=True, store=False) for t in tensors]
        return self._post(wires, lambda: [self._comm.Isend([piece, MPI.BYTE], dst, wire_tag)
                                          for w, wire_tag in zip(wires, tags) for piece in self._pieces(w.data)],
                          describe)

    def irecv(self, buffers: tuple[Tensor, ...], src: int, tag: int) -> Request:
        tags = [message_tag(tag, i, self._tag_ub) for i in range(len(buffers))]
        self.count_received(buffers, tag)
        describe = f"recv from rank {src}, tag {tag}"
        sizes = [t.numel() * t.element_size() for t in buffers]
        if self._at_once(buffers):
            reqs = [self._comm.Irecv([as_bytes(t), MPI.BYTE], src, wire_tag) for t, wire_tag in zip(buffers, tags)]
            statuses, index = [MPI.Status() for _ in reqs], list(range(len(reqs)))

            def received() -> bool:
                if self._queue:
                    self._progress()
                if not self._received(reqs, statuses, describe):
                    return False
                self._check_counts(statuses, index, sizes, describe)
                return True
            return Request(received, describe, buffers)
        wires = [self._wire(t, load=False, store=True) for t in buffers]
        pieces = [i for i, size in enumerate(sizes) for _ in byte_ranges(size, self.message_limit)]  # their tensors

        def start() -> list[Any]:
            return [self._comm.Irecv([piece, MPI.BYTE], src, wire_tag)
                    for w, wire_tag in zip(wires, tags) for piece in self._pieces(w.data)]

        return self._post(wires, start, describe, lambda statuses: self._check_counts(statuses, pieces, sizes, describe))

    def group(self, ranks: list[int]) -> Group | None:
        ranks = check_group_ranks(ranks, self.size)
        # Also waits, with the timeout, until every rank makes this call: Create_group itself
        # blocks, spinning, with no timeout, if a member never arrives. That wait also starts
        # every queued collective, so all ranks reach Create_group in the same order.
        self.check_same_group(ranks)
        self._groups_made += 1  # tags this creation apart from groups being made concurrently
        if self.rank not in ranks:
            return None
        members = self._comm.Get_group().Incl(ranks)
        handle = self._comm.Create_group(members, tag=self._groups_made)
        members.Free()
        return Group(ranks, ranks.index(self.rank), handle)

    def bucket(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """On the host, in memory the ranks of the node share (gems.comm.shared): a group within the
        node sums it where it lies."""
        if device.type != "cpu":
            return super().bucket(numel, dtype, device)
        return self._node.zeros(numel, dtype)

    def iallreduce(self, tensor: Tensor, group: Group | None) -> Request:
        summable = mpi_can_sum(tensor.dtype)
        if (group.size if group is not None else self.size) > 1 and summable:
            summed = self._in_node_memory("allreduce", tensor, None, group)
            if summed is not None:
                return summed
        describe = f"allreduce over {self._members(group)}"
        if summable and self._at_once((tensor,)) and not self._rings(tensor, group):
            # a small host sum (a tile group's statistics, tens of times a step) straight to MPI, as
            # ``isend`` posts its own: a 2-rank sum of 128 doubles, posted and waited for, took 63 us
            # through the queue's wires and closures, 49 so (mpi4py's own call and tests: 7-15)
            req = self._mpi(group).Iallreduce(MPI.IN_PLACE, as_typed(tensor.detach()), MPI.SUM)
            return Request(self._tested([req]), describe, (tensor,))
        wire = self._wire(tensor, load=True, store=True, reduce=True)
        if wire.ready is None and self._rings(wire.data, group):
            return self._ring(wire, group, even_bounds(wire.data.numel(), group.size), True, describe)
        return self._post([wire], lambda: [self._mpi(group).Iallreduce(MPI.IN_PLACE, as_typed(wire.data), MPI.SUM)],
                          describe)

    def ibroadcast(self, tensor: Tensor, root: int, group: Group | None) -> Request:
        ranks = group.ranks if group is not None else range(self.size)
        if root not in ranks:
            raise GemsError(f"broadcast root {root} is not in the group {list(ranks)}")
        is_root = root == self.rank
        wire = self._wire(tensor, load=is_root, store=not is_root)
        index = list(ranks).index(root)
        return self._post([wire], lambda: [self._mpi(group).Ibcast([piece, MPI.BYTE], root=index)
                                           for piece in self._pieces(wire.data)],
                          f"broadcast from rank {root} to {self._members(group)}")

    def iallgather_runs(self, flat: Tensor, bounds: Sequence[int], group: Group) -> Request:
        done = self._in_node_memory("allgather", flat, bounds, group) if group.size > 1 else None
        if done is not None:
            return done
        if not self._rings(flat, group):
            return super().iallgather_runs(flat, bounds, group)
        return self._ring(Wire(flat), group, bounds, False, f"allgather over {self._members(group)}")

    def ireduce_scatter_runs(self, flat: Tensor, bounds: Sequence[int], group: Group) -> Request:
        done = (self._in_node_memory("reduce-scatter", flat, bounds, group)
                if group.size > 1 and mpi_can_sum(flat.dtype) else None)
        if done is not None:
            return done
        if not (mpi_can_sum(flat.dtype) and self._rings(flat, group)):
            return super().ireduce_scatter_runs(flat, bounds, group)
        return self._ring(Wire(flat), group, bounds, True, f"reduce-scatter over {self._members(group)}", False)

    def _in_node_memory(self, kind: str, tensor: Tensor, bounds: Sequence[int] | None,
                        group: Group | None) -> Request | None:
        """``kind`` (gems.comm.shared.KINDS) of ``tensor`` over ``group`` in the node's shared memory, where
        ``tensor`` lies there and the group is on this node; None otherwise (every member answers alike)."""
        ranks, me = (group.ranks, group.rank) if group is not None else (range(self.size), self.rank)
        op = self._node.collective(kind, tensor, bounds, ranks, me, self._mpi(group))
        if op is None:
            return None
        return self._post([], op.start, f"{kind} over {self._members(group)} in node memory", advance=op.poll)

    def _rings(self, data: Tensor, group: Group | None) -> bool:
        """Whether ``data`` goes through gems.comm.ring: a group's contiguous host tensor of RING_BYTES
        or more (the same answer on every member: they pass the same sizes, on the same kind of device)."""
        return (group is not None and group.size > 1 and not data.is_cuda and data.is_contiguous()
                and data.numel() * data.element_size() >= RING_BYTES)

    def _ring(self, wire: Wire, group: Group, bounds: Sequence[int], reduce: bool, describe: str,
              gather: bool = True) -> Request:
        """Queue a ring operation on ``wire`` over ``group`` (point-to-point on the group's own
        communicator, one tag per ring: every member starts them in one order)."""
        n, me, handle = group.size, group.rank, group.handle
        tag = self._ring_ops.get(id(group), 0)
        self._ring_ops[id(group)] = (tag + 1) % (self._tag_ub + 1)
        flat = wire.data.reshape(-1)
        scratch = self._scratch.take(max(b - a for a, b in zip(bounds, bounds[1:])), flat.dtype) if reduce else None

        def exchange(send: Tensor, into: Tensor) -> list[Any]:
            return ([handle.Isend([piece, MPI.BYTE], (me + 1) % n, tag) for piece in self._pieces(send)]
                    + [handle.Irecv([piece, MPI.BYTE], (me - 1) % n, tag) for piece in self._pieces(into)])

        ring = Ring(flat, bounds, me, exchange, MPI.Request.Testall, reduce, scratch, gather)
        return self._post([wire], lambda: ring.start() or [], describe, advance=ring.poll,
                          release=(lambda: self._scratch.give(scratch)) if scratch is not None else None)

    def iallgather_bytes(self, data: Tensor, group: Group | None) -> tuple[Request, Tensor]:
        members = group.size if group is not None else self.size
        rows = torch.empty(members, data.numel(), dtype=torch.uint8)
        send, recv = data.contiguous().numpy(), rows.numpy()
        return self._post([], lambda: [self._mpi(group).Iallgather([send, MPI.BYTE], [recv, MPI.BYTE])],
                          f"allgather over {self._members(group)}"), rows

    def ibarrier(self) -> Request:
        return self._post([], lambda: [self._comm.Ibarrier()], f"barrier over all {self.size} ranks")

    def abort(self, code: int = 1) -> NoReturn:
        mpi_abort(code)
