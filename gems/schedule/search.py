"""The schedule search: the compute order of each schedule, and for ``mast`` the best of several.

``mp``, ``gpipe`` and ``1f1b`` have one order each (their rule and in-flight cap). For ``mast``
the two mirrored replicas can interleave in many ways; ``order`` list-schedules every candidate
(``gems.schedule.ordering``: each rule in ``RULES`` x a per-stage cap of 1F1B's ``K - s`` plus 0,
1 or 2 x a per-position limit or none), keeps those whose peak stays within 1F1B's at the
same micro-batches in flight plus one micro-batch (``min(2m, K) + 1`` micro-batches of one stage
on a position), and takes the shortest step (forward 1, backward 2 or input-gradient 1 +
weight-gradient 1, messages free); ties go to the earlier candidate, and the first is today's
classic order (backward first, cap ``K - s``). The search is deterministic, so every rank, the
planner and the simulator derive the same order.

Ticks treat every stage alike. The planner knows each stage's cost, so it also list-schedules
every candidate with integer stage weights (``Variant.weights``: a stage's ticks times its weight,
about its cost relative to the cheapest stage's), replays every order that ``qualified`` keeps with
the plan's costs (``gems.partition.order``) and writes the fastest into the plan (``Plan.order``:
the variant's text, weights included, which ``Variant.parse`` reads back); the engine, the
simulator and the memory model then build that variant's order (``order(..., variant=plan.order)``).

The bound counts micro-batches alive, not bytes: with the backward split, a micro-batch between
its halves also keeps the gradients its weight half starts from (about one more activation per
layer with parameters), which the planner prices (``gems.partition.costs``) but this bound does
not see.

Simulated utilization (``gems-sim utilization``), mast, split backward: K=4 m=4 0.960, K=8 m=8
0.941, K=8 m=4 0.889 -- the bound each position's start-up delay min(p, K-1-p) allows.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from gems.errors import GemsError
from gems.schedule.ordering import RULES, Layout, Order, greedy, peak_in_flight

EXTRA_CAPS = (0, 1, 2)   # added to 1F1B's K - s
MAX_WEIGHT = 16           # the largest stage weight a variant may give


class Variant(NamedTuple):
    """One candidate order: which rule, cap and limit made it."""

    rule: str
    extra: int | None      # cap per (replica, stage): min(m, K - s + extra); None: m
    limit: int | None      # micro-batches in flight per position; None: no limit
    weights: tuple[int, ...] = ()   # per stage, its ticks' multiplier (empty: every stage 1)

    def __str__(self) -> str:
        cap = "m" if self.extra is None else ("K-s" if self.extra == 0 else f"K-s+{self.extra}")
        return (f"{self.rule}, cap {cap}" + ("" if self.limit is None else f", {self.limit} per position")
                + (f", stage weights {':'.join(map(str, self.weights))}" if self.weights else ""))

    @classmethod
    def parse(cls, text: str) -> Variant:
        """The variant whose ``str`` is ``text`` (as a plan records it); GemsError if none is."""
        given = [part.strip() for part in str(text).split(",")]
        parts = list(given)
        try:
            weights: tuple[int, ...] = ()
            if parts[-1].startswith("stage weights "):
                weights = tuple(int(w) for w in parts.pop().removeprefix("stage weights ").split(":"))
            rule, cap, *rest = parts
            extra = {"cap m": None, "cap K-s": 0}.get(cap)
            if extra is None and cap != "cap m":
                extra = int(cap.removeprefix("cap K-s+"))
            limit = int(rest[0].removesuffix(" per position")) if rest else None
            made = cls(rule, extra, limit, weights)
            if rule not in RULES or len(rest) > 1 or str(made) != ", ".join(given):
                raise ValueError(text)
        except ValueError:
            raise GemsError(f"{text!r} is not an order the schedule search makes (e.g. 'backward-first, cap K-s' or "
                            "'fill-first, cap K-s+1, 5 per position, stage weights 1:2:4'): plan again with this "
                            "version") from None
        return made


def layout(name: str, K: int, m: int, weights: tuple[int, ...] = ()) -> Layout:
    down = tuple(range(K))
    return Layout((down, down[::-1]) if name == "mast" else (down,), m, weights)


def memory_bound(K: int, m: int) -> int:
    """Most micro-batches (of one stage) a mast position may hold: 1F1B's peak with the same
    micro-batches in flight (2m), plus one."""
    return min(2 * m, K) + 1


def _run(name: str, K: int, m: int, split: bool, v: Variant) -> Order | None:
    cap = (lambda r, s: m) if v.extra is None else (lambda r, s: min(m, K - s + v.extra))
    return greedy(layout(name, K, m, v.weights), split, RULES[v.rule], cap, v.limit)


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


def weights_of(costs: list[float]) -> tuple[int, ...]:
    """Stage weights for stages costing ``costs`` (seconds, any unit): twice each cost over the
    cheapest's, rounded, from 1 to ``MAX_WEIGHT``; empty where every stage costs alike."""
    low = min((c for c in costs if c > 0), default=0.0)
    made = tuple(min(MAX_WEIGHT, max(1, round(2 * c / low))) if low > 0 else 1 for c in costs)
    return () if len(set(made)) <= 1 else made


@lru_cache(maxsize=256)
def qualified(name: str, K: int, m: int, split: bool = False,
              weights: tuple[int, ...] = ()) -> tuple[tuple[Order, Variant], ...]:
    """The distinct orders the candidates make within the memory bound (with these stage weights),
    each with the first variant that made it, in the candidates' order (the classic order first)."""
    found: dict[tuple, tuple[Order, Variant]] = {}
    for v in candidates(name, K, m):
        v = v._replace(weights=weights)
        o = _run(name, K, m, split, v)
        if o is None or (name == "mast" and max(peak_in_flight(o, split)) > memory_bound(K, m)):
            continue
        found.setdefault(tuple(map(tuple, o.tasks)), (o, v))
    if not found:   # the classic order always qualifies; reaching here is a bug in a rule
        raise RuntimeError(f"no order found for schedule {name} K={K} m={m}")
    return tuple(found.values())


@lru_cache(maxsize=256)
def order(name: str, K: int, m: int, split: bool = False, variant: str = "") -> tuple[Order, Variant]:
    """The compute order of one step of schedule ``name`` and the variant that made it: the
    qualified order of fewest ticks (ties to the earlier), or the one ``variant`` (a plan's
    ``order``; empty: search) names, which must be a qualified one of this schedule."""
    found = qualified(name, K, m, split)
    if not variant:
        return min(found, key=lambda pair: pair[0].ticks)
    wanted = Variant.parse(variant)
    weighted = not wanted.weights or (len(wanted.weights) == K and all(1 <= w <= MAX_WEIGHT for w in wanted.weights))
    if weighted and wanted._replace(weights=()) in candidates(name, K, m):
        made = _run(name, K, m, split, wanted)
        if made is not None and any(made == o for o, _ in qualified(name, K, m, split, wanted.weights)):
            return made, wanted
    raise GemsError(f"the order {variant!r} is not one the schedule search allows for {name} with K={K}, m={m}"
                    f"{' and the backward split' if split else ''}: plan again for this layout")
