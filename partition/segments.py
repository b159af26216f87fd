"""The recompute segments of one stage that minimise its peak: an exact DP.

``PolicyModel.choose`` (``gems.partition.policy``) reduces a stage's segmentation to the
objective of ``best_segments``, with start costs and rematerialised bytes taken from the
storages; this module solves it. Pure: numpy only.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_DP_CELLS = 30_000_000    # candidate values x (units + 1)^2 that best_segments handles exactly


def best_segments(start_cost: Sequence[int], remat: np.ndarray,
                  terms: Sequence[tuple[float, bool, float]]) -> list[tuple[int, int]]:
    """Cut units 0..L-1 into contiguous segments minimising max over terms (w, with_max, c) of

        w * (sum of start_cost[a] over segment starts a) + (max remat[a, b] if with_max) + c

    ``start_cost`` holds whole numbers (bytes); ``start_cost[0]`` is ignored (the first
    segment's input is kept anyway); ``remat`` is (L+1) x (L+1), read for a < b. For every
    candidate value M of the largest segment a DP finds the least start cost with every
    segment <= M (all M at once, vectorised), so the result is exact; among equal peaks it
    has the fewest segments. Past ``MAX_DP_CELLS`` the candidates are thinned evenly by rank
    (stages of more than ~80 units), which may miss the optimum. Returns [(a, b), ...].
    """
    L = len(start_cost)
    cost = np.rint(np.asarray(start_cost, dtype=np.float64))
    cost[0] = 0.0
    limits = np.unique(remat[np.triu_indices(L + 1, 1)])        # candidate values of M
    limits = limits[limits >= remat[:L, L].min()]                 # some segment ends at L
    most = max(2, MAX_DP_CELLS // (L + 1) ** 2)
    if limits.size > most:
        limits = limits[np.unique(np.linspace(0, limits.size - 1, most).round().astype(int))]
    key = cost * (L + 1) + 1                      # total = cost * (L + 1) + segments, exactly
    best = np.full((limits.size, L + 1), np.inf)
    best[:, 0] = 0.0
    parent = np.zeros((limits.size, L + 1), dtype=np.int64)
    rows = np.arange(limits.size)
    for j in range(1, L + 1):
        candidates = np.where(remat[None, :j, j] <= limits[:, None], best[:, :j] + key[None, :j], np.inf)
        parent[:, j] = np.argmin(candidates, axis=1)
        best[:, j] = candidates[rows, parent[:, j]]
    total = np.where(np.isfinite(best[:, L]), best[:, L], 0.0)
    segments, starts = total % (L + 1), total // (L + 1)
    values = np.full(limits.size, -np.inf)
    for w, with_max, c in terms:
        values = np.maximum(values, w * starts + (limits if with_max else 0.0) + c)
    values[~np.isfinite(best[:, L])] = np.inf
    k = int(np.lexsort((segments, values))[0])
    chosen, j = [], L
    while j > 0:
        chosen.append((int(parent[k, j]), j))
        j = int(parent[k, j])
    return chosen[::-1]

