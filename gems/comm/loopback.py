"""An in-process communicator for tests: ``world`` ranks as threads of one process, no mpiexec.

    results = run(3, fn, semantics="nccl")  # thread r runs fn(LoopbackComm of rank r); [fn's results]

Multi-rank pipeline schedules run in seconds; torch ops release the GIL, so ranks compute in
parallel. If a rank raises, every other rank's wait raises too, and ``run`` re-raises the first
failure itself (with a note naming its rank). Point-to-point has two semantics:

* ``"mpi"``: tagged messages, matched by (source, destination, tag) in posting order (MPI's
  non-overtaking rule). A send copies its tensors and completes at once, like an eager send.
* ``"nccl"``: un-batched NCCL. Tags are ignored; the n-th send from A to B meets the n-th receive
  B posts from A. A's operations toward B, sends and receives alike, form one queue in A's posting
  order, of which only the head is available; a send and its receive complete together, once both
  are at the heads of their queues. So two ranks that each post [recv, send] toward the other
  deadlock. ``ibatch`` makes all its ops toward one peer one queue entry, available together, as
  an NCCL group (batch_isend_irecv) does.

Deadlock detection. All matching state is under one world lock and matching is eager: each post
(and, for nccl, each completion it causes) matches all it can before the lock is released, so a
request becomes ready only while some rank posts. Once every rank that has not returned is blocked
in ``wait`` on a request that is not ready, no rank can post again and no request can ever become
ready: the deadlock is certain (requests made elsewhere count as possibly progressing). The
condition is checked whenever a rank starts a wait or returns from ``fn``, the only events that can
make it true (readiness never reverts); every waiting rank then raises :class:`Deadlock` listing
what each rank waits for.
"""
from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict, deque
from types import SimpleNamespace
from typing import Any, Callable, NoReturn, Sequence

import torch
from torch import Tensor

from gems.comm.base import Backoff, Comm, CommTimeout, Group, P2POp, Request, check_group_ranks, message_tag
from gems.errors import GemsError

__all__ = ["run", "LoopbackComm", "Deadlock", "PeerFailed", "Aborted", "P2POp"]

TAG_UB = 2**29 - 1  # MPICH's, the smallest of the real backends: tags that pass here pass there
SEMANTICS = ("mpi", "nccl")


class Deadlock(CommTimeout):
    """Every live rank waits on a request that can never complete."""


class PeerFailed(RuntimeError):
    """Another rank of the loopback world failed, so this wait can never be trusted to complete."""


class Aborted(RuntimeError):
    """``LoopbackComm.abort``: this rank ended the world (the process keeps running)."""


class _State:
    """What a request waits for: ``error`` (set first) and ``done`` are written under the world lock."""

    def __init__(self) -> None:
        self.done, self.error = False, None

    def check(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.done

    def finish(self, error: BaseException | None = None) -> None:
        self.error, self.done = error, True


class _P2P(_State):
    """A send or receive of ``rank`` with ``peer``; ``seq`` numbers the same kind of op per pair (nccl)."""

    def __init__(self, kind: str, rank: int, peer: int, tensors: tuple, tag: int) -> None:
        super().__init__()
        self.kind, self.rank, self.peer, self.tensors, self.tag, self.seq = kind, rank, peer, tensors, tag, 0


class _Req(Request):
    def __init__(self, state: _State, describe: str, finish: Callable[[], None] | None = None) -> None:
        super().__init__(state.check, describe, (), finish)
        self.state = state


def _shapes(tensors: Sequence[Tensor]) -> str:
    return "[" + ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors) + "]"


def _deliver(send: tuple, send_tag: int, src: int, recv: _P2P) -> GemsError | None:
    """Copy ``send`` into ``recv``'s buffers; the error instead if they disagree in shape or dtype."""
    if len(send) != len(recv.tensors) or any(s.shape != r.shape or s.dtype != r.dtype
                                             for s, r in zip(send, recv.tensors)):
        return GemsError(f"rank {src} sent {_shapes(send)} (tag {send_tag}) but rank {recv.rank} "
                         f"receives {_shapes(recv.tensors)} (tag {recv.tag}); the ranks disagree on "
                         f"the boundary shapes or dtypes")
    for s, r in zip(send, recv.tensors):
        r.detach().copy_(s)
    return None


class _World:
    """The state the ranks share, written under ``lock`` (``failure``, ``deadlock`` read without)."""

    def __init__(self, size: int, semantics: str) -> None:
        if semantics not in SEMANTICS:
            raise GemsError(f"unknown loopback semantics {semantics!r}; use one of {', '.join(SEMANTICS)}")
        if size < 1:
            raise GemsError(f"a loopback world needs at least one rank, got {size}")
        self.size, self.semantics = size, semantics
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)   # notified after all that may end a wait (``touch``)
        self.version = 0   # how many times ``changed`` was notified: a wait compares it before sleeping
        self.live = set(range(size))
        self.blocked: dict[int, tuple[str, Request]] = {}
        self.failure: tuple[int, BaseException] | None = None
        self.deadlock: str | None = None
        self.unexpected: dict[tuple, deque] = defaultdict(deque)  # mpi: (src, dst, tag) -> messages
        self.posted: dict[tuple, deque] = defaultdict(deque)      # mpi: (src, dst, tag) -> receives
        self.queues: dict[tuple, deque] = defaultdict(deque)      # nccl: (rank, peer) -> units of ops
        self.counts: dict[tuple, int] = defaultdict(int)          # nccl: (kind, rank, peer) -> ops so far
        self.colls: dict[tuple, SimpleNamespace] = {}  # (group handle, call number) -> contributions

    def touch(self) -> None:
        """Wake every waiting rank to look at its request again (under ``lock``)."""
        self.version += 1
        self.changed.notify_all()

    def fail(self, rank: int, exc: BaseException) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = (rank, exc)
            self.touch()

    def leave(self, rank: int) -> None:
        with self.lock:
            self.live.discard(rank)
            self.check_deadlock()

    def check_deadlock(self) -> None:
        if self.deadlock or self.failure or not self.live or not self.live <= self.blocked.keys():
            return
        waits = [(r, *self.blocked[r]) for r in sorted(self.live)]
        if any(not isinstance(req, _Req) or req.state.done for _, _, req in waits):
            return
        gone = sorted(set(range(self.size)) - self.live)
        self.deadlock = ("deadlock: every live rank waits and nothing can progress: "
                         + "; ".join(f"rank {r} waits for {what} ({req.describe})" for r, what, req in waits)
                         + (f"; ranks {gone} have returned" if gone else ""))
        self.touch()

    # -- nccl matching -------------------------------------------------------------------------
    def post_unit(self, ops: list[_P2P]) -> None:
        for op in ops:
            op.seq = self.counts[op.kind, op.rank, op.peer]
            self.counts[op.kind, op.rank, op.peer] += 1
        for peer in dict.fromkeys(op.peer for op in ops):
            self.queues[ops[0].rank, peer].append([op for op in ops if op.peer == peer])
        self.progress()

    def progress(self) -> None:
        moved = True
        while moved:
            moved = False
            for (a, b), queue in list(self.queues.items()):
                for send in queue[0] if queue else ():
                    other = self.queues.get((b, a))
                    if send.kind != "send" or send.done or not other:
                        continue
                    for recv in other[0]:
                        if recv.kind == "recv" and not recv.done and recv.seq == send.seq:
                            error = _deliver(send.tensors, send.tag, a, recv)
                            recv.finish(error)
                            send.finish(None if error is None else GemsError(str(error)))
                            moved = True
                            break
                while queue and all(op.done for op in queue[0]):
                    queue.popleft()
                    moved = True


class LoopbackComm(Comm):
    """Rank ``rank`` of a loopback world; made by :func:`run`. ``semantics``: "mpi" or "nccl"."""

    backend = "loopback"

    def __init__(self, world: _World, rank: int, timeout: float,
                 backoff: Backoff = Backoff(first=20e-6, longest=1e-3)) -> None:
        super().__init__(rank, world.size, rank, world.size, torch.device("cpu"), timeout, backoff)
        self.semantics = world.semantics
        self._world = world
        self._groups_made = 0
        self._collectives: dict[Any, int] = defaultdict(int)

    # -- point-to-point ------------------------------------------------------------------------
    def isend(self, tensors: tuple[Tensor, ...], dst: int, tag: int) -> Request:
        return self.ibatch([P2POp("send", tuple(tensors), dst, tag)])[0]

    def irecv(self, buffers: tuple[Tensor, ...], src: int, tag: int) -> Request:
        return self.ibatch([P2POp("recv", tuple(buffers), src, tag)])[0]

    def ibatch(self, ops: Sequence[P2POp]) -> list[Request]:
        """Post ``ops`` (sends and receives); under nccl semantics the ops toward each peer
        become available together, as in one NCCL group. One request per op, in order."""
        states = []
        for op in ops:
            if op.op not in ("send", "recv") or not 0 <= op.peer < self.size:
                raise GemsError(f"{op} is not a 'send' or 'recv' to one of ranks 0..{self.size - 1}")
            for i in range(len(op.tensors)):
                message_tag(op.tag, i, TAG_UB)  # the limits of the real backends
            tensors = tuple(t.detach() for t in op.tensors)
            if op.op == "recv":
                self.count_received(tensors, op.tag)
            if op.op == "send" and self.semantics == "mpi":
                tensors = tuple(t.clone() for t in tensors)  # buffered: the sender may reuse its own
            states.append(_P2P(op.op, self.rank, op.peer, tensors, op.tag))
        w = self._world
        with w.lock:
            if self.semantics == "nccl":
                if states:
                    w.post_unit(states)
            else:
                for s in states:
                    self._post_mpi(s)
            w.touch()
        return [_Req(s, f"{s.kind} {'to' if s.kind == 'send' else 'from'} rank {s.peer}, tag {s.tag}")
                for s in states]

    def _post_mpi(self, op: _P2P) -> None:
        w = self._world
        if op.kind == "send":
            receives = w.posted[self.rank, op.peer, op.tag]
            if receives:
                recv = receives.popleft()
                recv.finish(_deliver(op.tensors, op.tag, self.rank, recv))
            else:
                w.unexpected[self.rank, op.peer, op.tag].append(op.tensors)
            op.finish()
        elif w.unexpected[op.peer, self.rank, op.tag]:
            op.finish(_deliver(w.unexpected[op.peer, self.rank, op.tag].popleft(), op.tag, op.peer, op))
        else:
            w.posted[op.peer, self.rank, op.tag].append(op)

    # -- collectives ---------------------------------------------------------------------------
    def group(self, ranks: list[int]) -> Group | None:
        ranks = check_group_ranks(ranks, self.size)
        self.check_same_group(ranks)  # waits for every rank, like MPI_Comm_create_group
        self._groups_made += 1
        if self.rank not in ranks:
            return None
        return Group(ranks, ranks.index(self.rank), ("group", self._groups_made, tuple(ranks)))

    def _collective(self, kind: tuple, group: Group | None, data: Any, sig: Any,
                    combine: Callable[[list], Any], finish: Callable[[Any], None] | None) -> Request:
        members = group.ranks if group is not None else list(range(self.size))
        handle = group.handle if group is not None else "world"
        self._collectives[handle] += 1
        key = (handle, self._collectives[handle])
        state, w = _State(), self._world
        with w.lock:
            entry = w.colls.setdefault(key, SimpleNamespace(inputs={}, kinds={}, states=[], result=None))
            me = members.index(self.rank)
            entry.inputs[me], entry.kinds[me] = data, (kind, sig)
            entry.states.append(state)
            if len(entry.inputs) == len(members):
                del w.colls[key]
                error = None
                if len(set(entry.kinds.values())) > 1:
                    calls = "; ".join(f"rank {members[i]}: {' '.join(k[0])} of {k[1]}"
                                      for i, k in sorted(entry.kinds.items()))
                    error = GemsError(f"the ranks of {members} disagree on collective #{key[1]} ({calls}); "
                                      f"every member must make the same collective calls in the same order")
                else:
                    try:
                        entry.result = combine([entry.inputs[i] for i in range(len(members))])
                    except Exception as exc:  # noqa: BLE001 -- e.g. a dtype torch cannot add: fail them all
                        error = exc
                for s in entry.states:
                    s.finish(error)
                w.touch()
        who = f"all {self.size} ranks" if group is None else f"ranks {members}"
        return _Req(state, f"{kind[0]} over {who}", None if finish is None else lambda: finish(entry.result))

    def iallreduce(self, tensor: Tensor, group: Group | None) -> Request:
        def total(inputs: list[Tensor]) -> Tensor:  # in rank order and in the tensor's dtype
            return functools.reduce(Tensor.add_, inputs[1:], inputs[0].clone())

        return self._collective(("allreduce",), group, tensor.detach().clone(),
                                (tuple(tensor.shape), tensor.dtype), total, tensor.detach().copy_)

    def ireduce_scatter_runs(self, flat: Tensor, bounds: Sequence[int], group: Group) -> Request:
        """Only this member's run comes out summed (the rest keeps its own values), so code that
        reads another run's sum fails its tests here as it would over a real reduce-scatter."""
        lo, hi = bounds[group.rank], bounds[group.rank + 1]

        def total(inputs: list[Tensor]) -> Tensor:
            return functools.reduce(Tensor.add_, inputs[1:], inputs[0].clone())

        return self._collective(("reduce_scatter",), group, flat.detach().clone(),
                                (tuple(flat.shape), flat.dtype, tuple(bounds)), total,
                                lambda summed: flat.detach()[lo:hi].copy_(summed[lo:hi]))

    def ibroadcast(self, tensor: Tensor, root: int, group: Group | None) -> Request:
        ranks = group.ranks if group is not None else list(range(self.size))
        if root not in ranks:
            raise GemsError(f"broadcast root {root} is not in the group {ranks}")
        is_root = root == self.rank
        return self._collective(("broadcast", f"from rank {root}"), group,
                                tensor.detach().clone() if is_root else None,
                                (tuple(tensor.shape), tensor.dtype), lambda inputs: inputs[ranks.index(root)],
                                None if is_root else tensor.detach().copy_)

    def iallgather_bytes(self, data: Tensor, group: Group | None) -> tuple[Request, Tensor]:
        rows = torch.empty(group.size if group is not None else self.size, data.numel(), dtype=torch.uint8)
        req = self._collective(("allgather",), group, data.detach().reshape(-1).clone(), data.numel(),
                               torch.stack, rows.copy_)
        return req, rows

    def ibarrier(self) -> Request:
        return self._collective(("barrier",), None, None, None, lambda inputs: None, None)

    # -- waiting and failing -------------------------------------------------------------------
    def wait(self, req: Request, what: str, backoff: Backoff | None = None) -> None:
        """As ``Comm.wait``; also raises Deadlock or PeerFailed as soon as the world shows either. Sleeps
        on the world's condition (``backoff`` is ignored: a spinning thread would take the interpreter from
        the others), woken by every post, completion, failure or deadlock (``_World.touch``), at the latest
        after the longest back-off (a request built outside this world may progress without a post)."""
        w = self._world

        def done() -> bool:
            if req.poll():  # its own result (or error) first: it is the most precise
                return True
            if w.deadlock:
                raise Deadlock(w.deadlock)
            if w.failure is not None:
                rank, exc = w.failure
                raise PeerFailed(f"rank {self.rank} gave up waiting for {what} ({req.describe}): "
                                 f"rank {rank} failed with {type(exc).__name__}: {exc}")
            return False

        with w.lock:
            w.blocked[self.rank] = (what, req)
            w.check_deadlock()
        start = time.monotonic()
        try:
            while True:
                seen = w.version   # before looking: a change after it wakes the sleep below at once
                if done():
                    return
                elapsed = time.monotonic() - start
                if elapsed > self.timeout:
                    raise CommTimeout(self.timed_out(what, req, elapsed))
                with w.lock:
                    if w.version == seen:
                        w.changed.wait(min(self.backoff.longest, self.timeout - elapsed))
        finally:
            with w.lock:
                del w.blocked[self.rank]

    def abort(self, code: int = 1) -> NoReturn:
        exc = Aborted(f"rank {self.rank} aborted the loopback world with exit code {code}")
        self._world.fail(self.rank, exc)
        raise exc

    def fail(self, exc: BaseException, code: int = 1) -> NoReturn:
        """As ``Comm.fail`` (what ``guard`` calls) without the printed line and the grace sleep;
        ``exc`` is recorded first, so ``run`` re-raises it rather than the abort's exception."""
        self._world.fail(self.rank, exc)
        self.abort(code)


def run(world: int, fn: Callable[..., Any], *args: Any, semantics: str = "mpi", timeout: float = 30.0,
        **kwargs: Any) -> list[Any]:
    """Run ``fn(comm, *args, **kwargs)`` on ``world`` threads, one LoopbackComm each; return the
    results in rank order, or re-raise the first rank's failure (noted "on loopback rank R")."""
    shared = _World(world, semantics)
    results: list[Any] = [None] * world

    def main(rank: int) -> None:
        try:
            results[rank] = fn(LoopbackComm(shared, rank, timeout), *args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller by run()
            shared.fail(rank, exc)
        finally:
            shared.leave(rank)

    threads = [threading.Thread(target=main, args=(r,), name=f"loopback-rank-{r}", daemon=True)
               for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if shared.failure is not None:
        rank, exc = shared.failure
        exc.add_note(f"on loopback rank {rank}")
        raise exc
    return results
