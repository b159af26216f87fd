"""Pipeline schedules as pure action lists: no torch, no MPI.

``schedule(name, K, m)`` returns, for every position of a group, the ordered list of
actions that position executes in one training step. The engine runs these lists and the
simulator replays them, so every schedule has one source of truth.

Schedules
---------
``mp``     one replica, one micro-batch: plain model parallelism (the GEMS baseline).
``gpipe``  one replica, fill-drain: all m forwards, then all m backwards.
``1f1b``   one replica, at most K - s micro-batches in flight at stage s (PipeDream-flush).
``mast``   two mirrored replicas (GEMS-MAST): replica *down* places stage s on position s,
           replica *up* places it on position K-1-s, so one replica's forward fills the
           other's idle time; m micro-batches each (m > 1 fills the bubbles further, as in
           Chimera). For odd K the middle position holds one copy of the middle stage.

K = 2, m = 1, ``mast`` (forward 1 tick, backward 2)::

    position 0 | F d.s0 | F u.s1 | B u.s1  B u.s1 | B d.s0  B d.s0 |
    position 1 | F u.s0 | F d.s1 | B d.s1  B d.s1 | B u.s0  B u.s0 |

Orders are produced by one greedy list scheduler (``gems.schedule.ordering``: forward 1 tick,
backward 2 ticks, messages free): at every tick an idle position starts the ready task its rule
ranks first; for ``mast`` the schedule search (``gems.schedule.search``) compares several rules
and in-flight caps and keeps the shortest step within the memory bound. With ``split=True`` each
backward becomes an input-gradient and a weight-gradient action, and the weight-gradients fill
bubbles (as zero-bubble pipelines do). Because a position executes its list in a fixed order and
only waits on messages, an order that completes in one timing completes in every timing;
``gems.schedule.validate`` re-checks that by simulation.
"""
from __future__ import annotations

from collections.abc import Sequence

from gems.errors import GemsError
from gems.schedule import search
from gems.schedule.ir import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, COMPUTE, FORWARD, GRADIENT,  # noqa: F401
                              LETTERS, RECV_ACT, RECV_GRAD, REDUCE, REPLICA_NAMES, SEND_ACT, SEND_GRAD, SENDS, RECVS,
                              SHARE, STEP, SYNC, ZERO, Action)
from gems.schedule.lowering import lower, place_reduces

SCHEDULES = ("mp", "gpipe", "1f1b", "mast")


def check(name: str, K: int, m: int) -> None:
    """Raise GemsError unless (name, K, m) names a schedule that can be built."""
    if name not in SCHEDULES:
        raise GemsError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    if not isinstance(K, int) or K < 1:
        raise GemsError(f"the number of stages must be a positive integer, got {K!r}")
    if not isinstance(m, int) or m < 1:
        raise GemsError(f"the number of micro-batches must be a positive integer, got {m!r}")
    if name == "mp" and m != 1:
        raise GemsError("schedule 'mp' runs one micro-batch per step: use --micro-batches 1, "
                        "or schedule 'gpipe' / '1f1b' / 'mast' for more")


def replicas(name: str) -> int:
    """Model replicas a schedule runs on one group: 2 for ``mast``, else 1."""
    return 2 if name == "mast" else 1


def position_of(name: str, K: int, replica: int, stage: int) -> int:
    """The position that runs ``stage`` of ``replica``."""
    return stage if replica == 0 else K - 1 - stage


def holds(name: str, K: int, position: int) -> list[int]:
    """Stages whose parameters a position holds (sorted; mast: {r, K-1-r})."""
    return sorted({s for rep in range(replicas(name)) for s in range(K)
                   if position_of(name, K, rep, s) == position})


def schedule(name: str, K: int, m: int = 1, skips: Sequence[tuple[int, int]] = (),
             split: bool = False, order: str = "") -> list[list[Action]]:
    """Per position, the ordered actions of one training step.

    ``skips``: edges ``(i, j)``, j > i + 1, on which stage i sends tensors straight to stage j
    (``gems.graph.routes``): the send follows i's forward and the receive precedes j's; the
    gradient goes back after j's backward and is received before i's. Each such message waits
    only on computations its neighbour messages already wait on, so skips add no deadlock.
    ``split``: each backward becomes an input-gradient and a later weight-gradient action
    (``gems.schedule.ordering``), which the order places into bubbles. Each stage's gradients
    start their reduce as soon as its last backward is done (``lowering.place_reduces``).
    ``order``: the search's variant to build (a plan's ``order``, chosen on its stage costs);
    empty: the search's choice on equal stage costs (``gems.schedule.search.order``)."""
    check(name, K, m)
    if any(not 0 <= i < j - 1 < K - 1 for i, j in skips):
        raise ValueError(f"skip edges must join stages i < j - 1 of {K}: {sorted(skips)}")
    found, made_by = search.order(name, K, m, split, order)
    layout = search.layout(name, K, m, made_by.weights)
    lists = lower(found.tasks, layout.place, K, skips)
    done: dict[tuple[int, int], float] = {}
    for p, tasks in enumerate(found.tasks):
        for task in tasks:
            if task[0] in (BACKWARD, BACKWARD_WEIGHT):
                done[(p, task[3])] = max(done.get((p, task[3]), 0),
                                         found.start[task] + layout.duration(task[0], task[3]))
    partners = [sorted({p, K - 1 - p}) if replicas(name) == 2 else [p] for p in range(K)]
    return place_reduces(lists, partners, done)


def variant(name: str, K: int, m: int = 1, split: bool = False) -> str:
    """How the schedule search made the order ``schedule`` returns on equal stage costs (the
    planner keeps it unless the plan's own stage costs favour another, ``Plan.order``)."""
    return str(search.order(name, K, m, split)[1])


def forward_only(name: str, K: int, m: int = 1, skips: Sequence[tuple[int, int]] = (),
                 order: str = "") -> list[list[Action]]:
    """Per position, the forwards of one training step and their messages, in the same order
    (no backward, no gradient, no sync or step): evaluation and prediction on the same ranks.
    Under ``mast`` both mirrored replicas run forwards, so every position computes from the
    start (K = 2, m = 1: ``F d.s0 | F u.s1`` on position 0, ``F u.s0 | F d.s1`` on position 1).
    Dropping a step's backward half keeps its forwards' order, which cannot deadlock: a
    forward's receive depends only on earlier forwards."""
    keep = (RECV_ACT, FORWARD, SEND_ACT)
    return [[a for a in actions if a.op in keep] for actions in schedule(name, K, m, skips, order=order)]


def prefetch_points(actions: list[Action]) -> dict[int, tuple[int, int, int]]:
    """{index of a compute action: (replica, micro, stage) of the backward whose offloaded
    tensors come back as it begins}: the next compute action, when that is a backward whose
    forward ran earlier (a waiting forward's; an immediate forward's backward follows its
    forward, which offloaded nothing). The copy back then runs beside that action, and what
    it brings back is on the device during it (``moments`` counts it)."""
    compute = [i for i, a in enumerate(actions) if a.op in COMPUTE]
    points, forwarded = {}, set()
    for i, j in zip(compute, compute[1:]):
        after = actions[j]
        if after.op in GRADIENT and (after.replica, after.micro, after.stage) in forwarded:
            points[i] = (after.replica, after.micro, after.stage)
        if actions[i].op == FORWARD:
            forwarded.add((actions[i].replica, actions[i].micro, actions[i].stage))
    return points


Moment = tuple[int, dict[int, int], "int | None", dict[int, int], tuple[int, ...]]


def moments(actions: list[Action]) -> list[Moment]:
    """Every distinct moment of one position's compute actions, in order: (the stage
    computed, {stage: micro-batches alive}, the stage whose backward is prefetched then or
    None (``prefetch_points``), {stage: micro-batches between the halves of a split backward},
    the stages whose step's gradients exist then if they exist only from the stage's first backward
    (or half of one) until its ``reduce`` -- as a stage placed ``host-optimizer`` keeps them).

    A micro-batch is alive on a stage from the start of its forward to the end of its
    backward, or of its weight-gradient when the backward is split (the input-gradient pass keeps
    what the weight-gradient needs; the one computed counts); under ``mast`` both replicas of a shared middle stage
    count together. Between the halves -- from the start of its input-gradient to the end of its
    weight-gradient -- it also keeps the gradients the weight-gradient starts from. A position's
    memory peaks at one of these moments: the planner prices each as what every live micro-batch
    keeps (and every one between the halves), plus the working memory of the stage computed, plus
    what an offloading stage's prefetch brings back early.
    """
    live: dict[int, int] = {}
    between: dict[int, int] = {}
    seen: list[Moment] = []
    prefetch = prefetch_points(actions)
    first = {}   # stage -> index of its first backward (or input half)
    for i, a in enumerate(actions):
        if a.op in GRADIENT:
            first.setdefault(a.stage, i)
    reduced = {a.stage: i for i, a in enumerate(actions) if a.op == REDUCE}

    def count(alive: dict[int, int], stage: int, by: int) -> None:
        alive[stage] = alive.get(stage, 0) + by
        if not alive[stage]:
            del alive[stage]
    for i, a in enumerate(actions):
        if a.op not in COMPUTE:
            continue
        if a.op == FORWARD:
            count(live, a.stage, 1)
        if a.op == BACKWARD_INPUT:
            count(between, a.stage, 1)
        moment = (a.stage, dict(sorted(live.items())), prefetch[i][2] if i in prefetch else None,
                  dict(sorted(between.items())),
                  tuple(s for s in sorted(first) if first[s] <= i < reduced.get(s, len(actions))))
        if moment not in seen:
            seen.append(moment)
        if a.op in (BACKWARD, BACKWARD_WEIGHT):
            count(live, a.stage, -1)
        if a.op == BACKWARD_WEIGHT:
            count(between, a.stage, -1)
    return seen


def most_alive(position_moments: list[Moment], between: bool = False) -> dict[int, int]:
    """{stage: most micro-batches of that stage alive at once} over one position's ``moments``;
    ``between``: of those between the halves of a split backward instead."""
    alive = [moment[3] if between else moment[1] for moment in position_moments]
    return {s: max(live.get(s, 0) for live in alive) for s in sorted({s for live in alive for s in live})}


def in_flight(name: str, K: int, m: int = 1, split: bool = False, order: str = "") -> list[dict[int, int]]:
    """Per position, {stage: most micro-batches of that stage alive at once} (``most_alive``).
    The solver multiplies one micro-batch's activation bytes by it: a safe bound, since it
    sums per-stage maxima that may not coincide in time."""
    return [most_alive(moments(actions)) for actions in schedule(name, K, m, split=split, order=order)]


def waiting_forwards(actions: list[Action]) -> list[Action]:
    """The forwards of one position's list whose activations wait across other compute.

    A forward *waits* unless the next compute action after it (forward or backward;
    messages, sync and step do not count) is the backward (or input-gradient) of the same
    replica, micro-batch and stage. Memory policies (``gems.pipeline.stage``) apply in full to waiting forwards only:
    the activations of the others are needed at once, so storing them cheaply saves nothing.
    """
    compute = [a for a in actions if a.op in COMPUTE]
    return [a for a, after in zip(compute, compute[1:] + [None]) if a.op == FORWARD and not (
        after is not None and after.op in GRADIENT and (after.replica, after.micro, after.stage)
        == (a.replica, a.micro, a.stage))]


def describe(lists: list[list[Action]]) -> str:
    """One line per position with its compute actions, e.g. ``F d0.s0  B d0.s0`` (split: I, W)."""
    lines = []
    for p, actions in enumerate(lists):
        steps = [f"{LETTERS[a.op]} {REPLICA_NAMES[a.replica]}{a.micro}.s{a.stage}"
                 for a in actions if a.op in COMPUTE]
        lines.append(f"position {p}: " + "  ".join(steps))
    return "\n".join(lines)
