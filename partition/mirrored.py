"""The mirrored placement's exact cuts (``mirror=True``, schedule mast): position p holds
stage p of replica *down* and stage K-1-p of replica *up*, so positions p and K-1-p hold the
same pair of stages and stages are decided in pairs from the outside in::

    units   |  s0  |  s1  |   s2   |  s3  |  s4  |        K = 5
             pair 0 ------------------------ pair 0
                    pair 1 ----------- pair 1
                            middle (one shared copy, odd K only)

The DP state after t pairs is (i, j): stages 0..t-1 cover [0, i) and K-t..K-1 cover [j, n).
Its value is the best max-load so far; a transition picks stage t = [i, i') and stage
K-1-t = [j', j). That is O(n^4) in the worst case, so everything that cannot beat a known
solution (a plain DP, evaluated mirrored, or the caller's limit) is pruned: since costs are
>= 0 one stage alone bounds its pair's load from below, and an optional ``remainder``
bound drops states whose middle is already too heavy. The result is exact. A second pass
with the optimum as the limit picks, among the optimal cuts, the least sum of squared
loads (the positions off the bottleneck get balanced too). n = 335 units (preact-ResNet-1001)
with K = 8 takes well under a second with the memory model's remainder bound. Pure: numpy
only, no torch.
"""
from __future__ import annotations

import numpy as np

from .loads import Matrices, evaluate, margin
from .plain import plain_pass


def mirrored_cuts(n: int, K: int, costs: Matrices, limit: float | None, refine: bool,
                  remainder: np.ndarray | None) -> list[int] | None:
    """The outside-in pair DP (module docstring): the least max-load, then the least sum of squares."""
    pairs = [_Pair(costs, t, K - 1 - t) for t in range(K // 2)]
    middle = costs.bound(K // 2, K // 2) if K % 2 else None
    if limit is None:
        # A known solution bounds the optimum, so worse transitions can be pruned.
        guess_costs = [_worst([costs.bound(s, s), costs.bound(K - 1 - s, s)]) for s in range(K)]
        limit = max(evaluate(plain_pass(n, K, guess_costs, None), costs.add, costs.peak, mirror=True))
    best = _outside_in(n, K, pairs, middle, costs, margin(limit), True, remainder)
    if best is None or not refine:
        return best
    optimum = max(evaluate(best, costs.add, costs.peak, mirror=True))
    return _outside_in(n, K, pairs, middle, costs, margin(optimum), False, remainder)


class _Pair:
    """Costs of one pair of stages (left = t, right = K-1-t) on the two positions holding both."""

    def __init__(self, costs: Matrices, left: int, right: int) -> None:
        positions = (left, right)
        self.transient = costs.transient is not None
        self.terms = []   # per position; mirrored schedules usually load both alike: keep one
        for p in positions:
            terms = (costs.add(p, left), costs.peak(p, left), costs.add(p, right), costs.peak(p, right))
            if not any(all(a is b for a, b in zip(terms, kept)) for kept in self.terms):
                self.terms.append(terms)
        self.copies = len(positions) - len(self.terms) + 1   # positions sharing the first load
        # One stage alone bounds its pair's load from below (costs are >= 0).
        self.left_bound = _worst([costs.bound(p, left) for p in positions])
        self.right_bound = _worst([costs.bound(p, right) for p in positions])

    def load(self, i, ends, starts, j, want_squares: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        """For left stage [i, ends) and right stage [starts, j) (numpy-broadcast indices): the
        load of the worse of the two positions, and (if wanted) the sum of both positions' squared
        loads."""
        if isinstance(ends, slice):           # one state, a rectangle of targets
            def left(m):
                return m[i, ends][:, None]

            def right(m):
                return m[starts, j][None, :]
        else:
            def left(m):
                return m[i, ends]

            def right(m):
                return m[starts, j]
        worst = squares = None
        for add_left, peak_left, add_right, peak_right in self.terms:
            here = left(add_left) + right(add_right)
            if self.transient:
                here += np.maximum(left(peak_left), right(peak_right))
            worst = here if worst is None else np.maximum(worst, here)
            if want_squares:
                weight = self.copies if squares is None else 1
                squares = weight * here * here if squares is None else squares + here * here
        return worst, squares


class _Level:
    """Best value and parent of every state (i', j') reached after one more pair."""

    def __init__(self, n: int) -> None:
        self.value = np.full((n + 1, n + 1), np.inf)
        self.parent_i = np.full((n + 1, n + 1), -1)
        self.parent_j = np.full((n + 1, n + 1), -1)

    def offer(self, rows: np.ndarray, cols: np.ndarray, load: np.ndarray, i, j) -> None:
        """Keep ``load`` at targets (rows, cols) where it beats the current value. Targets must
        be distinct within one call."""
        better = load < self.value[rows, cols]
        if better.any():
            rows, cols = rows[better], cols[better]
            self.value[rows, cols] = load[better]
            self.parent_i[rows, cols] = i if np.isscalar(i) else i[better]
            self.parent_j[rows, cols] = j if np.isscalar(j) else j[better]


def _outside_in(n: int, K: int, pairs: list[_Pair], middle: np.ndarray | None, costs: Matrices, limit: float,
                minmax: bool, remainder: np.ndarray | None) -> list[int] | None:
    """One pass of the pair DP. ``minmax``: minimise the max load; else minimise the sum of
    squared position loads. Either way every load must be <= ``limit`` (None if impossible).

    A level loops over states when they are few and their transitions many, else over the
    (left length, right length) offsets, vectorised over all states at once: for a fixed
    offset, distinct states reach distinct targets.
    """
    si, sj, sv = np.array([0]), np.array([n]), np.array([-np.inf if minmax else 0.0])
    parents = []
    for t, pair in enumerate(pairs):
        rem = K - 2 * (t + 1)            # stages still to place between the two cuts
        level = _Level(n)
        if rem == 0:                     # even K, innermost pair: the two cuts meet, i' = j'
            _close(pair, si, sj, sv, limit, minmax, level)
        else:
            wide_left = costs.reach(pair.left_bound, limit, rows=True)
            wide_right = costs.reach(pair.right_bound, limit, rows=False)
            width_l, width_r = int(wide_left[si].max()), int(wide_right[sj].max())
            if width_l < 1 or width_r < 1:
                return None
            # Rough microseconds of either loop (numpy call overhead + per-element work).
            if si.size * (60 + 0.02 * width_l * width_r) < width_l * width_r * (40 + 0.05 * si.size):
                for i, j, before in zip(si.tolist(), sj.tolist(), sv.tolist()):
                    _from_state(pair, i, j, before, rem, limit, minmax, level)
            else:
                _by_offset(pair, si, sj, sv, rem, limit, minmax, width_l, width_r, level)
        si, sj = np.nonzero(level.value < np.inf)
        if remainder is not None and rem > 0:     # drop states whose middle cannot fit any more
            fits = remainder[si, sj] <= limit * rem
            si, sj = si[fits], sj[fits]
        if si.size == 0:
            return None
        sv = level.value[si, sj]
        parents.append((level.parent_i, level.parent_j))

    if middle is not None:
        load = middle[si, sj]
        sv = np.where(load <= limit, np.maximum(sv, load) if minmax else sv + load * load, np.inf)
    if not np.isfinite(sv).any():
        return None
    k = int(np.argmin(sv))
    state = (int(si[k]), int(sj[k]))
    chain = [state]
    for parent_i, parent_j in reversed(parents):
        state = (int(parent_i[state]), int(parent_j[state]))
        chain.append(state)
    chain.reverse()                       # chain[t] = (i, j) after t pairs
    lefts = [i for i, _ in chain]
    rights = [j for _, j in chain]
    return lefts + rights[::-1] if K % 2 else lefts + rights[-2::-1]


def _worst(matrices: list[np.ndarray]) -> np.ndarray:
    """Elementwise max, without a copy when all are the same object."""
    return matrices[0] if all(m is matrices[0] for m in matrices) else np.maximum.reduce(matrices)


def _combine(before, worst, squares, limit: float, minmax: bool):
    load = np.maximum(worst, before) if minmax else before + squares
    return np.where(worst <= limit, load, np.inf)


def _from_state(pair: _Pair, i: int, j: int, before: float, rem: int, limit: float, minmax: bool,
                level: _Level) -> None:
    """All transitions out of one state (i, j), as one rectangle of targets [e0, e1) x [s0, s1)."""
    ends = np.flatnonzero(pair.left_bound[i, i + 1:j - rem] <= limit) + i + 1     # i', leaving >= rem units
    starts = np.flatnonzero(pair.right_bound[i + 1 + rem:j, j] <= limit) + i + 1 + rem   # j'
    if ends.size == 0 or starts.size == 0:
        return
    e0, e1, s0, s1 = ends[0], ends[-1] + 1, starts[0], starts[-1] + 1
    worst, squares = pair.load(i, slice(e0, e1), slice(s0, s1), j, not minmax)
    load = _combine(before, worst, squares, limit, minmax)
    if rem and s0 - (e1 - 1) < rem:
        load[np.arange(s0, s1)[None, :] - np.arange(e0, e1)[:, None] < rem] = np.inf
    block = level.value[e0:e1, s0:s1]
    better = load < block
    if better.any():
        np.copyto(block, load, where=better)
        np.copyto(level.parent_i[e0:e1, s0:s1], i, where=better)
        np.copyto(level.parent_j[e0:e1, s0:s1], j, where=better)


def _by_offset(pair: _Pair, si, sj, sv, rem: int, limit: float, minmax: bool, width_l: int, width_r: int,
               level: _Level) -> None:
    """All transitions of all states, one (left length d, right length e) at a time."""
    for d in range(1, width_l + 1):
        ends = si + d
        ok_l = ends <= sj - 1 - rem
        ok_l[ok_l] = pair.left_bound[si[ok_l], ends[ok_l]] <= limit
        if not ok_l.any():
            continue
        i_l, j_l, v_l, e_l = si[ok_l], sj[ok_l], sv[ok_l], ends[ok_l]
        for e in range(1, width_r + 1):
            starts = j_l - e
            ok = starts - e_l >= rem
            ok[ok] = pair.right_bound[starts[ok], j_l[ok]] <= limit
            if not ok.any():
                continue
            i, j, end, start = i_l[ok], j_l[ok], e_l[ok], starts[ok]
            worst, squares = pair.load(i, end, start, j, not minmax)
            level.offer(end, start, _combine(v_l[ok], worst, squares, limit, minmax), i, j)


def _close(pair: _Pair, si, sj, sv, limit: float, minmax: bool, level: _Level) -> None:
    """Innermost pair of an even K: for every meeting cut c, the best state (i, j) with i < c < j."""
    n = level.value.shape[0] - 1
    cut = np.arange(n + 1)
    step = max(1, 2_000_000 // (n + 1))               # states per chunk: ~2M entries at a time
    for first in range(0, si.size, step):
        i, j, before = si[first:first + step, None], sj[first:first + step, None], sv[first:first + step, None]
        c = np.clip(cut[None, :], i + 1, j - 1)
        worst, squares = pair.load(i, c, c, j, not minmax)
        load = _combine(before, worst, squares, limit, minmax)
        load[(cut[None, :] <= i) | (cut[None, :] >= j)] = np.inf
        k = np.argmin(load, axis=0)
        level.offer(cut, cut, load[k, cut], i[k, 0], j[k, 0])
