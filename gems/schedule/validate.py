"""Proof that a schedule's action lists are a complete, deadlock-free training step.

``validate`` checks the lists of every generator and every schedule the search picks (tests,
gems-sim): completeness (each compute action once, backward
after forward, one sync and one step at the end), message matching (every send has exactly one
receive, on the right peer, by ``Action.message``), and freedom from deadlock under buffered
sends and blocking receives (an MPI-like transport).
"""
from __future__ import annotations

from gems.schedule.generators import position_of, replicas
from gems.schedule.ir import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, COMPUTE, FORWARD, RECV_ACT, RECV_GRAD, RECVS,
                              REDUCE, SENDS, STEP, SYNC, Action, replay)


def validate(name: str, K: int, m: int, lists: list[list[Action]]) -> None:
    """Prove that ``lists`` is a complete, deadlock-free step of schedule (name, K, m).

    Complete: every position forwards and backwards each (replica, micro-batch) of each
    stage it runs exactly once, backward after forward -- or, split, an input-gradient after
    the forward and a weight-gradient after that -- then syncs and steps once. Every
    send has exactly one matching receive on the right peer, and a stage consumes a
    received tensor only after receiving it. Deadlock-free: executing the lists with
    non-blocking sends and blocking receives finishes. Raises ValueError naming the
    first problem found.
    """
    if len(lists) != K:
        raise ValueError(f"{len(lists)} action lists for K={K}")
    R = replicas(name)
    for p, actions in enumerate(lists):
        runs = {(r, j, s) for r in range(R) for s in range(K) if position_of(name, K, r, s) == p for j in range(m)}
        seen: list[tuple[str, int, int, int]] = []
        received: set[tuple[str, int, int, int]] = set()
        for a in actions:
            if a.op in COMPUTE:
                key = (a.op, a.replica, a.micro, a.stage)
                if key in seen:
                    raise ValueError(f"position {p}: {a} appears twice")
                before = {BACKWARD: FORWARD, BACKWARD_INPUT: FORWARD, BACKWARD_WEIGHT: BACKWARD_INPUT}.get(a.op)
                if before and (before, a.replica, a.micro, a.stage) not in seen:
                    raise ValueError(f"position {p}: {a} before its {before}")
                if a.op != BACKWARD_WEIGHT:
                    needs = (RECV_ACT if a.op == FORWARD else RECV_GRAD)
                    first = a.stage == 0 if a.op == FORWARD else a.stage == K - 1
                    local = not first and position_of(name, K, a.replica,
                                                       a.stage + (-1 if a.op == FORWARD else 1)) == p
                    if not first and not local and (needs, a.replica, a.micro, a.stage) not in received:
                        raise ValueError(f"position {p}: {a} runs before its input is received")
                seen.append(key)
            elif a.op in RECVS:
                received.add((a.op, a.replica, a.micro, a.stage))
        split = {(r, j, s) for op, r, j, s in seen if op in (BACKWARD_INPUT, BACKWARD_WEIGHT)}
        expected = {(op, *k) for k in runs for op in
                    ((FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) if k in split else (FORWARD, BACKWARD))}
        if set(seen) != expected:
            wrong = sorted(expected ^ set(seen))
            raise ValueError(f"position {p}: missing or unexpected {wrong[:3]}")
        tail = [a.op for a in actions if a.op in (SYNC, STEP)]
        if tail != [SYNC, STEP] or actions[-1].op != STEP:
            raise ValueError(f"position {p}: must end with one sync then one step, got {tail}")
        _check_reduces(p, actions, sorted({s for _, _, s in runs}))
    for p in range(K):
        partner = position_of(name, K, R - 1, position_of(name, K, 0, p))   # holds the same stages
        if _reduces(lists[p]) != _reduces(lists[partner]):
            raise ValueError(f"positions {p} and {partner} start their reduces in different orders: "
                             f"{_reduces(lists[p])} and {_reduces(lists[partner])}")
    _check_messages(lists)
    replay(lists)


def _reduces(actions: list[Action]) -> list[int]:
    return [a.stage for a in actions if a.op == REDUCE]


def _check_reduces(p: int, actions: list[Action], held: list[int]) -> None:
    """One reduce per stage held, after the stage's last backward, before the sync."""
    if sorted(_reduces(actions)) != held:
        raise ValueError(f"position {p}: reduces {_reduces(actions)} for the stages {held} it holds")
    sync = next(i for i, a in enumerate(actions) if a.op == SYNC)
    for i, a in enumerate(actions):
        if a.op == REDUCE:
            late = [b for b in actions[i:] if b.op in (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
                    and b.stage == a.stage]
            if late:
                raise ValueError(f"position {p}: {a} before {late[0]}")
            if i > sync:
                raise ValueError(f"position {p}: {a} after the sync")


def _check_messages(lists: list[list[Action]]) -> None:
    """Every message is sent once and received once: the same ``Message`` (identity, source
    and destination positions) on both sides; no two messages between the same positions share a tag."""
    sends: set = set()
    recvs: set = set()
    for p, actions in enumerate(lists):
        for a in actions:
            if a.op in SENDS or a.op in RECVS:
                book = sends if a.op in SENDS else recvs
                msg = a.message(p)
                if msg in book:
                    raise ValueError(f"position {p}: message {msg} handled twice")
                book.add(msg)
    if sends != recvs:
        raise ValueError(f"unmatched messages: {sorted(map(str, sends ^ recvs))[:3]}")
    tags: dict[tuple[int, int, int], object] = {}
    for msg in sends:
        other = tags.setdefault((msg.src, msg.dst, msg.tag), msg)
        if other != msg:
            raise ValueError(f"messages {other} and {msg} share wire tag {msg.tag} between the same positions")
