"""Orders of compute for one training step: a greedy list scheduler and the rules it is run with.

A *task* is ``(op, replica, micro, stage)``. The scheduler plays one step in ticks (forward 1,
backward 2, or, with the backward split, input-gradient 1 + weight-gradient 1, each times its
stage's weight: 1 unless the layout gives stages integer weights, their relative costs; messages
free): at every tick an idle position starts the ready task its rule ranks first. Ready means

    forward      the previous stage's forward of the micro-batch is done, the micro-batch is the
                 next of its (replica, stage), and the in-flight limits allow one more
    backward /   the stage's forward and the next stage's backward (or input-gradient) of the
    input-grad   micro-batch are done; micro-batches of one (replica, stage) in order
    weight-grad  its input-gradient is done; in order

A micro-batch is *in flight* on a stage from its forward's start to the end of its backward (or
its weight-gradient: what the input-gradient pass keeps for it lives until then). Two limits bound
memory: per (replica, stage) (``cap``, 1F1B's ``K - s`` by default) and per position (``limit``).

A rule is a sort key over ready tasks; ``RULES`` holds the ones the schedule search compares
(``gems.schedule.search``). Because every position then runs its list in a fixed order and only
waits on messages, an order that completes in this timing completes in every timing; the
validator re-checks each candidate.

Written by hand: list scheduling with priority rules is a few dozen lines, and the rules are the
point of the schedule search; no maintained library schedules pipeline micro-batches.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gems.schedule.ir import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD

Task = tuple[str, int, int, int]   # (op, replica, micro, stage)
TICKS = {FORWARD: 1, BACKWARD: 2, BACKWARD_INPUT: 1, BACKWARD_WEIGHT: 1}


@dataclass(frozen=True)
class Layout:
    """Where stages run: ``place[r][s]`` is the position running stage s of replica r."""

    place: tuple[tuple[int, ...], ...]
    micro_batches: int   # per replica
    weights: tuple[int, ...] = ()   # per stage, what its tasks' ticks are multiplied by (empty: all 1)

    def duration(self, op: str, stage: int) -> int:
        """Ticks of a task ``op`` of ``stage``."""
        return TICKS[op] * (self.weights[stage] if self.weights else 1)

    @property
    def replicas(self) -> int:
        return len(self.place)

    @property
    def stages(self) -> int:
        return len(self.place[0])

    @property
    def positions(self) -> int:
        return 1 + max(max(row) for row in self.place)


Rule = Callable[[Task, Layout], tuple]   # a ready task's rank: the largest starts


@dataclass(frozen=True)
class Order:
    """A scheduler's result: per position the tasks in start order, and when each started."""

    tasks: list[list[Task]]
    start: dict[Task, int]
    ticks: int                 # when the last task ends

    def busy(self) -> int:
        """Ticks of compute at unit weights (what ``utilization`` counts)."""
        return sum(TICKS[t[0]] for row in self.tasks for t in row)

    def utilization(self) -> float:
        """Compute time over positions x step time (messages free, optimizer left out)."""
        return self.busy() / (len(self.tasks) * self.ticks) if self.ticks else 1.0


def greedy(layout: Layout, split: bool, rule: Rule, cap: Callable[[int, int], int],
           limit: int | None = None) -> Order | None:
    """List-schedule one step of ``layout`` under ``rule``; None if the limits starve it (no
    task can ever start again)."""
    R, S, m, P = layout.replicas, layout.stages, layout.micro_batches, layout.positions
    back = BACKWARD_INPUT if split else BACKWARD
    finish: dict[Task, int] = {}
    start: dict[Task, int] = {}
    nf = {(r, s): 0 for r in range(R) for s in range(S)}
    nb, nw = dict(nf), dict(nf)
    flying = dict.fromkeys(nf, 0)
    per_position = [0] * P
    mine = [[(r, s) for r in range(R) for s in range(S) if layout.place[r][s] == p] for p in range(P)]
    busy_until = [0] * P
    tasks: list[list[Task]] = [[] for _ in range(P)]
    total = R * S * m * (3 if split else 2)
    done = t = 0
    done_at = lambda task: finish.get(task, t + 1) <= t   # noqa: E731
    while done < total:
        for p in range(P):
            if busy_until[p] > t:
                continue
            ready: list[Task] = []
            for r, s in mine[p]:
                j = nf[(r, s)]
                if (j < m and flying[(r, s)] < cap(r, s) and (limit is None or per_position[p] < limit)
                        and (s == 0 or done_at((FORWARD, r, j, s - 1)))):
                    ready.append((FORWARD, r, j, s))
                j = nb[(r, s)]
                if j < nf[(r, s)] and done_at((FORWARD, r, j, s)) and (s == S - 1 or done_at((back, r, j, s + 1))):
                    ready.append((back, r, j, s))
                j = nw[(r, s)]
                if split and j < nb[(r, s)] and done_at((BACKWARD_INPUT, r, j, s)):
                    ready.append((BACKWARD_WEIGHT, r, j, s))
            if not ready:
                continue
            op, r, j, s = task = max(ready, key=lambda task: rule(task, layout))
            if op == FORWARD:
                nf[(r, s)] += 1
                flying[(r, s)] += 1
                per_position[p] += 1
            elif op == back:
                nb[(r, s)] += 1
            if op == BACKWARD_WEIGHT or (op == BACKWARD and not split):
                nw[(r, s)] += 1
                flying[(r, s)] -= 1   # freed at its end; nothing else of this position starts before
                per_position[p] -= 1
            busy_until[p] = finish[task] = t + layout.duration(op, s)
            start[task] = t
            tasks[p].append(task)
            done += 1
        t += 1
        if t > (4 * total + 8) * max(layout.weights or (1,)) and not any(b > t for b in busy_until):
            return None
    return Order(tasks, start, max(finish.values(), default=0))


def peak_in_flight(order: Order, split: bool) -> list[int]:
    """Per position, the most micro-batches in flight at once (over all its stages)."""
    peaks = []
    last = BACKWARD_WEIGHT if split else BACKWARD
    for row in order.tasks:
        alive = peak = 0
        for op, *_ in row:
            if op == FORWARD:
                alive += 1
                peak = max(peak, alive)
            elif op == last:
                alive -= 1
        peaks.append(peak)
    return peaks


# --- rules: larger keys start first -------------------------------------------------------------

def _tail(task: Task, layout: Layout) -> int:
    """Ticks of work that must still follow ``task`` on its micro-batch (its critical path)."""
    op, _, _, s = task
    w = layout.weights or (1,) * layout.stages
    if op == FORWARD:
        return sum(w[s + 1:]) + 2 * sum(w)
    if op in (BACKWARD, BACKWARD_INPUT):
        return 2 * sum(w[:s]) if op == BACKWARD else sum(w[:s])
    return 0


def backward_first(task: Task, layout: Layout) -> tuple:
    """1F1B's rule: finish what is in flight (backward before forward), weight-gradients last,
    earlier micro-batches first."""
    op, r, j, _ = task
    return ({BACKWARD: 2, BACKWARD_INPUT: 2, FORWARD: 1, BACKWARD_WEIGHT: 0}[op], -j, -r)


def critical_path(task: Task, layout: Layout) -> tuple:
    """Longest remaining path first (weight-gradients, which nothing waits on, last)."""
    op, r, j, _ = task
    return (op != BACKWARD_WEIGHT, _tail(task, layout), -j, -r)


def fill_first(task: Task, layout: Layout) -> tuple:
    """Forwards while the limits allow (fill the pipeline), then backwards, weight-gradients last."""
    op, r, j, _ = task
    return ({FORWARD: 2, BACKWARD: 1, BACKWARD_INPUT: 1, BACKWARD_WEIGHT: 0}[op], -j, -r)


RULES: dict[str, Rule] = {"backward-first": backward_first, "critical-path": critical_path,
                          "fill-first": fill_first}
