"""Meeting a memory budget: the cheapest policy per stage that fits (``relax``), and the
least stage count that would fit when the requested one does not (``smallest_fitting``).

``relax`` starts from the leanest allowed policy on every stage, then, stage by stage from
the one whose lean policy costs the most time, relaxes to the cheapest policy that still
fits. A stage's choices include recomputing only some of its segments
(``PolicyModel.partial``), so a budget a little short of the plain plan costs a little
recomputation, not a whole stage's.

With a memory budget that the requested K misses, the plan also names the smallest K that
would fit with the leanest allowed policy, checking K+1, K+2, ...: lower bounds rule most out
without solving, the rest run the solver with the budget as its limit (it gives up early
when the budget is far off).
"""
from __future__ import annotations

from gems.errors import GemsError
from gems.plan import StagePolicy
from gems.units import format_size
from .costs import CostModel, highest, memory_average, memory_floor
from .options import kind_words
from .policy import PolicyModel
from .records import ModelProfile
from .solver import solve


def relax(costs: CostModel, cuts: list[int], allowed: list[str], budget: int) -> list[StagePolicy] | None:
    """Per stage, the cheapest allowed policy that keeps every position within ``budget``:
    start from the leanest everywhere, then relax the stages greedily, the one whose lean
    policy costs the most time first. None when even the leanest does not fit."""
    K = costs.K
    options, leanest = [], []
    for s in range(K):
        lo, hi, holders = cuts[s], cuts[s + 1], costs.holders(s)
        found = {}
        for kind in allowed:   # least saving first: the last kind's own choice is the leanest
            whole = costs.policies.choose(kind, lo, hi, holders)
            for policy in [whole, *costs.policies.partial(kind, lo, hi, holders),
                           *costs.policies.partial(kind, lo, hi, holders, whole.recompute)]:
                found.setdefault(repr(policy), (policy, costs.stage(cuts, s, policy)))
        options.append(sorted(found.values(), key=lambda option: sum(c.seconds for c in option[1].values())))
        leanest.append(next(i for i, (policy, _) in enumerate(options[-1]) if policy == whole))
    units = costs.profile.units
    lazy = {s: sum(u.lazy_grad_bytes for u in units[cuts[s]:cuts[s + 1]]) for s in range(K)}   # priced per moment
    static = [sum(u.static_bytes for s in costs.holds(p) for u in units[cuts[s]:cuts[s + 1]])
              - sum(lazy[s] for s in costs.holds(p)) for p in range(K)]

    def fits(choice: list[int]) -> bool:
        for p in range(K):
            parts = {s: options[s][choice[s]][1][p] for s in costs.holds(p)}
            _, activations, transient, gradients = highest(
                costs.moments[p], {s: c.kept for s, c in parts.items()}, {s: c.transient for s, c in parts.items()},
                {s: c.back for s, c in parts.items()},
                {s: costs.between(cuts, s, options[s][choice[s]][0]) for s in parts}, lazy)
            if static[p] + activations + transient + gradients > budget:
                return False
        return True

    def seconds(s: int, i: int) -> float:
        return sum(c.seconds for c in options[s][i][1].values())

    if not fits(leanest):
        return None
    choice = leanest
    for s in sorted(range(K), key=lambda s: seconds(s, 0) - seconds(s, choice[s])):
        for i in range(len(options[s])):
            trial = choice[:s] + [i] + choice[s + 1:]
            if i == choice[s] or fits(trial):
                choice = trial
                break
    return [options[s][i][0] for s, i in enumerate(choice)]


def smallest_fitting(prof: ModelProfile, schedule: str, K: int, m: int, budget: int, name: str,
                     policies: PolicyModel, kind: str, split: bool = False) -> int:
    """The least stage count above K whose memory-balanced partition fits ``budget`` with
    ``kind`` on every stage.

    Stage counts that a lower bound already rules out are skipped without solving; the first
    one left that the solver's bound misses is also priced as the plan prices it (moment by
    moment), which can be lower. When no
    stage count fits, the error names either a unit that no partition can fit (cheap) or the
    least peak over all stage counts >= K (a solve per stage count: slow for 300+ units).
    """
    n = len(prof)
    kept = policies.kept(kind)
    floor, unit = memory_floor(prof, kept, policies.extra(kind))
    even = "" if kind == "none" else f" even with {kind_words(kind)} everywhere"
    if floor > budget:
        raise GemsError(f"no number of stages fits {name} in the memory budget of {format_size(budget)}{even}: "
                        f"however it is cut, the position holding unit {prof.units[unit].name} needs at least "
                        f"{format_size(floor)}, {format_size(floor - budget)} over the budget; "
                        "raise the budget or shrink the batch or image size")
    exact_tried = False
    for k in range(K + 1, n + 1):
        if memory_average(prof, k, kept) > budget:
            continue
        costs = CostModel(prof, schedule, k, m, None, policies, kind, split)
        if costs.memory_lower_bound() > budget:
            continue
        if solve(n, k, costs.memory, costs.peak, costs.mirror, limit=budget, refine=False,
                 remainder=costs.memory_remainder()) is not None:
            return k
        if not exact_tried:   # the solver's bound sums per-stage maxima; the plan prices moments
            exact_tried = True
            found = solve(n, k, costs.memory, costs.peak, costs.mirror, refine=False,
                          remainder=costs.memory_remainder())
            if found is not None and costs.timeline_peak(found.cuts) <= budget:
                return k
    best = None
    for k in range(n, K - 1, -1):   # nothing fits: the least peak any stage count reaches
        if best is not None and max(floor, memory_average(prof, k, kept)) >= best:
            continue
        costs = CostModel(prof, schedule, k, m, None, policies, kind)
        if best is not None and costs.memory_lower_bound() >= best:
            continue
        found = solve(n, k, costs.memory, costs.peak, costs.mirror, limit=best, refine=False,
                      remainder=costs.memory_remainder())
        if found is not None:
            best = found.value
    raise GemsError(f"no number of stages fits {name} in the memory budget of {format_size(budget)}{even}: the "
                    f"smallest possible peak is {format_size(best)}, {format_size(best - budget)} over the budget; "
                    "raise the budget or shrink the batch or image size")
