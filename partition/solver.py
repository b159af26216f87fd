"""Cut n units into K contiguous, non-empty stages so that the most loaded position is as
light as possible: the solver's front. Pure: numpy only, no torch.

``solve`` returns the exact min-max cuts as a ``Solution``, for the plain placement (position p
holds stage p: ``plain``) or the mirrored one of schedule mast (position p holds stages p and
K-1-p: ``mirrored``, an outside-in DP over pairs of stages). The costs and the load they put on
a position (``holds``, ``evaluate``) are defined in ``loads``; ``cuts_from_balance`` turns a
manual partition into cut points.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gems.errors import GemsError
from .loads import CostFn, Matrices, evaluate
from .mirrored import mirrored_cuts
from .plain import plain_cuts


@dataclass(frozen=True)
class Solution:
    """Cut points (K+1 boundaries, 0 and n included), the objective and every position's load."""

    cuts: list[int]
    value: float
    loads: list[float]


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


def solve(n: int, K: int, cost: CostFn, transient: CostFn | None = None, mirror: bool = False,
          limit: float | None = None, refine: bool = True,
          remainder: np.ndarray | None = None) -> Solution | None:
    """The exact min-max partition of n units into K stages (costs and loads: ``loads``).

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
    costs = Matrices(n, cost, transient)
    if mirror:
        cuts = mirrored_cuts(n, K, costs, limit, refine, remainder)
    else:
        cuts = plain_cuts(n, K, [costs.bound(s, s) for s in range(K)], limit, refine)
    if cuts is None:
        return None
    loads = evaluate(cuts, costs.add, costs.peak, mirror)
    return Solution(cuts=cuts, value=max(loads), loads=loads)
