"""Lowering: per-position compute orders -> the action lists every other part reads.

Each compute task gets the messages around it: a forward receives its inputs (from the previous
stage and from every stage with a skip edge into it) before it runs and sends its output after;
a backward, or the input-gradient half of a split one, receives the gradients of its outputs
before and sends its input gradients after. A weight-gradient moves nothing. Neighbour stages on
the same position hand over in memory, without a message.
"""
from __future__ import annotations

from collections.abc import Sequence

from gems.schedule.ir import (BACKWARD, BACKWARD_WEIGHT, FORWARD, RECV_ACT, RECV_GRAD, REDUCE, SEND_ACT, SEND_GRAD,
                              STEP, SYNC, Action)

Task = tuple[str, int, int, int]   # (op, replica, micro, stage)


def lower(orders: Sequence[Sequence[Task]], place: Sequence[Sequence[int]], stages: int,
          skips: Sequence[tuple[int, int]] = (), tail: bool = True) -> list[list[Action]]:
    """Action lists for ``orders`` (per position, tasks in order), ``place[r][s]`` the position of
    stage s of replica r; ``skips`` the edges (i, j), j > i + 1, that carry tensors straight from
    stage i to stage j. ``tail``: end every list with the sync and the optimizer step."""
    into = {j: sorted(i for i, k in skips if k == j) for _, j in skips}
    out_of = {i: sorted(j for k, j in skips if k == i) for i, _ in skips}
    lists: list[list[Action]] = []
    for p, tasks in enumerate(orders):
        actions: list[Action] = []

        def message(op: str, r: int, j: int, s: int, at: int, other: int = -1) -> None:
            if at != p:
                actions.append(Action(op, r, j, s, at, other))

        for op, r, j, s in tasks:
            at = place[r]
            if op == FORWARD:
                if s > 0:
                    message(RECV_ACT, r, j, s, at[s - 1])
                for i in into.get(s, ()):
                    message(RECV_ACT, r, j, s, at[i], i)
                actions.append(Action(FORWARD, r, j, s))
                if s < stages - 1:
                    message(SEND_ACT, r, j, s, at[s + 1])
                for k in out_of.get(s, ()):
                    message(SEND_ACT, r, j, s, at[k], k)
            elif op == BACKWARD_WEIGHT:
                actions.append(Action(op, r, j, s))
            else:
                if s < stages - 1:
                    message(RECV_GRAD, r, j, s, at[s + 1])
                for k in out_of.get(s, ()):
                    message(RECV_GRAD, r, j, s, at[k], k)
                actions.append(Action(op, r, j, s))
                if s > 0:
                    message(SEND_GRAD, r, j, s, at[s - 1])
                for i in into.get(s, ()):
                    message(SEND_GRAD, r, j, s, at[i], i)
        if tail:
            actions += [Action(SYNC), Action(STEP)]
        lists.append(actions)
    return lists


def place_reduces(lists: list[list[Action]], partners: Sequence[Sequence[int]],
                  done: dict[tuple[int, int], float]) -> list[list[Action]]:
    """``lists`` with a ``reduce`` action per stage a position holds, before its ``sync``.

    ``partners[p]``: the positions of p's group that hold the same stages (its sync group within
    one group: ``{p, K-1-p}`` under mast, ``{p}`` otherwise; the other groups run the same lists).
    ``done[(p, s)]``: when stage s's last backward (or weight-gradient) on p ends in the schedule's
    own timing. Collectives on one communicator must start in one order on every member, yet
    mirror partners finish their stages in mirrored order: the members take the stages in the
    order of the latest member's finish (ties: lower stage first), and each puts a stage's reduce
    right after the sends that follow its last backward, but not before the previous reduce."""
    out = []
    for p, actions in enumerate(lists):
        held = sorted({s for q, s in done if q == p})
        order = sorted(held, key=lambda s: (max(done[(q, s)] for q in partners[p]), s))
        last = {}
        for i, a in enumerate(actions):
            if a.op in (BACKWARD, BACKWARD_WEIGHT):
                last[a.stage] = i
        after = {}
        for s in held:   # skip the sends that follow the backward
            i = last[s] + 1
            while i < len(actions) and actions[i].op == SEND_GRAD:
                i += 1
            after[s] = i
        slots, at = [], 0
        for s in order:
            at = max(at, after[s])
            slots.append((at, s))
        merged: list[Action] = []
        k = 0
        for i, a in enumerate(actions):
            while k < len(slots) and slots[k][0] == i:
                merged.append(Action(REDUCE, stage=slots[k][1]))
                k += 1
            merged.append(a)
        merged += [Action(REDUCE, stage=s) for _, s in slots[k:]]
        out.append(merged)
    return out
