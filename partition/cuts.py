"""Where the solver cuts a model for a cost model, and the load each position then carries."""
from __future__ import annotations

import numpy as np

from .costs import CostModel
from .loads import evaluate
from .solver import solve


def balanced_cuts(costs: CostModel, balance_by: str, cuts: list[int] | None = None) -> tuple[list[int], list[float]]:
    """The balanced cuts (unless given) and every position's load under ``balance_by``."""
    cost, transient, remainder = costs.objective(balance_by)
    if cuts is None:
        tied = _tie_broken(cost, costs.profile.boundary_bytes())
        cuts = solve(len(costs.profile), costs.K, tied, transient, costs.mirror, remainder=remainder).cuts
    return cuts, evaluate(cuts, cost, transient, costs.mirror)


# Cuts of equal load are common (under mast K = 2 every cut loads both positions alike) and the
# solver takes the first it meets. A cost of this fraction of the largest, in proportion to the
# bytes alive at a stage's two ends, makes it take the cut with less to send and hold instead;
# loads are then evaluated with the true costs.
TIE_BREAK = 1e-5


def _tie_broken(cost, crossing: np.ndarray):
    """``cost`` plus the tie-break on the bytes ``crossing`` each unit boundary; the same matrix
    object for the same one given (the solver processes each distinct matrix once)."""
    ends = crossing[:, None] + crossing[None, :]
    made: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def tied(p: int, s: int) -> np.ndarray:
        matrix = cost(p, s)
        if id(matrix) not in made:
            finite = np.asarray(matrix, dtype=np.float64)[np.isfinite(matrix)]
            scale = TIE_BREAK * (float(finite.max()) if finite.size else 0.0) / max(float(ends.max()), 1.0)
            made[id(matrix)] = (matrix, matrix + scale * ends)
        return made[id(matrix)][1]
    return tied
