"""The terms of a min-max cut of n units into K stages: the cost functions, which stages a
position holds, the load every position carries under given cut points, and the cost matrices
as the solvers (``plain``, ``mirrored``) read them. Pure: numpy only, no torch.

Costs come per (position, stage) as an (n+1) x (n+1) matrix ``C[lo, hi]`` = cost of units
[lo, hi) as that stage on that position (only lo < hi is read; costs must be >= 0), so a
cost may depend on where a stage runs (e.g. how many micro-batches it keeps in flight
there). A position's load is

    sum over the stages it holds of cost(p, s)[stage s]  +  max over them of transient(p, s)[stage s]

The optional ``transient`` part combines by max because a position runs one stage at a time
(the working memory of a backward pass, say).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

CostFn = Callable[[int, int], np.ndarray]   # (position, stage) -> C[lo, hi]


def holds(K: int, position: int, mirror: bool) -> list[int]:
    """Stages a position holds: [p], or {p, K-1-p} when mirrored (one stage in the middle)."""
    return sorted({position, K - 1 - position}) if mirror else [position]


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


def margin(value: float) -> float:
    """``value`` plus a rounding margin: the same loads summed in another order must pass."""
    return value + 1e-9 * abs(value) + 1e-12


class Matrices:
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
