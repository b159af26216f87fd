"""The cut solver (gems.partition.solver, loads, plain, mirrored): exact min-max cuts against brute force."""
from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from gems.errors import GemsError
from gems.partition.loads import evaluate, holds
from gems.partition.solver import cuts_from_balance, solve


def brute_force(n, K, cost, transient, mirror):
    """The least max-load over every way to cut n units into K non-empty stages."""
    return min(max(evaluate([0, *inner, n], cost, transient, mirror))
               for inner in itertools.combinations(range(1, n), K - 1))


def random_costs(rng, n, K, integer=True):
    """Independent random (n+1)x(n+1) matrices per (position, stage): neither monotone nor
    symmetric, the hardest case for a DP."""
    draw = (lambda hi: rng.integers(0, hi, size=(n + 1, n + 1)).astype(float)) if integer else \
        (lambda hi: rng.uniform(0, hi, size=(n + 1, n + 1)))
    add = {(p, s): draw(20) for p in range(K) for s in range(K)}
    peak = {(p, s): draw(10) for p in range(K) for s in range(K)}
    return (lambda p, s: add[p, s]), (lambda p, s: peak[p, s])


@pytest.mark.parametrize("mirror", [False, True], ids=["plain", "mirror"])
@pytest.mark.parametrize("K", [1, 2, 3, 4, 5, 6])
def test_matches_brute_force(K, mirror):
    rng = np.random.default_rng(100 * K + mirror)
    for trial in range(12):
        n = int(rng.integers(K, 9))
        cost, peak = random_costs(rng, n, K, integer=trial % 2 == 0)
        transient = peak if trial % 3 else None
        solution = solve(n, K, cost, transient, mirror)
        cuts = solution.cuts
        assert len(cuts) == K + 1 and cuts[0] == 0 and cuts[-1] == n
        assert all(a < b for a, b in zip(cuts, cuts[1:]))
        assert solution.value == pytest.approx(brute_force(n, K, cost, transient, mirror), abs=1e-9)
        assert solution.loads == evaluate(cuts, cost, transient, mirror)


def test_refinement_balances_the_other_positions():
    # Unit 0 is huge: the bottleneck is fixed, but the rest should still be balanced.
    weights = np.array([100.0] + [1.0] * 12)
    prefix = np.concatenate([[0], np.cumsum(weights)])
    seg = prefix[None, :] - prefix[:, None]
    sol = solve(13, 4, lambda p, s: seg, mirror=False)
    assert sol.cuts == [0, 1, 5, 9, 13]
    mirrored = solve(13, 4, lambda p, s: seg, mirror=True)
    assert mirrored.value == pytest.approx(brute_force(13, 4, lambda p, s: seg, None, True))
    # Positions 0 and 3 hold unit 0 and one light unit; 1 and 2 hold the other 11 light units.
    assert mirrored.cuts[1] == 1 and mirrored.cuts[3] == 12
    assert mirrored.loads == [101.0, 11.0, 11.0, 101.0]


def test_limit_returns_none_or_the_optimum():
    rng = np.random.default_rng(7)
    cost, peak = random_costs(rng, 8, 4)
    for mirror in (False, True):
        best = solve(8, 4, cost, peak, mirror).value
        assert solve(8, 4, cost, peak, mirror, limit=best - 0.5) is None
        assert solve(8, 4, cost, peak, mirror, limit=best).value == pytest.approx(best)
        assert solve(8, 4, cost, peak, mirror, limit=best, refine=False).value == pytest.approx(best)


def test_remainder_bound_prunes_without_changing_the_optimum():
    # Additive costs, every factor >= 1: the positions holding a middle [i, j) carry at least
    # its total between them.
    rng = np.random.default_rng(3)
    w = rng.uniform(1, 5, 30)
    prefix = np.concatenate([[0], np.cumsum(w)])
    seg = prefix[None, :] - prefix[:, None]
    cost = lambda p, s: (1 + (p + s) % 2) * seg   # noqa: E731
    for K in (3, 4, 5, 6):
        plain = solve(30, K, cost, mirror=True)
        bounded = solve(30, K, cost, mirror=True, remainder=seg)
        assert bounded.value == pytest.approx(plain.value)


def test_holds():
    assert holds(4, 0, mirror=True) == [0, 3]
    assert holds(5, 2, mirror=True) == [2]
    assert holds(4, 1, mirror=False) == [1]


def test_cuts_from_balance():
    assert cuts_from_balance([3, 5, 4], 12) == [0, 3, 8, 12]
    with pytest.raises(GemsError, match="sum to 12"):
        cuts_from_balance([3, 5], 12)
    with pytest.raises(GemsError, match="positive"):
        cuts_from_balance([0, 12], 12)
    with pytest.raises(GemsError, match="2 entries but there are 3 stages"):
        cuts_from_balance([6, 6], 12, K=3)


def test_bad_stage_count_and_costs():
    seg = np.ones((5, 5))
    with pytest.raises(GemsError, match="between 1 and 4"):
        solve(4, 5, lambda p, s: seg)
    with pytest.raises(ValueError, match=">= 0"):
        solve(4, 2, lambda p, s: -seg)


def test_resnet1001_sized_problem_is_fast():
    """n = 335 units (preact-resnet1001), K = 8, mirrored: a few seconds at most."""
    rng = np.random.default_rng(1)
    n = 335
    static = np.concatenate([[0], np.cumsum(rng.uniform(1, 3, n))])
    act = rng.uniform(1, 2, n)
    act[: n // 3] *= 8
    act = np.concatenate([[0], np.cumsum(act)])
    seg = lambda p: p[None, :] - p[:, None]   # noqa: E731
    start = time.perf_counter()
    sol = solve(n, 8, lambda p, s: seg(static) + (1 + s % 2) * seg(act), mirror=True,
                remainder=2 * seg(static) + 2 * seg(act))
    assert time.perf_counter() - start < 10
    assert max(sol.loads) / np.mean(sol.loads) < 1.2
