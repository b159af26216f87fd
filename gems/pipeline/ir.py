"""The schedule IR: the one contract between schedules, the executor, the simulator and messaging.

A schedule lowers to one ordered list of :class:`Action` per position of a group. Everything
else reads these lists and nothing else:

- the executor (``gems.pipeline.executor``) runs them, one action after another;
- the simulator (``gems.pipeline.simulate``) replays them with modelled durations;
- messaging (``gems.pipeline.p2p``) posts exactly the transfers they name, in their order;
- the validator (``gems.pipeline.validate``) proves them complete and deadlock-free.

Action kinds
------------
=============  =======================================================================
``forward``    run ``stage`` of ``replica`` on micro-batch ``micro``
``backward``   its backward (input and weight gradients in one pass)
``send_act``   send ``stage``'s output to the position running ``stage + 1``
``recv_act``   receive ``stage``'s input from the position running ``stage - 1``
``send_grad``  send the gradient of ``stage``'s input to the position running ``stage - 1``
``recv_grad``  receive the gradient of ``stage``'s output from the position running ``stage + 1``
``sync``       sum gradients over the sync group (and the loss over the world)
``step``       the optimizer step
=============  =======================================================================

Messages
--------
A send and its receive name the same :class:`Message`: ``(kind, replica, micro, boundary, src,
dst)``, where boundary b is the cut between stage b and stage b+1 and src/dst are positions of
the group. Both ends compute it from their own action (``Action.message(position)``), so they
agree on the message's identity, its wire tag (``Message.tag``) and -- because each position's
list is fixed -- the order in which the transfers between any two positions are posted.
Later features extend this module (split backward, forward-only evaluation, halo exchanges):
a new kind of work is a new action kind here, not a side channel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

FORWARD, BACKWARD = "forward", "backward"
SEND_ACT, RECV_ACT = "send_act", "recv_act"
SEND_GRAD, RECV_GRAD = "send_grad", "recv_grad"
SYNC, STEP = "sync", "step"
COMPUTE = (FORWARD, BACKWARD)
SENDS = (SEND_ACT, SEND_GRAD)
RECVS = (RECV_ACT, RECV_GRAD)
OPS = (FORWARD, BACKWARD, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD, SYNC, STEP)

REPLICA_NAMES = ("d", "u")  # down, up
MESSAGE_KINDS = ("act", "grad")


class Message(NamedTuple):
    """One point-to-point transfer of one step: what crosses ``boundary`` for one micro-batch of
    one replica, from position ``src`` to position ``dst`` of the same group."""

    kind: str       # "act" (forward) or "grad" (backward)
    replica: int
    micro: int
    boundary: int   # the cut between stage ``boundary`` and ``boundary + 1``
    src: int
    dst: int

    @property
    def tag(self) -> int:
        """The wire tag: distinct for every message between one ordered pair of positions in a
        step (a pair exchanges at most one act and one grad per replica and micro-batch)."""
        return (self.micro * 2 + self.replica) * 2 + MESSAGE_KINDS.index(self.kind)

    def __str__(self) -> str:
        return (f"{self.kind} {REPLICA_NAMES[self.replica]}{self.micro}.b{self.boundary} "
                f"@{self.src}->@{self.dst}")


@dataclass(frozen=True)
class Action:
    """One step of one position.

    ``stage`` is the stage this position computes for: the stage run by forward/backward,
    the stage whose output (send_act) or input gradient (send_grad) is sent, the stage that
    consumes a received activation (recv_act) or output gradient (recv_grad). ``peer`` is
    the position at the other end of a message, -1 otherwise.
    """

    op: str
    replica: int = 0
    micro: int = 0
    stage: int = 0
    peer: int = -1

    def message(self, position: int) -> Message:
        """The message this send/recv moves when run by ``position``; the sender's and the
        receiver's actions give the same Message."""
        if self.op == SEND_ACT:
            return Message("act", self.replica, self.micro, self.stage, position, self.peer)
        if self.op == RECV_ACT:
            return Message("act", self.replica, self.micro, self.stage - 1, self.peer, position)
        if self.op == SEND_GRAD:
            return Message("grad", self.replica, self.micro, self.stage - 1, position, self.peer)
        if self.op == RECV_GRAD:
            return Message("grad", self.replica, self.micro, self.stage, self.peer, position)
        raise ValueError(f"{self.op} moves no message")

    def __str__(self) -> str:
        if self.op in (SYNC, STEP):
            return self.op
        text = f"{self.op} {REPLICA_NAMES[self.replica]}{self.micro}.s{self.stage}"
        return text if self.peer < 0 else f"{text} @{self.peer}"


def describe_action(action: Action) -> str:
    """An action in words: "backward of stage 1, replica 0, micro-batch 0"."""
    if action.op in (SYNC, STEP):
        return {SYNC: "the gradient sync", STEP: "the optimizer step"}[action.op]
    return f"{action.op} of stage {action.stage}, replica {action.replica}, micro-batch {action.micro}"


def transfers(actions: list[Action], position: int, peer: int) -> list[Message]:
    """The messages between ``position`` and ``peer`` (both directions), in the order
    ``position`` posts them: what a transport with one ordered queue per pair must match."""
    return [a.message(position) for a in actions if (a.op in SENDS or a.op in RECVS) and a.peer == peer]
