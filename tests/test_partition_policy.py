"""gems.partition.policy and the planner's memory policies: recompute segments, offload,
``auto`` against a budget, and what plans report with them."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from gems.errors import GemsError
from gems.models import build
from gems.partition import Plan, StagePolicy, plan, profile
from gems.partition.accuracy import toy_model
from gems.partition.costs import CostModel, unit_seconds
from gems.partition.options import KINDS, kinds, parse_bandwidth
from gems.partition.policy import Holder, PolicyModel
from gems.partition.segments import best_segments
from gems.schedule.generators import SCHEDULES

SHAPE = (3, 32, 32)


def resnet18():
    with torch.device("meta"):
        return build("resnet18", num_classes=10)


def objective(segments, start_cost, remat, terms):
    starts = sum(start_cost[a] for a, _ in segments[1:])
    largest = max(remat[a, b] for a, b in segments)
    return max(w * starts + (largest if with_max else 0) + c for w, with_max, c in terms)


def test_best_segments_is_optimal_against_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(150):
        L = int(rng.integers(1, 8))
        start_cost = rng.integers(0, 50, size=L).tolist()
        remat = rng.integers(0, 200, size=(L + 1, L + 1)).astype(float)   # not even monotone
        terms = [(float(rng.integers(0, 4)), bool(rng.integers(0, 2)), float(rng.integers(0, 100)))
                 for _ in range(int(rng.integers(1, 3)))]
        chosen = best_segments(start_cost, remat, terms)
        assert chosen[0][0] == 0 and chosen[-1][1] == L and all(a[1] == b[0] for a, b in zip(chosen, chosen[1:]))
        best = min(objective([(a, b) for a, b in zip((0, *cuts), (*cuts, L))], start_cost, remat, terms)
                   for k in range(L) for cuts in itertools.combinations(range(1, L), k))
        assert objective(chosen, start_cost, remat, terms) == best, (trial, chosen)


def test_holders_count_the_waiting_forwards():
    prof = profile(toy_model(), SHAPE, 1)

    def holders(schedule, K, m):
        costs = CostModel(prof, schedule, K, m)
        return [costs.holders(s) for s in range(K)]
    assert holders("mast", 2, 1) == [[Holder(0, 1, 1, 1), Holder(1, 1, 1, 1)], [Holder(0, 1, 1, 0), Holder(1, 1, 1, 0)]]
    assert holders("1f1b", 2, 2)[1] == [Holder(1, 1, 2, 0)]      # the last stage's forwards are immediate
    assert holders("gpipe", 2, 2) == [[Holder(0, 2, 2, 2)], [Holder(1, 2, 2, 2)]]


def test_an_immediate_forward_reruns_all_but_the_last_segment():
    prof = profile(toy_model(), SHAPE, 1)
    prices = PolicyModel(prof, "cuda", [1.0] * len(prof), [2.0] * len(prof))
    policy = StagePolicy([[0, 2], [2, 5], [5, 6]])
    assert prices.seconds(0, 6, policy, prices.memory(0, 6, policy), Holder(0, 1, 3, 1)) == 1 * 6 + 2 * 5
    shorter = StagePolicy([[0, 2], [2, 5]])          # the last segment does not end the stage
    assert prices.seconds(0, 6, shorter, prices.memory(0, 6, shorter), Holder(0, 1, 3, 1)) == 3 * 5


@pytest.mark.parametrize("model", ["toy", "amoebanet"])
def test_solver_matrices_are_the_exact_natural_prices(model):
    """Natural segments priced for every [lo, hi) at once agree with pricing one stage from
    its storages (the rematerialised part is a bound: it does not see the later units' bytes
    freed before a segment rematerialises), and keep no more than no policy."""
    net = toy_model() if model == "toy" else build("amoebanet-d", num_classes=10, num_layers=3, num_filters=8)
    prof = profile(net, SHAPE, 2)
    n = len(prof)
    for device in ("cuda", "cpu"):
        prices = PolicyModel(prof, device, *unit_seconds(prof, 1e12))
        for kind in KINDS:
            recompute, offload = "recompute" in kind, "offload" in kind
            for lo in range(n):
                for hi in range(lo + 1, n + 1):
                    policy = StagePolicy(prices.natural(lo, hi) if recompute else [], offload)
                    mem = prices.memory(lo, hi, policy)
                    if recompute and not prices.helps(kind)[lo, hi]:   # priced as no policy there
                        assert prices.kept(kind)[lo, hi] == mem.plain and prices.extra(kind)[lo, hi] == 0
                        assert prices._kept(kind)[lo, hi] + prices._extra(kind)[lo, hi] >= mem.kept + mem.extra
                        continue
                    assert prices.kept(kind)[lo, hi] == mem.kept <= mem.plain == prof.activation_bytes(lo, hi)
                    extra = prices.extra(kind)[lo, hi]
                    assert extra >= mem.extra if recompute else extra == mem.extra == mem.plain - mem.kept
                    if device == "cpu":
                        assert mem.kept == (prices.kept("recompute")[lo, hi] if recompute else mem.plain)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_policies_never_raise_the_estimate(schedule):
    model = toy_model()
    m = 1 if schedule == "mp" else 2
    batch = 4 if schedule == "mast" else 2
    for recompute, offload in itertools.product(("none", "all"), repeat=2):
        p = plan(model, SHAPE, batch, 3, schedule, m, recompute=recompute, offload=offload)
        assert [q.kind for q in p.policies] == [KINDS[2 * (recompute == "all") + (offload == "all")]] * 3
        for pos in p.positions:
            assert pos.peak_bytes <= pos.plain_peak_bytes
            static = sum(p.stage_estimates[s].static_bytes for s in pos.stages)
            acts = sum(pos.in_flight[s] * p.stage_estimates[s].activation_bytes for s in pos.stages)
            assert pos.peak_bytes == static + acts + pos.transient_bytes + pos.send_bytes
            if recompute == offload == "none":
                assert pos.peak_bytes == pos.plain_peak_bytes and pos.extra_seconds == 0


def test_recompute_all_cuts_the_peak_and_adds_forward_time():
    plain = plan(resnet18(), (3, 512, 512), 4, 2, "gpipe", 2)
    lean = plan(resnet18(), (3, 512, 512), 4, 2, "gpipe", 2, recompute="all")
    assert lean.peak_bytes < 0.65 * plain.peak_bytes   # the working memory left is no policy's to save
    assert all(p.recompute for p in lean.policies) and plain.step_seconds is None
    for pos, stage in zip(lean.positions, lean.stage_estimates):   # gpipe re-runs every forward
        assert pos.recompute_flops == 2 * stage.forward_flops and pos.extra_seconds > 0
    assert lean.step_seconds > lean.plain_step_seconds
    table = lean.table()
    assert "recompute x" in table and "w/o policy" in table and "predicted step" in table


def test_auto_picks_nothing_when_it_fits_and_the_cheapest_policy_when_tight():
    args = dict(input_shape=(3, 512, 512), batch_size=4, stages=2, schedule="gpipe", micro_batches=2,
                recompute="auto", offload="auto")
    plain = plan(resnet18(), **{**args, "recompute": "none", "offload": "none"})
    leanest = plan(resnet18(), **{**args, "recompute": "all", "offload": "all"})
    roomy = plan(resnet18(), **args, memory_budget=2 * plain.peak_bytes)
    assert roomy.fits and all(p.kind == "none" for p in roomy.policies) and roomy.cuts == plain.cuts
    budget = (plain.peak_bytes + leanest.peak_bytes) // 2
    tight = plan(resnet18(), **args, memory_budget=budget)
    assert tight.fits and tight.peak_bytes <= budget < plain.peak_bytes
    assert any(p.kind != "none" for p in tight.policies)
    assert max(p.extra_seconds for p in tight.positions) <= max(p.extra_seconds for p in leanest.positions)
    on_cpu = plan(resnet18(), **args, memory_budget=budget, device="cpu")
    assert on_cpu.fits and not any(p.offload for p in on_cpu.policies)


def test_partial_recompute_chains_the_segments_that_save_most_per_second():
    prof = profile(resnet18(), (3, 128, 128), 1)
    prices = PolicyModel(prof, "cuda", *unit_seconds(prof, 1e12))
    n, holders = len(prof), CostModel(prof, "gpipe", 1, 2).holders(0)
    natural = prices.natural(0, n)
    chain = prices.partial("recompute", 0, n, holders)
    assert chain and all(p.recompute and set(map(tuple, p.recompute)) < set(map(tuple, natural)) for p in chain)
    assert all(p.recompute == sorted(p.recompute) for p in chain)
    kept = [prices.memory(0, n, p).kept for p in chain]
    assert kept == sorted(kept, reverse=True) and kept[0] < prices.memory(0, n, StagePolicy()).kept
    covered = [sum(b - a for a, b in p.recompute) for p in chain]
    assert covered == sorted(covered) and covered[-1] < n
    assert len(prices.partial("recompute", 0, n, holders, most=3)) == 3
    assert prices.partial("offload", 0, n, holders) == [] and prices.partial("recompute", 0, 1, holders) == []


def test_auto_recomputes_only_what_a_slightly_short_budget_needs():
    args = dict(input_shape=(3, 512, 512), batch_size=4, stages=2, schedule="gpipe", micro_batches=2)
    plain = plan(resnet18(), **args)
    lean = plan(resnet18(), **args, recompute="all")
    short = plan(resnet18(), **args, memory_budget=plain.peak_bytes * 19 // 20, recompute="auto")
    assert short.fits and short.peak_bytes <= plain.peak_bytes * 19 // 20
    covered = sum(b - a for p in short.policies for a, b in p.recompute)
    assert 0 < covered < sum(b - a for p in lean.policies for a, b in p.recompute)
    assert 0 < max(p.extra_seconds for p in short.positions) < max(p.extra_seconds for p in lean.positions)


def test_auto_without_a_budget_is_none():
    p = plan(toy_model(), SHAPE, 2, 2, recompute="auto", offload="auto")
    assert all(q.kind == "none" for q in p.policies) and p.step_seconds is None


def test_offload_on_a_cpu_device_saves_nothing_and_says_so():
    p = plan(toy_model(), SHAPE, 4, 2, offload="all", device="cpu")
    assert all(q.offload for q in p.policies)
    assert all(s.activation_bytes == s.plain_activation_bytes and s.offload_bytes == 0 for s in p.stage_estimates)
    assert "saves nothing" in p.table()
    assert kinds("auto", "auto", "cpu", budgeted=True) == ["none", "recompute"]
    assert kinds("all", "auto", "cuda", budgeted=False) == ["recompute"]


def test_impossible_budget_names_the_missing_bytes():
    leanest = plan(toy_model(), SHAPE, 2, 2, recompute="all", offload="all")
    with pytest.raises(GemsError, match="no number of stages fits .* even with recompute and offload everywhere: "
                                        ".* over the budget"):
        plan(toy_model(), SHAPE, 2, 2, memory_budget=leanest.peak_bytes // 4, recompute="auto", offload="auto")


def test_smallest_stage_count_counts_the_policies():
    plain = plan(toy_model(), SHAPE, 2, 2, memory_budget="1GiB")
    peak4 = plan(toy_model(), SHAPE, 2, 4).peak_bytes
    without = plan(toy_model(), SHAPE, 2, 2, memory_budget=peak4)
    with_policies = plan(toy_model(), SHAPE, 2, 2, memory_budget=peak4, recompute="auto", offload="auto")
    assert plain.fits and not without.fits
    assert with_policies.fits or with_policies.smallest_fitting_stages <= without.smallest_fitting_stages


def test_json_round_trip_with_policies(tmp_path):
    p = plan(toy_model(), SHAPE, 4, 3, "mast", memory_budget="1GiB", recompute="all", offload="all",
             host_bandwidth="25GB/s")
    assert p.host_bandwidth == 25e9 and p.policies[0].recompute and p.policies[0].offload
    q = Plan.from_json(p.to_json(tmp_path / "plan.json"))
    assert q == p and q.table() == p.table()
    assert isinstance(q.policies[0], StagePolicy)


def test_cost_model_prices_the_policy_in_every_objective():
    prof = profile(toy_model(), SHAPE, 1)
    prices = PolicyModel(prof, "cuda", *unit_seconds(prof, 1e12))
    plain, lean = CostModel(prof, "gpipe", 2, 2), CostModel(prof, "gpipe", 2, 2, None, prices, "recompute")
    n = len(prof)
    for p in range(2):
        assert (lean.memory(p, p)[0, n] <= plain.memory(p, p)[0, n])
        assert lean.flops_cost(p, p)[0, n] == 2 * plain.flops_cost(p, p)[0, n]     # gpipe: every forward waits
        assert lean.time_cost(p, p)[0, n] > plain.time_cost(p, p)[0, n]


@pytest.mark.parametrize("text", ["fast", "0", "-1GB/s", "inf"])
def test_bad_host_bandwidth(text):
    with pytest.raises(GemsError, match="host bandwidth must be a positive rate"):
        parse_bandwidth(text)
    assert parse_bandwidth("12GB/s") == 12e9 == parse_bandwidth(12e9)


@pytest.mark.parametrize("kwargs, message", [
    ({"recompute": "some"}, "--recompute must be one of none, auto, all"),
    ({"offload": True}, "--offload must be one of"),
    ({"device": "tpu"}, "'cuda' or 'cpu'"),
    ({"host_bandwidth": "fast"}, "host bandwidth"),
    ({"device_flops": 0}, "device rate must be positive"),
    ({"efficiency": 1.5}, "efficiency in"),
])
def test_bad_policy_input(kwargs, message):
    with pytest.raises(GemsError, match=message):
        plan(toy_model(), SHAPE, 2, 2, **kwargs)
