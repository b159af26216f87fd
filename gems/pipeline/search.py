"""The schedule search: the compute order of each schedule, and for ``mast`` the best of several.

``mp``, ``gpipe`` and ``1f1b`` have one order each (their rule and in-flight cap). For ``mast``
the two mirrored replicas can interleave in many ways; ``order`` list-schedules every candidate
(``gems.pipeline.ordering``: each rule in ``RULES`` x a per-stage cap of 1F1B's ``K - s`` plus 0,
1 or 2 x a per-position limit or none), keeps those whose peak stays within 1F1B's at the
same micro-batches in flight plus one micro-batch (``min(2m, K) + 1`` micro-batches of one stage
on a position), and takes the shortest step (forward 1, backward 2 or input-gradient 1 +
weight-gradient 1, messages free); ties go to the earlier candidate, and the first is today's
classic order (backward first, cap ``K - s``). The search is deterministic, so every rank, the
planner and the simulator derive the same order. The bound counts micro-batches alive, not bytes:
with the backward split, a micro-batch between its halves also keeps the gradients its weight half
starts from (about one more activation per layer with parameters), which the planner prices
(``gems.partition.costs``) but this bound does not see.

Simulated utilization (``gems-sim utilization``), mast, split backward: K=4 m=4 0.960, K=8 m=8
0.941, K=8 m=4 0.889 -- the bound each position's start-up delay min(p, K-1-p) allows.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from gems.pipeline.ordering import RULES, Layout, Order, greedy, peak_in_flight

EXTRA_CAPS = (0, 1, 2)   # added to 1F1B's K - s


class Variant(NamedTuple):
    """One candidate order: which rule, cap and limit made it."""

    rule: str
    extra: int | None      # cap per (replica, stage): min(m, K - s + extra); None: m
    limit: int | None      # micro-batches in flight per position; None: no limit

    def __str__(self) -> str:
        cap = "m" if self.extra is None else ("K-s" if self.extra == 0 else f"K-s+{self.extra}")
        return f"{self.rule}, cap {cap}" + ("" if self.limit is None else f", {self.limit} per position")


def layout(name: str, K: int, m: int) -> Layout:
    down = tuple(range(K))
    return Layout((down, down[::-1]) if name == "mast" else (down,), m)


def memory_bound(K: int, m: int) -> int:
    """Most micro-batches (of one stage) a mast position may hold: 1F1B's peak with the same
    micro-batches in flight (2m), plus one."""
    return min(2 * m, K) + 1


def _run(name: str, K: int, m: int, split: bool, v: Variant) -> Order | None:
    cap = (lambda r, s: m) if v.extra is None else (lambda r, s: min(m, K - s + v.extra))
    return greedy(layout(name, K, m), split, RULES[v.rule], cap, v.limit)


def candidates(name: str, K: int, m: int) -> list[Variant]:
    if name in ("mp", "gpipe"):
        return [Variant("fill-first", None, None)]
    if name == "1f1b":
        return [Variant("backward-first", 0, None)]
    found = [Variant("backward-first", 0, None)]
    for rule in RULES:
        for extra in EXTRA_CAPS:
            for limit in (None, memory_bound(K, m)):
                v = Variant(rule, extra, limit)
                if v not in found:
                    found.append(v)
    return found


@lru_cache(maxsize=256)
def order(name: str, K: int, m: int, split: bool = False) -> tuple[Order, Variant]:
    """The compute order of one step of schedule ``name`` and the variant that made it."""
    best: tuple[Order, Variant] | None = None
    for v in candidates(name, K, m):
        o = _run(name, K, m, split, v)
        if o is None:
            continue
        if name == "mast" and max(peak_in_flight(o, split)) > memory_bound(K, m):
            continue
        if best is None or o.ticks < best[0].ticks:
            best = (o, v)
    if best is None:   # the classic order always qualifies; reaching here is a bug in a rule
        raise RuntimeError(f"no order found for schedule {name} K={K} m={m}")
    return best
