"""Point-to-point messaging of one position: the transfers its action list names, in wire order.

Toward each peer, transfers are posted in the pair's wire order (``ir.wire_order``: the same
order on both ends, derived from the schedule IR), a receive always before any later send to
that peer. That keeps NCCL, which ignores tags and runs a pair's transfers in posting order, from
deadlocking or swapping two messages; MPI matches by tag anyway and loses nothing by it.

Within that order, receives are posted ahead of need: the next ``prefetch`` receives of the
action list are posted as soon as nothing unposted precedes them toward their peer, so a peer's
send usually finds its receive waiting; every other receive is posted when the order requires it
(before a later send to its peer) or when it is waited for. Sends are non-blocking, progressed
while the rank computes, and completed before the gradient sync. Every message's identity, tag
and buffers follow from the schedule IR (``Action.message``) and the plan's boundary layouts, so
no metadata travels with the data.
"""
from __future__ import annotations

import torch

from gems.pipeline import ir
from gems.pipeline.topology import Topology


class Messenger:
    """Sends and receives of one rank's action list.

    Args:
        comm: the communicator.
        topology: where the ranks sit (to turn positions into world ranks).
        lists: every position's action list of the schedule (the wire order needs them all).
        position: this rank's position.
        shapes, dtypes: per boundary, the shapes (without the batch dimension) and dtype names
            of the tensors that cross it (``plan.stage_output_shapes`` / ``_dtypes``).
        rows: images per micro-batch (the batch dimension of every message).
        device: where the buffers live.
        prefetch: receives of the action list posted ahead of need (at least 1).
    """

    def __init__(self, comm, topology: Topology, lists: list[list[ir.Action]], position: int, shapes, dtypes,
                 rows: int, device: torch.device, prefetch: int) -> None:
        self.comm, self.device, self.rows, self.position = comm, device, rows, position
        actions = lists[position]
        self._peer_rank = {a.peer: topology.peer(comm.rank, a.peer) for a in actions if a.peer >= 0}
        self._shapes, self._dtypes = shapes, [[getattr(torch, d) for d in ds] for ds in dtypes]
        self.prefetch = max(1, prefetch)
        self._wire = ir.wire_order(lists, position)                # peer -> messages, both directions
        self._index = {msg: i for msgs in self._wire.values() for i, msg in enumerate(msgs)}
        self._receives = [a.message(position) for a in actions if a.op in ir.RECVS]
        self._next: dict[int, int] = {}                   # peer -> index of its first unposted transfer
        self._posted: dict[ir.Message, tuple] = {}        # receives posted, not yet consumed
        self._consumed = 0
        self._sends: list = []

    def begin_step(self) -> None:
        """Post the first receives of a step."""
        self._next = dict.fromkeys(self._wire, 0)
        self._posted, self._consumed = {}, 0
        self._prefetch()

    def _peer(self, msg: ir.Message) -> int:
        return msg.src if msg.dst == self.position else msg.dst

    def _post_receives(self, peer: int, upto: int) -> bool:
        """Post the receives toward ``peer`` up to wire index ``upto`` (exclusive) if no send of
        this rank comes before; False (posting nothing) if one does."""
        wire, start = self._wire[peer], self._next[peer]
        if any(msg.src == self.position for msg in wire[start:upto]):
            return False
        for msg in wire[start:upto]:
            bufs = tuple(torch.empty((self.rows, *shape), dtype=dt, device=self.device)
                         for shape, dt in zip(self._shapes[msg.boundary], self._dtypes[msg.boundary]))
            self._posted[msg] = (self.comm.irecv(bufs, self._peer_rank[peer], msg.tag), bufs)
        self._next[peer] = max(start, upto)
        return True

    def _prefetch(self) -> None:
        for msg in self._receives[self._consumed:self._consumed + self.prefetch]:
            self._post_receives(self._peer(msg), self._index[msg] + 1)

    def receive(self, a: ir.Action) -> tuple[torch.Tensor, ...]:
        """Wait for the message of receive action ``a``; its tensors."""
        msg = a.message(self.position)
        if msg not in self._posted and not self._post_receives(msg.src, self._index[msg] + 1):
            raise RuntimeError(f"{a} waits for a message that the wire order puts after a send of this "
                               f"rank that has not happened yet: the schedule and its wire order disagree")
        req, bufs = self._posted.pop(msg)
        self.comm.wait(req, f"{a} from rank {self._peer_rank[a.peer]}")
        self._consumed += 1
        self._prefetch()
        return bufs

    def send(self, a: ir.Action, tensors: tuple[torch.Tensor, ...]) -> None:
        """Start sending ``tensors`` as the message of send action ``a`` (in the plan's dtypes),
        after posting every receive the wire order puts before it."""
        msg = a.message(self.position)
        index = self._index[msg]
        if index != self._next[a.peer] and not self._post_receives(a.peer, index):
            raise RuntimeError(f"{a} comes before an earlier send to the same peer in the wire order: "
                               f"the schedule and its wire order disagree")
        data = tuple(t.detach().to(dt).contiguous() for t, dt in zip(tensors, self._dtypes[msg.boundary]))
        self._sends.append(self.comm.isend(data, self._peer_rank[a.peer], msg.tag))
        self._next[a.peer] = index + 1
        self._prefetch()
        self.progress()

    def progress(self) -> None:
        """Let the transport move pending sends while this rank computes."""
        self._sends = [r for r in self._sends if not self.comm.test(r)]

    def finish_sends(self) -> None:
        """Wait until every send of the step has completed."""
        for req in self._sends:
            self.comm.wait(req, "a send to complete")
        self._sends = []
