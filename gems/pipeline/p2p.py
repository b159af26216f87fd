"""Point-to-point messaging of one position: the transfers its action list names, in wire order.

Toward each peer, transfers are posted in the pair's wire order (``ir.wire_order``: the same
order on both ends, derived from the schedule IR), a receive always before any later send to
that peer. That keeps NCCL, which ignores tags and runs a pair's transfers in posting order, from
deadlocking or swapping two messages; MPI matches by tag anyway and loses nothing by it.

Within that order, receives are posted ahead of need: the next ``prefetch`` receives of the
action list are posted as soon as nothing unposted precedes them toward their peer, so a peer's
send usually finds its receive waiting; every other receive is posted when the order requires it
(before a later send to its peer) or when it is waited for (``gems.schedule.posting`` keeps that
bookkeeping, which the planner replays). Sends are non-blocking, progressed
while the rank computes, and completed before the gradient sync. Every message's identity, tag
and buffer follow from the schedule IR (``Action.message``) and the plan's routes (``gems.pipeline
.routes``): one packed buffer per message (``gems.pipeline.packing``), nothing else on the wire.
"""
from __future__ import annotations

import torch

from gems.pipeline.routes import Routes
from gems.schedule import ir
from gems.schedule.posting import PREFETCH, Posting  # noqa: F401 - PREFETCH: the engine's default
from gems.schedule.topology import Topology


class Messenger:
    """Sends and receives of one rank's action list.

    Args:
        comm: the communicator.
        topology: where the ranks sit (to turn positions into world ranks).
        lists: every position's action list of the schedule (the wire order needs them all).
        position: this rank's position.
        routes: the plan's edges (``gems.pipeline.routes``): which tensors each message carries.
        rows: images per micro-batch (the batch dimension of every message).
        device: where the buffers live.
        prefetch: receives of the action list posted ahead of need (at least 1).
        tile: this rank's tile of its position's tile group (0: the leader, or no tile group); a
            member's ``lists`` are its members' (``gems.schedule.members``), its peers the ranks
            holding the same tile, its messages its tile's (``Routes.carried``).

    Every message travels as one packed buffer (``gems.pipeline.packing``).
    """

    def __init__(self, comm, topology: Topology, lists: list[list[ir.Action]], position: int, routes: Routes,
                 rows: int, device: torch.device, prefetch: int, tile: int = 0) -> None:
        self.comm, self.device, self.rows, self.position = comm, device, rows, position
        group = topology.coords(comm.rank)[0]
        self._peer_rank = {a.peer: topology.rank(group, a.peer, tile) for a in lists[position] if a.peer >= 0}
        self._layouts = {(kind, edge): routes.layout(kind, edge, rows, tile) for edge in routes.edges
                         for kind in ir.MESSAGE_KINDS}
        self.posting = Posting(lists, position, prefetch)
        self._posted: dict[ir.Message, tuple] = {}        # receives posted, not yet consumed
        self._sends: list = []

    def begin_step(self) -> None:
        """Post the first receives of a step."""
        self._posted = {}
        self._post(self.posting.begin())

    def _post(self, messages: list[ir.Message]) -> None:
        for msg in messages:
            flat = self._layouts[(msg.kind, msg.edge)].empty(self.device)
            self._posted[msg] = (self.comm.irecv((flat,), self._peer_rank[msg.src], msg.tag), flat)

    def receive(self, a: ir.Action) -> tuple[torch.Tensor, ...]:
        """Wait for the message of receive action ``a``; its tensors (views of one buffer)."""
        msg = a.message(self.position)
        self._post(self.posting.receive(msg, msg in self._posted))
        req, flat = self._posted.pop(msg)
        self.comm.wait(req, f"{a} from rank {self._peer_rank[a.peer]}")
        self._post(self.posting.consumed())
        return self._layouts[(msg.kind, msg.edge)].unpack(flat, str(msg))

    def send(self, a: ir.Action, tensors: tuple[torch.Tensor, ...]) -> None:
        """Start sending ``tensors`` as the message of send action ``a``, packed in the plan's
        dtypes, after posting every receive the wire order puts before it."""
        msg = a.message(self.position)
        self._post(self.posting.send(msg))
        flat = self._layouts[(msg.kind, msg.edge)].pack(tensors, str(msg), self.device)
        self._sends.append(self.comm.isend((flat,), self._peer_rank[a.peer], msg.tag))
        self._post(self.posting.after_send())
        self.progress()

    def progress(self) -> None:
        """Let the transport move pending sends while this rank computes."""
        self._sends = [r for r in self._sends if not self.comm.test(r)]

    def finish_sends(self) -> None:
        """Wait until every send of the step has completed."""
        for req in self._sends:
            self.comm.wait(req, "a send to complete")
        self._sends = []
