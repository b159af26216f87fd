"""What every communication backend shares: requests, groups, the waiting loop, failure handling.

A backend (``mpi_backend.MPIComm``, ``torch_backend.TorchComm``) only starts operations and says
how to test one for completion. Everything that waits goes through :func:`poll_until`, so that

* no wait spins a core: MPI's blocking calls busy-poll, which on a node with more ranks than cores
  steals the cycles the computing ranks need (measured: 4.0 s blocking vs 1.84 s polling with
  back-off for a 4-rank chain on 2 cores). We test, sleep 50 us, test, sleep 100 us, ... up to 2 ms
  -- after polling for ``Backoff.spin`` seconds first where a wait is short and on the critical path
  (a tile group's: 2 ms, or 1 s where the rank has a core of its own, ``Comm.own_core``), every poll
  giving the core up to any process that wants it, and none once one took it (the node is busier
  than its ranks: a test run's other workers);
* no wait hangs forever: after ``timeout`` seconds the loop raises :class:`CommTimeout` naming this
  rank, the peer and the action, and :meth:`Comm.guard` turns that into an abort of the whole job.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, NoReturn, Sequence

import torch
from torch import Tensor

from gems.errors import USER_ERROR, GemsError
from .abort import ABORT_GRACE, failure_line

# A tuple of tensors travels as one message per tensor, tagged ``tag * TENSORS_PER_MESSAGE + index``,
# so a boundary holds at most this many tensors and the largest user tag is (TAG_UB - 15) // 16.
TENSORS_PER_MESSAGE = 16

# The most bytes one backend call moves: MPIs without MPI-4's large-count routines take C int counts.
# 1 MiB under 2**31, every piece but a tensor's last is whole MiB (page- and element-aligned) and
# clear of the int's edge, where MPIs adding a header overflow. GEMS_MAX_MESSAGE_BYTES overrides it.
MAX_MESSAGE_BYTES = 2**31 - 2**20


class CommTimeout(RuntimeError):
    """A wait lasted longer than the communicator's timeout: a peer died or hangs, or the ranks'
    schedules disagree about who sends what."""


@dataclass(frozen=True)
class Backoff:
    """Sleeps between completion tests: ``first`` seconds, doubling up to ``longest``.

    Short first sleeps keep the latency added to a message that is nearly done small; the cap
    bounds what a late one loses to ``longest``. MPI moves data mostly inside the tests, so the
    sleeps also slow large transfers (measured: a 64 MiB ping-pong 1.3-2x slower than blocking
    MPI). Where every rank has a core of its own, ``Backoff(0, 0)`` polls without sleeping."""

    first: float = 50e-6
    longest: float = 2e-3
    spin: float = 0.0   # seconds of polling without sleep first: for waits that are short when ranks keep pace
    # (a tile's halo: 64-float allreduces of 2 ranks took 2.5 ms each with the sleeps, 4 us polling)


_yield = getattr(os, "sched_yield", lambda: None)
# A yield that returns later than this ran another process: a waiting rank stops polling then (0.4 us
# a yield on an idle core here; a time slice given away is milliseconds).
CONTENDED = 1e-4


def usable_cores() -> set[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def seconds(t: float) -> str:
    """Elapsed time for messages: whole seconds, one decimal below ten."""
    return f"{t:.0f}" if t >= 10 else f"{t:.1f}"


def poll_until(done: Callable[[], bool], timeout: float, backoff: Backoff,
               describe: Callable[[float], str]) -> None:
    """Return once ``done()`` is true; raise ``CommTimeout(describe(elapsed))`` after ``timeout`` s.

    The one waiting loop of gems (see the module docstring for why it sleeps instead of blocking)."""
    start = time.monotonic()
    while not done():   # polling without sleep for the first backoff.spin seconds, the core given up
        now = time.monotonic()   # to any other process that wants it (sched_yield) ...
        if now - start >= backoff.spin:
            break
        _yield()
        if time.monotonic() - now > CONTENDED:   # ... and once one did, sleeping: the core is not ours alone
            break
    else:
        return
    delay = backoff.first
    while not done():
        elapsed = time.monotonic() - start
        if elapsed > timeout:
            raise CommTimeout(describe(elapsed))
        time.sleep(delay)
        delay = min(2 * delay, backoff.longest)


def max_tag(tag_ub: int) -> int:
    """The largest user tag whose every tensor slot fits under the backend's ``tag_ub``."""
    return (tag_ub - (TENSORS_PER_MESSAGE - 1)) // TENSORS_PER_MESSAGE


def message_tag(tag: int, index: int, tag_ub: int) -> int:
    """The wire tag of tensor ``index`` of a tuple sent with ``tag``; GemsError if it cannot exist."""
    if index >= TENSORS_PER_MESSAGE:
        raise GemsError(f"a message holds at most {TENSORS_PER_MESSAGE} tensors; pack the stage "
                        f"boundary into fewer tensors (got tensor #{index})")
    if not 0 <= tag <= max_tag(tag_ub):
        raise GemsError(f"message tag {tag} is outside 0..{max_tag(tag_ub)}, the range this "
                        f"backend allows (TAG_UB={tag_ub}); number messages with smaller tags")
    return tag * TENSORS_PER_MESSAGE + index


def max_message_bytes(default: int | None = MAX_MESSAGE_BYTES) -> int | None:
    """The byte size above which a tensor travels in pieces: GEMS_MAX_MESSAGE_BYTES when set, else
    ``default`` (None: no limit); GemsError unless the variable is a positive whole number."""
    value = os.environ.get("GEMS_MAX_MESSAGE_BYTES")
    if value is None:
        return default
    if not value.strip().isdecimal() or int(value) < 1:
        raise GemsError(f"GEMS_MAX_MESSAGE_BYTES must be a positive whole number of bytes, got {value!r}; "
                        f"set it to one (the default is {MAX_MESSAGE_BYTES}) or unset it")
    return int(value)


def byte_ranges(nbytes: int, limit: int | None) -> list[tuple[int, int]]:
    """The consecutive ``(start, stop)`` byte ranges, each at most ``limit`` long (None: no limit),
    in which a tensor of ``nbytes`` bytes travels: one message per range, always at least one, so
    an empty tensor is still one (empty) message that its receive matches."""
    if limit is None or nbytes <= limit:
        return [(0, nbytes)]
    return [(start, min(start + limit, nbytes)) for start in range(0, nbytes, limit)]


class P2POp(NamedTuple):
    """One point-to-point operation of a batch (``Comm.ibatch``): ``op`` "send" or "recv", the
    tensors sent or the buffers filled, the peer's world rank and the tag."""

    op: str
    tensors: tuple
    peer: int
    tag: int


class Request:
    """One pending isend/irecv/collective.

    Holds the backend's ``test`` function, the buffers the transfer reads or writes (so they stay
    alive until it completes), and ``finish``, run exactly once on completion (e.g. to copy a
    staging buffer into a non-contiguous destination). ``describe`` names the peer for errors."""

    def __init__(self, test: Callable[[], bool], describe: str, keep: Sequence[Any] = (),
                 finish: Callable[[], None] | None = None) -> None:
        self.describe = describe
        self.done = False
        self._test: Callable[[], bool] | None = test
        self._keep = tuple(keep)
        self._finish = finish

    def poll(self) -> bool:
        """Make progress; True once complete (then the destination buffers hold the data)."""
        if not self.done and self._test():
            if self._finish is not None:
                self._finish()
            self.done = True
            self._test, self._keep, self._finish = None, (), None
        return self.done

    def __repr__(self) -> str:
        return f"Request({self.describe}, {'done' if self.done else 'pending'})"


def all_of(requests: Sequence[Request], describe: str) -> Request:
    """One Request, complete once every one of ``requests`` is (each polled every time: progress)."""
    return Request(lambda: all([r.poll() for r in requests]), describe, requests)


@dataclass(frozen=True, eq=False)
class Group:
    """A sub-communicator: ``ranks`` in world numbering, in the order given to ``Comm.group``;
    ``rank`` is this rank's index in ``ranks``; ``handle`` is the backend's object."""

    ranks: list[int]
    rank: int
    handle: Any = field(repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)


def check_group_ranks(ranks: Sequence[int], world: int) -> list[int]:
    """``ranks`` as a list after checking they are distinct world ranks; GemsError otherwise."""
    ranks = [int(r) for r in ranks]
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < world for r in ranks):
        raise GemsError(f"a group needs distinct ranks in 0..{world - 1}, got {ranks}")
    return ranks


class Comm:
    """Point-to-point and collective communication among the ranks of one job.

    Create with :func:`gems.comm.create`. Attributes: ``rank``, ``size`` (world), ``local_rank``,
    ``local_size`` (ranks on this node), ``backend`` ("mpi" or "torch"), ``device``, and
    ``timeout`` (seconds any wait may last; assignable) and ``backoff`` (:class:`Backoff`).

    Tensor tuples are sent one message per tensor (see ``TENSORS_PER_MESSAGE``); the receiver
    preallocates buffers of the right shapes and dtypes, so no metadata travels.

    ``received`` counts, per tag, the bytes of every point-to-point receive this rank posts (the
    buffers' bytes: a backend's own headers and collectives are not counted), on every backend
    alike; cleared where a count begins (``Engine.step``: it holds the last step's)."""

    backend = "base"
    # whether a collective may run while point-to-point transfers are posted (False: NCCL)
    overlaps_collectives = True
    # whether this rank may poll through a wait without taking a core another rank needs (``own_core``);
    # False where ranks are threads of one process (the loopback: polling holds the GIL)
    polls_freely = False

    def __init__(self, rank: int, size: int, local_rank: int, local_size: int,
                 device: torch.device, timeout: float, backoff: Backoff) -> None:
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = local_rank, local_size
        self.device = device
        self.timeout = timeout
        self.backoff = backoff
        self.received: Counter[int] = Counter()

    @property
    def own_core(self) -> bool:
        """Whether this rank has a core of its own to wait on: the node's ranks are no more than the
        cores this process may run on (a launcher that pins ranks to fewer cores each, or more ranks
        than cores, says no). Waits on the critical path then poll instead of sleeping: a sleeping
        rank's core may go idle, and on a virtual machine waking it took milliseconds at times."""
        return self.polls_freely and self.local_size <= len(usable_cores())

    def count_received(self, buffers: Sequence[Tensor], tag: int) -> None:
        """Add a posted receive's bytes to ``received`` (every backend's receives call it)."""
        self.received[tag] += sum(t.numel() * t.element_size() for t in buffers)

    # -- what a backend provides -------------------------------------------------------------
    def isend(self, tensors: tuple[Tensor, ...], dst: int, tag: int) -> Request:
        """Start sending ``tensors`` to world rank ``dst``; they must not change until complete."""
        raise NotImplementedError

    def irecv(self, buffers: tuple[Tensor, ...], src: int, tag: int) -> Request:
        """Start receiving from world rank ``src`` into ``buffers`` (filled in place)."""
        raise NotImplementedError

    def ibatch(self, ops: Sequence[P2POp]) -> list[Request]:
        """Start ``ops`` as one group, one Request each. A transport whose point-to-point runs in
        posting order per pair (NCCL) starts a group's operations toward one peer together, as
        ``batch_isend_irecv`` does; here, where messages are matched by tag, each is simply posted
        in order."""
        return [self.isend(op.tensors, op.peer, op.tag) if op.op == "send" else self.irecv(op.tensors, op.peer, op.tag)
                for op in ops]

    def group(self, ranks: list[int]) -> Group | None:
        """Sub-communicator of world ``ranks`` (their order sets ``Group.rank``); None on ranks
        outside it. COLLECTIVE: every rank makes the same sequence of ``group`` calls with the
        same lists (torch.distributed requires it)."""
        raise NotImplementedError

    def abort(self, code: int = 1) -> NoReturn:
        """End every rank of the job now with exit code ``code``."""
        raise NotImplementedError

    def iallreduce(self, tensor: Tensor, group: Group | None) -> Request:
        """Start an in-place SUM of ``tensor`` over ``group`` (None: the world); finish it with
        ``wait``/``test`` (e.g. to overlap a gradient allreduce with backward). On the torch
        backend, gloo's and NCCL's own timeout (the same seconds) counts from this call."""
        raise NotImplementedError

    def ibroadcast(self, tensor: Tensor, root: int, group: Group | None) -> Request:
        """Start copying ``tensor`` of world rank ``root`` into ``tensor`` of the other ranks."""
        raise NotImplementedError

    def iallgather_bytes(self, data: Tensor, group: Group | None) -> tuple[Request, Tensor]:
        """Start gathering the equal-sized uint8 ``data`` of every rank into rows of the result."""
        raise NotImplementedError

    def iallgather_runs(self, flat: Tensor, bounds: Sequence[int], group: Group) -> Request:
        """Start giving member k's run ``flat[bounds[k]:bounds[k + 1]]`` (runs may be empty) to every
        member of ``group``, in place. Here one broadcast per run; a backend may do better."""
        runs = [self.ibroadcast(flat[lo:hi], group.ranks[k], group)
                for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])) if hi > lo]
        return all_of(runs, f"allgather over ranks {group.ranks}")

    def ireduce_scatter_runs(self, flat: Tensor, bounds: Sequence[int], group: Group) -> Request:
        """Start summing ``flat`` over ``group`` where only member k's run ``flat[bounds[k]:bounds[k + 1]]``
        must come out summed on member k; the rest of ``flat`` is left undefined. Here a whole
        allreduce (every run summed everywhere); a backend may move half as much."""
        return self.iallreduce(flat, group)

    def ibarrier(self) -> Request:
        """Start a barrier over the world."""
        raise NotImplementedError

    def bucket(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A zeroed 1-D tensor for a buffer that groups sum again and again (a gradient bucket),
        where this backend's ``iallreduce`` sums it fastest; here a plain one. COLLECTIVE: every
        rank asks for its buckets at the same points, in one order."""
        return torch.zeros(numel, dtype=dtype, device=device)

    # -- shared behaviour --------------------------------------------------------------------
    def wait(self, req: Request, what: str, backoff: Backoff | None = None) -> None:
        """Return when ``req`` completes (sleeping as ``backoff`` says, default the communicator's);
        CommTimeout naming ``what`` and the peer after ``timeout``."""
        poll_until(req.poll, self.timeout, backoff or self.backoff, lambda t: self.timed_out(what, req, t))

    def timed_out(self, what: str, req: Request, elapsed: float) -> str:
        """What a wait for ``what`` that gave up after ``elapsed`` seconds says."""
        return (f"rank {self.rank} waited {seconds(elapsed)}s for {what} ({req.describe}); that rank failed or "
                f"hangs, or the ranks disagree on the schedule (the timeout is {self.timeout:g}s)")

    def test(self, req: Request) -> bool:
        """Make progress on ``req`` without blocking; True once it has completed."""
        return req.poll()

    def allreduce(self, tensor: Tensor, group: Group | None, what: str, backoff: Backoff | None = None) -> None:
        """Sum ``tensor`` in place over ``group`` (None: the world), waiting through the polling loop."""
        self.wait(self.iallreduce(tensor, group), what, backoff)

    def broadcast(self, tensor: Tensor, root: int, group: Group | None = None) -> None:
        """Overwrite ``tensor`` with world rank ``root``'s copy, on every rank of ``group``."""
        self.wait(self.ibroadcast(tensor, root, group), f"broadcast from rank {root}")

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        self.wait(self.ibarrier(), "barrier")

    def allgather_object(self, obj: Any, group: Group | None = None) -> list[Any]:
        """Every rank's picklable ``obj``, in group-rank order; meant for small objects (each rank
        receives max(object size) x group size bytes)."""
        me = group.rank if group is not None else self.rank
        members = group.size if group is not None else self.size
        payload = pickle.dumps(obj)
        sizes = torch.zeros(members, dtype=torch.int64)
        sizes[me] = len(payload)
        self.allreduce(sizes, group, "allgather_object (sizes)")
        data = torch.zeros(int(sizes.max()), dtype=torch.uint8)
        data[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        req, rows = self.iallgather_bytes(data, group)
        self.wait(req, "allgather_object")
        return [pickle.loads(rows[i, :n].numpy().tobytes()) for i, n in enumerate(sizes.tolist())]

    def check_same_group(self, ranks: list[int]) -> None:
        """COLLECTIVE: GemsError on every rank unless all ranks passed the same ``ranks`` to
        ``group`` (a mismatch would otherwise hang in the backend's group creation)."""
        for other_rank, other in enumerate(self.allgather_object(ranks)):
            if other != ranks:
                raise GemsError(f"every rank must call group() with the same ranks in the same order; "
                                f"rank {self.rank} passed {ranks}, rank {other_rank} passed {other}")

    @contextlib.contextmanager
    def guard(self) -> Iterator[Comm]:
        """Abort the whole job if the body raises on this rank.

        Prints one line ``gems: rank R failed: Type: message`` to stderr (the traceback before it
        only when GEMS_DEBUG=1) and ends every rank with exit code 1 (2 for a GemsError: bad input
        found while running), so one failing rank never leaves the others waiting for it.
        ``SystemExit(0)`` passes through; ``SystemExit(n)`` aborts with code n."""
        try:
            yield self
        except SystemExit as exc:
            if exc.code in (None, 0):
                raise
            self.fail(exc, exc.code if isinstance(exc.code, int) else 1)
        except GemsError as exc:
            self.fail(exc, USER_ERROR)
        except BaseException as exc:  # noqa: BLE001 -- any failure must end the job, not hang it
            self.fail(exc, 1)

    def fail(self, exc: BaseException, code: int = 1) -> NoReturn:
        """End the job on every rank because of ``exc`` on this one: print ``failure_line`` once
        (the traceback before it only when GEMS_DEBUG=1), then ``abort(code)``. For failures the
        peers cannot recover from, such as an exception in the middle of a pipeline step."""
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        if os.environ.get("GEMS_DEBUG") == "1":
            traceback.print_exception(exc, file=sys.stderr)
        print(failure_line(self.rank, exc), file=sys.stderr, flush=True)
        # The launcher forwards our stderr through a pipe; MPI_Abort tears the job down at
        # once, and on a loaded node it can do so before the line was forwarded. A moment's
        # grace costs nothing next to a failed job and keeps the one line users need.
        time.sleep(ABORT_GRACE)
        self.abort(code)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, size={self.size}, "
                f"local={self.local_rank}/{self.local_size}, device={self.device})")
