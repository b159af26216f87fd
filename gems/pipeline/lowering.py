"""Lowering: per-position compute orders -> the action lists every other part reads.

Each compute task gets the messages around it: a forward receives its inputs (from the previous
stage and from every stage with a skip edge into it) before it runs and sends its output after;
a backward, or the input-gradient half of a split one, receives the gradients of its outputs
before and sends its input gradients after. A weight-gradient moves nothing. Neighbour stages on
the same position hand over in memory, without a message.
"""
from __future__ import annotations

from collections.abc import Sequence

from gems.pipeline.ir import (BACKWARD_WEIGHT, FORWARD, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, STEP, SYNC,
                              Action)

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
