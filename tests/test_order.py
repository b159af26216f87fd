"""The plan's order (``Plan.order``): the planner replays the schedule search's qualified orders on
the plan's stage costs and keeps the fastest; the engine, the simulator and the memory model build
the order the plan names, and training under any of them equals one process."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch
from torch import nn

from gems import partition
from gems.errors import GemsError
from gems.partition.backward import predicted_step
from gems.partition.costs import highest
from gems.schedule import generators as sch, search, simulate
from gems.schedule.network import IDEAL
from gems.schedule.simulate import costs_from_plan
from gems.schedule.sweep import sweep
from gems.schedule.validate import validate

from equivalence import run_loopback


@pytest.mark.parametrize("name,K,m", [("mast", K, m) for K in range(1, 7) for m in (1, 2, 4)]
                         + [("1f1b", 4, 4), ("gpipe", 3, 2), ("mp", 3, 1)])
def test_every_candidate_reads_back_from_its_text_and_builds_its_own_order(name, K, m):
    for v in search.candidates(name, K, m):
        assert search.Variant.parse(str(v)) == v
    for split in (False, True):
        found = search.qualified(name, K, m, split)
        assert found[0][0] == search.order(name, K, m, split)[0] or name == "mast"
        for made, v in found:
            assert search.order(name, K, m, split, str(v)) == (made, v)
        # the default is the qualified order of fewest ticks
        assert search.order(name, K, m, split)[0].ticks == min(o.ticks for o, _ in found)


@pytest.mark.parametrize("name,K,m", [("mast", 3, 2), ("mast", 4, 4), ("mast", 5, 1), ("1f1b", 4, 4), ("gpipe", 3, 2)])
def test_stage_weights_read_back_and_build_their_own_orders(name, K, m):
    weights = tuple(range(1, 2 * K, 2))[:K]   # 1:3:5...
    for split in (False, True):
        for made, v in search.qualified(name, K, m, split, weights):
            assert v.weights == weights and search.Variant.parse(str(v)) == v
            assert search.order(name, K, m, split, str(v)) == (made, v)
            validate(name, K, m, sch.schedule(name, K, m, split=split, order=str(v)))   # runs in every timing
    # weights of stages that cost alike say nothing: no weighted candidates
    assert search.weights_of([3.0] * K) == () and search.weights_of([1.0, 2.0, 5.0]) == (2, 4, 10)
    assert search.weights_of([1.0, 100.0]) == (2, search.MAX_WEIGHT)


@pytest.mark.parametrize("text", ["", "backward-first", "sideways, cap K-s", "backward-first, cap K+s",
                                  "fill-first, cap K-s, five per position", "fill-first, cap m, 3 per position, x",
                                  "backward-first, cap K-s+0", "backward-first, cap K-s, stage weights 1:x",
                                  "stage weights 1:2", "backward-first, cap K-s, stage weights 01:2"])
def test_a_text_no_variant_has_is_refused_in_one_sentence(text):
    if not text:   # empty: the search's own choice
        assert search.order("mast", 4, 2, False, text) == search.order("mast", 4, 2, False)
        return
    with pytest.raises(GemsError, match="not an order the schedule search makes"):
        search.Variant.parse(text)


def test_an_order_outside_the_memory_bound_or_the_schedule_is_refused():
    for weights in ("1:2", "1:2:3:4:5", "0:1:1:1", f"1:1:1:{search.MAX_WEIGHT + 1}"):   # K = 4 stages, 1..16
        with pytest.raises(GemsError, match="not one the schedule search allows for mast with K=4, m=4"):
            search.order("mast", 4, 4, False, f"backward-first, cap K-s, stage weights {weights}")
    # cap m lets stage 0 of each replica hold all 8 micro-batches: over mast's bound of min(2m, K) + 1 = 5
    with pytest.raises(GemsError, match="not one the schedule search allows for mast with K=4, m=4"):
        search.order("mast", 4, 4, False, "backward-first, cap m")
    with pytest.raises(GemsError, match="not one the schedule search allows for 1f1b"):
        search.order("1f1b", 4, 4, False, "fill-first, cap m")


def chain() -> nn.Sequential:
    torch.manual_seed(0)

    def block():
        return nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
    return nn.Sequential(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()), *(block() for _ in range(6)),
                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)))


def test_the_planner_keeps_the_order_fastest_on_its_stage_costs_and_estimates_memory_under_it():
    # stages of 1, 2 and 5 units: the search's order (equal stage costs) is 21% slower here
    plan = partition.plan(chain(), (3, 16, 16), 8, 3, "mast", 2, balance=[1, 2, 5], split_backward=True)
    default = sch.variant("mast", 3, 2, True)
    assert plan.order == "critical-path, cap K-s+1" != default
    assert any(note.startswith(f"order {plan.order}, not the schedule search's {default}") for note in plan.notes)
    timed = costs_from_plan(plan, plan.flops_per_second, 1.0)
    steps = {str(v): simulate.simulate("mast", 3, 2, timed, IDEAL, split=True, order=str(v)).step_time
             for _, v in search.qualified("mast", 3, 2, True)}
    assert predicted_step(plan) == pytest.approx(min(steps.values())) and min(steps.values()) < 0.9 * steps[default]
    # the estimates count the micro-batches the chosen order keeps alive together, not the default's
    def peaks(order: str) -> list[int]:
        held = [sch.holds("mast", 3, p) for p in range(3)]
        est = plan.stage_estimates
        return [highest(sch.moments(actions), {s: est[s].activation_bytes for s in held[p]},
                        {s: est[s].transient_bytes for s in held[p]}, None,
                        {s: est[s].split_bytes for s in held[p]})[1]
                for p, actions in enumerate(sch.schedule("mast", 3, 2, split=True, order=order))]
    assert [p.activation_bytes for p in plan.positions] == peaks(plan.order) != peaks(default)
    # equal stage costs: the search's own order stays, with no note
    even = partition.plan(chain(), (3, 16, 16), 8, 4, "mast", 2, balance=[2, 2, 2, 2], split_backward=True)
    assert even.order == sch.variant("mast", 4, 2, True) and not any(n.startswith("order ") for n in even.notes)


def test_a_plan_json_keeps_its_order_and_gems_train_refuses_one_it_cannot_build(tmp_path):
    plan = partition.plan(chain(), (3, 16, 16), 8, 3, "mast", 2, balance=[1, 2, 5], split_backward=True)
    assert partition.Plan.from_json(plan.to_json()).order == plan.order
    from gems.train.config import TrainConfig
    from gems.train.planning import make_plan
    plan.order = "fill-first, cap m"
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    cfg = TrainConfig(model="resnet18", plan=str(path), stages=3, schedule="mast", micro_batches=2, batch_size=8,
                      image_size=16)
    with pytest.raises(GemsError, match=r"plan.json: the order 'fill-first, cap m' is not one the schedule search "
                                        r"allows for mast with K=3, m=2 and the backward split: plan again"):
        make_plan(cfg, chain(), 1, loaded=plan)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("split", [False, True])
def test_training_under_every_qualified_order_equals_one_process(split):
    for _, v in search.qualified("mast", 3, 2, split):
        results = run_loopback("transparency", "mast", 3, 2, 1, steps=2, split=split, order=str(v))
        lists = sch.schedule("mast", 3, 2, split=split, order=str(v))
        for r in results:
            assert r.computed == [(a.op, a.replica, a.micro, a.stage) for a in lists[r.rank] if a.op in sch.COMPUTE]


def test_a_sweep_replays_each_plan_in_its_own_order():
    plan = partition.plan(chain(), (3, 16, 16), 8, 3, "mast", 2, balance=[1, 2, 5], split_backward=True)
    costs = costs_from_plan(plan, plan.flops_per_second, 1.0)
    found = sweep(lambda name, K, m, D: (costs, 1, 0, True, plan.order), 3, IDEAL, schedules=("mast",),
                  stages=(3,), micro_batches=(2,))
    assert [c.step_time for c in found] == [predicted_step(plan)]
    assert predicted_step(plan) < simulate.simulate("mast", 3, 2, costs, IDEAL, split=True).step_time


def test_an_order_that_would_not_fit_the_budget_is_passed_over_for_the_next_fastest_that_does():
    free = partition.plan(chain(), (3, 16, 16), 8, 3, "mast", 2, balance=[1, 2, 5], split_backward=True)
    budget = max(p.peak_bytes for p in free.positions) - 1   # the fastest order no longer fits
    tight = partition.plan(chain(), (3, 16, 16), 8, 3, "mast", 2, balance=[1, 2, 5], split_backward=True,
                           memory_budget=budget)
    default = sch.variant("mast", 3, 2, True)
    assert tight.fits and tight.order not in (free.order, default)
    assert predicted_step(free) < predicted_step(tight) < simulate.simulate(
        "mast", 3, 2, costs_from_plan(tight, tight.flops_per_second, 1.0), IDEAL, split=True).step_time


def test_a_plan_of_unequal_stages_may_take_a_weighted_order_and_trains_under_it_like_one_process():
    """Stages of 1, 1, 2 and 4 units under mast K=4 m=2 split: the candidates list-scheduled with
    the stages' weights (their costs relative to the cheapest) give the fastest order, 4.8% shorter
    than the search's own and shorter than any order on equal weights; training under it equals
    one process."""
    plan = partition.plan(chain(), (3, 16, 16), 8, 4, "mast", 2, balance=[1, 1, 2, 4], split_backward=True)
    assert ", stage weights " in plan.order
    timed = costs_from_plan(plan, plan.flops_per_second, 1.0)
    unweighted = min(simulate.simulate("mast", 4, 2, timed, IDEAL, split=True, order=str(v)).step_time
                     for _, v in search.qualified("mast", 4, 2, True))
    assert predicted_step(plan) < unweighted * (1 - 1e-3)
    results = run_loopback("transparency", "mast", 4, 2, 1, steps=2, split=True, order=plan.order)
    lists = sch.schedule("mast", 4, 2, split=True, order=plan.order)
    assert [r.computed for r in results] == [[(a.op, a.replica, a.micro, a.stage) for a in actions
                                              if a.op in sch.COMPUTE] for actions in lists]


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_stage_weights_make_complete_deadlock_free_orders_within_the_memory_bound(data):
    """Whatever weights a plan names (1..16 per stage), every candidate that qualifies is a complete,
    deadlock-free step within mast's bound of micro-batches alive, and builds again from its text."""
    K = data.draw(st.integers(2, 6), label="K")
    m = data.draw(st.sampled_from([1, 2, 3, 4]), label="m")
    split = data.draw(st.booleans(), label="split")
    weights = tuple(data.draw(st.lists(st.integers(1, search.MAX_WEIGHT), min_size=K, max_size=K), label="weights"))
    for made, v in search.qualified("mast", K, m, split, weights):
        lists = sch.schedule("mast", K, m, split=split, order=str(v))
        validate("mast", K, m, lists)
        peak = max(max(sum(live.values()) for _, live, *_ in sch.moments(actions)) for actions in lists)
        assert peak <= search.memory_bound(K, m)
