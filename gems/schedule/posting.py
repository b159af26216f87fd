"""When a position posts its receives: the wire order (``ir.wire_order``) and a look-ahead.

Toward each peer, transfers are posted in the pair's wire order, a receive always before any
later send to that peer; within it, the next ``prefetch`` receives of the action list are posted
as soon as nothing unposted precedes them toward their peer. ``Posting`` is that bookkeeping
without a transport: ``gems.pipeline.p2p.Messenger`` posts what it says, and the planner replays
it to price the receive buffers alive at each moment (``gems.partition.forward``). Pure.
"""
from __future__ import annotations

from gems.schedule import ir

# Receives posted ahead of need by default (``gems.Engine(prefetch=...)``); the planner prices this many.
PREFETCH = 2


class Posting:
    """Which receives one position has posted, as the wire order and ``prefetch`` allow: the
    bookkeeping of :class:`Messenger` without the transport, so the planner can replay it
    (``gems.partition.forward``). Each method returns the receives to post now, in wire order."""

    def __init__(self, lists: list[list[ir.Action]], position: int, prefetch: int) -> None:
        self.position, self.prefetch = position, max(1, prefetch)
        self.wire = ir.wire_order(lists, position)                # peer -> messages, both directions
        self._index = {msg: i for msgs in self.wire.values() for i, msg in enumerate(msgs)}
        self._receives = [a.message(position) for a in lists[position] if a.op in ir.RECVS]
        self._next: dict[int, int] = {}                   # peer -> index of its first unposted transfer
        self._consumed = 0

    def begin(self) -> list[ir.Message]:
        """A step starts: the first receives."""
        self._next = dict.fromkeys(self.wire, 0)
        self._consumed = 0
        return self._ahead()

    def _peer(self, msg: ir.Message) -> int:
        return msg.src if msg.dst == self.position else msg.dst

    def _upto(self, peer: int, upto: int) -> list[ir.Message] | None:
        """The receives toward ``peer`` up to wire index ``upto`` (exclusive) if no send of this
        position comes before (None then, posting nothing)."""
        wire, start = self.wire[peer], self._next[peer]
        if any(msg.src == self.position for msg in wire[start:upto]):
            return None
        self._next[peer] = max(start, upto)
        return wire[start:upto]

    def _ahead(self) -> list[ir.Message]:
        posts: list[ir.Message] = []
        for msg in self._receives[self._consumed:self._consumed + self.prefetch]:
            posts += self._upto(self._peer(msg), self._index[msg] + 1) or []
        return posts

    def receive(self, msg: ir.Message, posted: bool) -> list[ir.Message]:
        """Before waiting for ``msg``: what to post first (``msg`` itself unless ``posted``)."""
        if posted:
            return []
        posts = self._upto(msg.src, self._index[msg] + 1)
        if posts is None:
            raise RuntimeError(f"{msg} is waited for before a send of position {self.position} that the wire "
                               "order puts first: the schedule and its wire order disagree")
        return posts

    def consumed(self) -> list[ir.Message]:
        """``msg`` has arrived: the receives to post ahead now."""
        self._consumed += 1
        return self._ahead()

    def send(self, msg: ir.Message) -> list[ir.Message]:
        """Before sending ``msg``: every receive the wire order puts before it."""
        index, peer = self._index[msg], msg.dst
        posts = [] if index == self._next[peer] else self._upto(peer, index)
        if posts is None:
            raise RuntimeError(f"{msg} comes before an earlier send to the same peer in the wire order: "
                               "the schedule and its wire order disagree")
        self._next[peer] = index + 1
        return posts

    def after_send(self) -> list[ir.Message]:
        """After a send: the receives to post ahead now."""
        return self._ahead()
