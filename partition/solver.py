"""Cut n units into K contiguous, non-empty stages so that the most loaded position is as
light as possible. Pure: numpy only, no torch.

Costs come per (position, stage) as an (n+1) x (n+1) matrix ``C[lo, hi]`` = cost of units
[lo, hi) as that stage on that position (only lo < hi is read; costs must be >= 0), so a
cost may depend on where a stage runs (e.g. how many micro-batches it keeps in flight
there). A position's load is

    sum over the stages it holds of cost(p, s)[stage s]  +  max over them of transient(p, s)[stage s]

The optional ``transient`` part combines by max because a position runs one stage at a time
(the working memory of a backward pass, say).

Plain placement (``mirror=False``): position p holds stage p; a DP over (stage, boundary).

Mirrored placement (``mirror=True``, schedule mast): position p holds stage p of replica
*down* and stage K-1-p of replica *up*, so positions p and K-1-p hold the same pair of
stages and stages are decided in pairs from the outside in::

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
with K = 8 takes well under a second with the memory model's remainder bound.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from gems.errors import GemsError

CostFn = Callable[[int, int], np.ndarray]   # (position, stage) -> C[lo, hi]


@dataclass(frozen=True)
class Solution:
    """Cut points (K+1 boundaries, 0 and n included), the objective and every position's load."""

    cuts: list[int]
    value: float
    loads: list[float]


def holds(K: int, position: int, mirror: bool) -> list[int]:
    """Stages a position holds: [p], or {p, K-1-p} when mirrored (one stage in the middle)."""
    return sorted({position, K - 1 - position}) if mirror else [position]


def cuts_from_balance(balance: Sequence[int], n: int, K: int | None = None) -> list[int]:
    """Cut points of a manual partition given as units per stage, e.g. [3, 5, 4] -> [0, 3, 8, 12]."""
    balance = list(balance)
    if K is not None and len(balance) != K:
        raise GemsError(f"balance has {len(balance)} entries but there are {K} stages: give one unit count per stage")
    if any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 for b in balance):
        raise GemsError(f"balance {balance} must list positive unit counts: every stage needs at least one unit")
    if sum(balance) != n:
        raise GemsError(f"balance {balance} covers {sum(balance)} units but the model has {n}: "
                        f"make the counts sum to {n}")
    return [0, *np.cumsum(balance).tolist()]


def evaluate(cuts: Sequence[int], cost: CostFn, transient: CostFn | None = None,
             mirror: bool = False) -> list[float]:
    """Load of every position under the given cut points."""
    K = len(cuts) - 1
    loads = []
    for p in range(K):
        stages = holds(K, p, mirror)
        total = sum(float(cost(p, s)[cuts[s], cuts[s + 1]]) for s in stages)
        if transient is not None:
            total += max(float(transient(p, s)[cuts[s], cuts[s + 1]]) for s in stages)
        loads.append(total)
    return loads


def solve(n: int, K: int, cost: CostFn, transient: CostFn | None = None, mirror: bool = False,
          limit: float | None = None, refine: bool = True,
          remainder: np.ndarray | None = None) -> Solution | None:
    """The exact min-max partition of n units into K stages (see module docstring).

    With ``refine``, among the cuts with the least max-load it returns one with the least sum
    of squared loads, so positions besides the bottleneck are balanced as well. With
    ``limit``, returns None when no partition keeps every load <= limit (much faster than
    solving when far off). ``remainder``, if given, is a matrix T[i, j] such that however
    units [i, j) are cut into k stages, the k positions holding them carry at least T[i, j]
    between them (mirrored DP only: it prunes states whose middle cannot fit; the result
    stays exact). Functions returning the very same matrix object are processed once.
    """
    if not 1 <= K <= n:
        raise GemsError(f"cannot cut {n} units into {K} stages: choose between 1 and {n} stages")
    costs = _Matrices(n, cost, transient)
    if mirror:
        cuts = _mirrored(n, K, costs, limit, refine, remainder)
    else:
        cuts = _plain(n, K, [costs.bound(s, s) for s in range(K)], limit, refine)
    if cuts is None:
        return None
    loads = evaluate(cuts, costs.add, costs.peak, mirror)
    return Solution(cuts=cuts, value=max(loads), loads=loads)


class _Matrices:
    """The cost functions' matrices as float64 with +inf off the valid segments (lo < hi),
    checked and converted once per distinct matrix object, and what is derived from them."""

    def __init__(self, n: int, cost: CostFn, transient: CostFn | None) -> None:
        self.n, self.cost, self.transient = n, cost, transient
        self.valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
        self.zeros = np.where(self.valid, 0.0, np.inf)
        self._by_key: dict[tuple[str, int, int], np.ndarray] = {}
        self._by_id: dict[int, tuple[object, np.ndarray]] = {}   # id(raw) -> (raw kept alive, converted)
        self._derived: dict[tuple, np.ndarray] = {}

    def add(self, p: int, s: int) -> np.ndarray:
        return self._lookup("cost", self.cost, p, s)

    def peak(self, p: int, s: int) -> np.ndarray:
        return self.zeros if self.transient is None else self._lookup("transient", self.transient, p, s)

    def bound(self, p: int, s: int) -> np.ndarray:
        """add + peak: the load of a position holding stage s alone (so a lower bound)."""
        a, t = self.add(p, s), self.peak(p, s)
        return self._derive(("bound", id(a), id(t)), lambda: a + t)

    def reach(self, bound: np.ndarray, limit: float, rows: bool) -> np.ndarray:
        """Per boundary, the longest stage starting (rows) or ending there with bound <= limit."""
        def longest() -> np.ndarray:
            index = np.arange(self.n + 1)
            length = np.where(bound <= limit, index[None, :] - index[:, None], 0)
            return length.max(axis=1 if rows else 0)
        return self._derive(("reach", id(bound), limit, rows), longest)

    def _derive(self, key: tuple, make: Callable[[], np.ndarray]) -> np.ndarray:
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def _lookup(self, kind: str, fn: CostFn, p: int, s: int) -> np.ndarray:
        key = (kind, p, s)
        if key not in self._by_key:
            raw = fn(p, s)
            if id(raw) not in self._by_id:
                matrix = np.asarray(raw, dtype=np.float64)
                if matrix.shape != (self.n + 1, self.n + 1):
                    raise ValueError(f"{kind}({p}, {s}) has shape {matrix.shape}, expected {(self.n + 1, self.n + 1)}")
                inside = matrix[self.valid]
                if np.any(inside < 0) or np.any(np.isnan(inside)):
                    raise ValueError(f"{kind}({p}, {s}) has negative or NaN entries; costs must be >= 0")
                self._by_id[id(raw)] = (raw, np.where(self.valid, matrix, np.inf))
            self._by_key[key] = self._by_id[id(raw)][1]
        return self._by_key[key]


def _margin(value: float) -> float:
    """``value`` plus a rounding margin: the same loads summed in another order must pass."""
    return value + 1e-9 * abs(value) + 1e-12


def _plain(n: int, K: int, stage_costs: list[np.ndarray], limit: float | None, refine: bool) -> list[int] | None:
    """Position s holds stage s: the least max-load, then the least sum of squares."""
    best = _plain_pass(n, K, stage_costs, None)
    optimum = max(c[a, b] for c, a, b in zip(stage_costs, best, best[1:]))
    if limit is not None and optimum > _margin(limit):
        return None
    return _plain_pass(n, K, stage_costs, _margin(optimum)) if refine else best


def _plain_pass(n: int, K: int, stage_costs: list[np.ndarray], limit: float | None) -> list[int]:
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


def _mirrored(n: int, K: int, costs: _Matrices, limit: float | None, refine: bool,
              remainder: np.ndarray | None) -> list[int] | None:
    """Outside-in pair DP (module docstring): the least max-load, then the least sum of squares."""
    pairs = [_Pair(costs, t, K - 1 - t) for t in range(K // 2)]
    middle = costs.bound(K // 2, K // 2) if K % 2 else None
    if limit is None:
        # A known solution bounds the optimum, so worse transitions can be pruned.
        guess_costs = [_worst([costs.bound(s, s), costs.bound(K - 1 - s, s)]) for s in range(K)]
        limit = max(evaluate(_plain_pass(n, K, guess_costs, None), costs.add, costs.peak, mirror=True))
    best = _outside_in(n, K, pairs, middle, costs, _margin(limit), True, remainder)
    if best is None or not refine:
        return best
    optimum = max(evaluate(best, costs.add, costs.peak, mirror=True))
    return _outside_in(n, K, pairs, middle, costs, _margin(optimum), False, remainder)


class _Pair:
    """Costs of one pair of stages (left = t, right = K-1-t) on the two positions holding both."""

    def __init__(self, costs: _Matrices, left: int, right: int) -> None:
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


def _outside_in(n: int, K: int, pairs: list[_Pair], middle: np.ndarray | None, costs: _Matrices, limit: float,
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
