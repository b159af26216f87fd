"""The plain placement's exact cuts (``mirror=False``): position p holds stage p alone, so a
DP over (stage, end boundary) finds the least max-load; a second pass with that optimum as the
limit picks, among the optimal cuts, the least sum of squared loads. Pure: numpy only, no torch.
"""
from __future__ import annotations

import numpy as np

from .loads import margin


def plain_cuts(n: int, K: int, stage_costs: list[np.ndarray], limit: float | None, refine: bool) -> list[int] | None:
    """Position s holds stage s: the least max-load, then the least sum of squares."""
    best = plain_pass(n, K, stage_costs, None)
    optimum = max(c[a, b] for c, a, b in zip(stage_costs, best, best[1:]))
    if limit is not None and optimum > margin(limit):
        return None
    return plain_pass(n, K, stage_costs, margin(optimum)) if refine else best


def plain_pass(n: int, K: int, stage_costs: list[np.ndarray], limit: float | None) -> list[int]:
    """DP over (stage, end boundary): min-max when ``limit`` is None, else the least sum of
    squared loads with every load <= ``limit``."""
    value = np.full(n + 1, np.inf)
    value[0] = -np.inf if limit is None else 0.0
    parents = []
    for s in range(K):
        cost = stage_costs[s]
        if limit is None:
            candidates = np.maximum(value[:, None], cost)         # [lo, hi]
        else:
            candidates = np.where(cost <= limit, value[:, None] + cost * cost, np.inf)
        parent = np.argmin(candidates, axis=0)
        value = candidates[parent, np.arange(n + 1)]
        parents.append(parent)
    cuts = [n]
    for s in reversed(range(K)):
        cuts.append(int(parents[s][cuts[-1]]))
    return cuts[::-1]
