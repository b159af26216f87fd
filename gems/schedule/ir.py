"""The schedule IR: the one contract between schedules, the executor, the simulator and messaging.

A schedule lowers to one ordered list of :class:`Action` per position of a group. Everything
else reads these lists and nothing else:

- the executor (``gems.pipeline.executor``) runs them, one action after another;
- the simulator (``gems.schedule.simulate``) replays them with modelled durations;
- messaging (``gems.pipeline.p2p``) posts exactly the transfers they name, in their order;
- the validator (``gems.schedule.validate``) proves them complete and deadlock-free.

Action kinds
------------
=============  =======================================================================
``forward``    run ``stage`` of ``replica`` on micro-batch ``micro``
``backward``   its backward (input and weight gradients in one pass)
``backward_input``   the split backward's first half: the gradient of the stage's input (what
               the previous stage waits for), keeping what the second half needs
``backward_weight``  the second half: the gradients of the stage's parameters
``send_act``   send ``stage``'s output to the position running ``stage + 1`` (or ``other``)
``recv_act``   receive ``stage``'s input from the position running ``stage - 1`` (or ``other``)
``send_grad``  send the gradient of ``stage``'s input to the position running ``stage - 1`` (or ``other``)
``recv_grad``  receive the gradient of ``stage``'s output from the position running ``stage + 1`` (or ``other``)
``reduce``     start summing ``stage``'s gradients over the sync group (non-blocking), once the
               stage's last backward on this position is done; the sync group's members start
               their reduces in one order (``gems.schedule.lowering.place_reduces``)
``sync``       wait for the reduces; sum the loss over the world
``step``       the optimizer step
=============  =======================================================================

Messages
--------
A send and its receive name the same :class:`Message`: ``(kind, replica, micro, producer,
consumer, src, dst)``: what flows along the edge from stage ``producer`` to stage ``consumer``
(activations forward, their gradients back) for one micro-batch of one replica, between
positions src and dst of the group. Most edges join neighbours (``consumer = producer + 1``); a
tensor that skips stages (a U-Net's skip connection) travels on an edge of its own, straight from
the stage that makes it to the stage that reads it (``gems.graph.routes``), named by the action's
``other`` stage. Both ends compute the message from their own action (``Action.message(position)``),
so they agree on its identity and its wire tag (``Message.tag``).

Wire order
----------
Tags are not enough on every transport: NCCL ignores them and runs a pair's sends and receives
in the order they were posted, so the two ends of a pair must post the transfers between them in
one and the same order, and no end may post a receive ahead of a send its peer is waiting for.
Each position's list orders only its own actions, and two lists may cross (one sends an
activation while the other sends a gradient). :func:`wire_order` gives each pair one order that
both can follow: the order of the messages' sends in :func:`replay`, a run of all lists with
buffered sends and blocking receives. Posting the transfers toward each peer in that order --
receives as early as wanted, but every receive before any later send to that peer -- cannot
deadlock a transport with one ordered queue per pair and cannot swap two messages: by induction
over the replay, the first send the replay made that a real run has not completed finds every
transfer ahead of it posted on both sides, in the same order (tests/test_equivalence.py runs
every layout under such a transport).
Later features extend this module (forward-only evaluation, halo exchanges):
a new kind of work is a new action kind here, not a side channel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

FORWARD, BACKWARD = "forward", "backward"
BACKWARD_INPUT, BACKWARD_WEIGHT = "backward_input", "backward_weight"
SEND_ACT, RECV_ACT = "send_act", "recv_act"
SEND_GRAD, RECV_GRAD = "send_grad", "recv_grad"
REDUCE, SYNC, STEP = "reduce", "sync", "step"
SHARE = "share"   # not an action: a timeline's span for a sharded optimizer's parameter exchange after STEP
ZERO = "zero_grad"   # not an action: a timeline's span for zeroing the gradient bucket, the step's last work
COMPUTE = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
GRADIENT = (BACKWARD, BACKWARD_INPUT)   # the backward that makes the stage's input gradient
LETTERS = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "I", BACKWARD_WEIGHT: "W"}
SENDS = (SEND_ACT, SEND_GRAD)
RECVS = (RECV_ACT, RECV_GRAD)
OPS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD, REDUCE, SYNC, STEP)

REPLICA_NAMES = ("d", "u")  # down, up
MESSAGE_KINDS = ("act", "grad")


class Message(NamedTuple):
    """One point-to-point transfer of one step: what flows on the edge ``producer -> consumer``
    for one micro-batch of one replica, from position ``src`` to position ``dst`` of the group."""

    kind: str       # "act" (forward) or "grad" (backward)
    replica: int
    micro: int
    producer: int   # the stage whose output it carries (act) or whose output's gradient (grad)
    consumer: int   # the stage that reads those tensors (a later stage)
    src: int
    dst: int

    @property
    def edge(self) -> tuple[int, int]:
        return self.producer, self.consumer

    @property
    def tag(self) -> int:
        """The wire tag: distinct for every message between one ordered pair of positions in a
        step. A replica places each stage on one position, so a pair of positions carries one
        edge per replica, and at most one act and one grad per replica and micro-batch
        (``gems.schedule.validate`` checks it for every schedule)."""
        return (self.micro * 2 + self.replica) * 2 + MESSAGE_KINDS.index(self.kind)

    def __str__(self) -> str:
        return (f"{self.kind} {REPLICA_NAMES[self.replica]}{self.micro}.s{self.producer}>s{self.consumer} "
                f"@{self.src}->@{self.dst}")


@dataclass(frozen=True)
class Action:
    """One step of one position.

    ``stage`` is the stage this position computes for: the stage run by forward/backward,
    the stage whose output (send_act) or input gradient (send_grad) is sent, the stage that
    consumes a received activation (recv_act) or output gradient (recv_grad). ``peer`` is
    the position at the other end of a message, -1 otherwise. ``other`` is the stage at the
    message's other end when that is not the neighbour (a skip edge), -1 otherwise.
    """

    op: str
    replica: int = 0
    micro: int = 0
    stage: int = 0
    peer: int = -1
    other: int = -1

    def message(self, position: int) -> Message:
        """The message this send/recv moves when run by ``position``; the sender's and the
        receiver's actions give the same Message."""
        later = self.other if self.other >= 0 else self.stage + 1     # the consumer, seen from a producer
        earlier = self.other if self.other >= 0 else self.stage - 1   # the producer, seen from a consumer
        if self.op == SEND_ACT:
            return Message("act", self.replica, self.micro, self.stage, later, position, self.peer)
        if self.op == RECV_ACT:
            return Message("act", self.replica, self.micro, earlier, self.stage, self.peer, position)
        if self.op == SEND_GRAD:
            return Message("grad", self.replica, self.micro, earlier, self.stage, position, self.peer)
        if self.op == RECV_GRAD:
            return Message("grad", self.replica, self.micro, self.stage, later, self.peer, position)
        raise ValueError(f"{self.op} moves no message")

    def __str__(self) -> str:
        if self.op in (SYNC, STEP):
            return self.op
        if self.op == REDUCE:
            return f"reduce s{self.stage}"
        text = f"{self.op} {REPLICA_NAMES[self.replica]}{self.micro}.s{self.stage}"
        if self.other >= 0:
            text += f">s{self.other}" if self.op in (SEND_ACT, RECV_GRAD) else f"<s{self.other}"
        return text if self.peer < 0 else f"{text} @{self.peer}"


def describe_action(action: Action) -> str:
    """An action in words: "backward of stage 1, replica 0, micro-batch 0"."""
    if action.op in (SYNC, STEP):
        return {SYNC: "the gradient sync", STEP: "the optimizer step"}[action.op]
    if action.op == REDUCE:
        return f"the gradient reduce of stage {action.stage}"
    return f"{action.op} of stage {action.stage}, replica {action.replica}, micro-batch {action.micro}"


def replay(lists: list[list[Action]]) -> list[tuple[int, Action]]:
    """Every position's actions as one sequence ``(position, action)``: a run of ``lists`` with
    buffered sends and blocking receives, positions taking turns (each goes on until it waits
    for a message not yet sent). Deterministic, so every rank computes the same sequence.
    ValueError naming where each position is stuck if the lists deadlock."""
    pc = [0] * len(lists)
    sent: set[Message] = set()
    order: list[tuple[int, Action]] = []
    progress = True
    while progress:
        progress = False
        for p, actions in enumerate(lists):
            while pc[p] < len(actions):
                a = actions[pc[p]]
                if a.op in RECVS and a.message(p) not in sent:
                    break
                if a.op in SENDS:
                    sent.add(a.message(p))
                order.append((p, a))
                pc[p] += 1
                progress = True
    stuck = [f"position {p} at {lists[p][pc[p]]}" for p in range(len(lists)) if pc[p] < len(lists[p])]
    if stuck:
        raise ValueError("deadlock: " + "; ".join(stuck))
    return order


def wire_order(lists: list[list[Action]], position: int) -> dict[int, list[Message]]:
    """For each peer of ``position``, every message between the two (both directions) in the
    order both ends post them: the order of their sends in ``replay(lists)`` (see "Wire order")."""
    order: dict[int, list[Message]] = {}
    for p, a in replay(lists):
        if a.op in SENDS and position in (p, a.peer):
            order.setdefault(a.peer if p == position else p, []).append(a.message(p))
    return order
