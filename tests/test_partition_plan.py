"""gems.partition.plan(): validation, what a plan holds, JSON round trip, memory budgets."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from gems.errors import GemsError
from gems.graph import graph_units
from gems.models import build
from gems.partition import CostModel, Plan, plan, profile, solve
from gems.partition.accuracy import toy_model
from gems.partition.costs import memory_floor
from gems.schedule.generators import holds, in_flight, schedule
from gems.schedule.generators import moments as moments_of
from gems.units import format_size

SHAPE = (3, 32, 32)


def test_mast_plan_holds_what_the_engine_needs():
    model = toy_model()
    p = plan(model, SHAPE, batch_size=4, stages=3, schedule="mast", micro_batches=2, model_name="toy")
    n = len(model)
    assert p.stages == 3 and p.schedule == "mast" and p.micro_batches == 2 and p.micro_batch_size == 1
    assert p.cuts[0] == 0 and p.cuts[-1] == n and len(p.cuts) == 4 and sum(p.balance) == n
    assert p.input_shape == SHAPE
    # Every stage's output shapes are those of its last unit, without the batch dim.
    x = torch.randn(2, *SHAPE)
    outputs = []
    for unit in model:
        x = unit(x)
        outputs.append(x)
    for s in range(3):
        out = outputs[p.cuts[s + 1] - 1]
        out = out if isinstance(out, tuple) else (out,)
        assert p.stage_output_shapes[s] == [tuple(t.shape[1:]) for t in out]
        assert p.stage_output_dtypes[s] == ["float32"] * len(out)
    flights, lists = in_flight("mast", 3, 2), schedule("mast", 3, 2)
    for pos in p.positions:
        assert pos.stages == holds("mast", 3, pos.position)
        # in flight at the peak moment, never more than the most at once
        assert all(0 <= pos.in_flight[s] <= flights[pos.position][s] for s in pos.stages)
        static = sum(p.stage_estimates[s].static_bytes for s in pos.stages)
        acts = sum(pos.in_flight[s] * p.stage_estimates[s].activation_bytes for s in pos.stages)
        assert pos.peak_bytes == static + acts + pos.transient_bytes + pos.send_bytes
        moments = [sum(n * p.stage_estimates[s].activation_bytes for s, n in live.items())
                   + p.stage_estimates[stage].transient_bytes for stage, live, *_ in moments_of(lists[pos.position])]
        assert pos.peak_bytes == static + max(moments) + pos.send_bytes
        # message buffers (sends still under way, receives posted ahead): at least one sent
        # activation, at most every message of a step (activations and gradients, 2 micro-batches,
        # 2 replicas) sent or received
        sent = [b for s in pos.stages for _, b in p.stage_estimates[s].sends]
        received = sum(p.stage_estimates[s].input_bytes for s in pos.stages)
        assert (min(sent) if sent else 0) <= pos.send_bytes <= 2 * 2 * 2 * (sum(sent) + received)
    middle = p.positions[1]
    assert middle.stages == [1] and middle.in_flight[1] == flights[1][1]   # one shared copy
    assert p.imbalance >= 1.0 and p.fits is None
    assert "imbalance" in p.table() and "position" in p.table()


@pytest.mark.parametrize("schedule", ["mp", "gpipe", "1f1b", "mast"])
def test_every_schedule_and_objective(schedule):
    for balance_by in ("memory", "time", "flops"):
        p = plan(toy_model(), SHAPE, batch_size=4, stages=2, schedule=schedule, balance_by=balance_by)
        assert len(p.positions) == 2 and p.load_unit in ("B", "FLOP")
    timed = plan(toy_model(), SHAPE, 4, 2, schedule, balance_by="time", unit_times=[1.0] * 10 + [100.0])
    assert timed.load_unit == "s" and timed.cuts[1] >= 1


def test_plain_memory_plan_is_balanced():
    model = build("preact-resnet", depth=29, num_classes=10)
    p = plan(model, (3, 64, 64), 2, 4, schedule="gpipe", balance_by="memory")
    assert p.imbalance < 1.5
    q = plan(model, (3, 64, 64), 2, 4, schedule="mast", balance_by="memory")
    assert q.imbalance < 1.5
    assert q.positions[0].stages == [0, 3] and q.positions[1].stages == [1, 2]


def test_manual_balance():
    p = plan(toy_model(), SHAPE, 2, 3, schedule="1f1b", balance=[2, 4, 5])
    assert p.cuts == [0, 2, 6, 11] and p.balance == [2, 4, 5]


def test_json_round_trip(tmp_path):
    p = plan(toy_model(), SHAPE, 4, 3, schedule="mast", memory_budget="1GiB", model_name="toy")
    path = tmp_path / "plan.json"
    text = p.to_json(path)
    assert path.read_text() == text and json.loads(text)["cuts"] == p.cuts
    for source in (path, str(path), text):
        q = Plan.from_json(source)
        assert q == p
        assert isinstance(q.input_shape, tuple) and isinstance(q.stage_output_shapes[0][0], tuple)
        assert all(isinstance(k, int) for pos in q.positions for k in pos.in_flight)
    assert q.table() == p.table()


def test_bad_plan_json(tmp_path):
    with pytest.raises(GemsError, match="cannot read plan file"):
        Plan.from_json(tmp_path / "missing.json")
    with pytest.raises(GemsError, match="not valid"):
        Plan.from_json('{"cuts": [0, 1]}')
    data = json.loads(plan(toy_model(), SHAPE, 2, 2, schedule="mast").to_json())
    data["cuts"] = [0, 5, 5, 11]
    with pytest.raises(GemsError, match="non-empty stages"):
        Plan.from_json(json.dumps(data))
    data = json.loads(plan(toy_model(), SHAPE, 2, 2, schedule="mast").to_json())
    data["stage_estimates"][1]["unit_names"] = []   # once made the plan's table raise IndexError
    with pytest.raises(GemsError, match="estimate of stage 1 is not of its units"):
        Plan.from_json(json.dumps(data))


def test_positions_peak_at_a_moment_not_at_the_sum_of_maxima():
    """mast: a position's two stages are not at their most in flight at once; the plan prices
    each moment of the schedule and so never exceeds the solver's bound, and here beats it."""
    p = plan(toy_model(), SHAPE, 8, 4, "mast", 2)
    flights, below = in_flight("mast", 4, 2), 0
    for pos in p.positions:
        est = p.stage_estimates
        bound = (sum(est[s].static_bytes + flights[pos.position][s] * est[s].activation_bytes for s in pos.stages)
                 + max(est[s].transient_bytes for s in pos.stages))
        assert pos.peak_bytes - pos.send_bytes <= bound
        below += pos.peak_bytes - pos.send_bytes < bound
    assert below


def test_memory_budget():
    roomy = plan(toy_model(), SHAPE, 2, 2, memory_budget=2**30)
    assert roomy.fits is True and roomy.smallest_fitting_stages is None and "fits" in roomy.table()
    peak2 = roomy.peak_bytes
    peak4 = plan(toy_model(), SHAPE, 2, 4).peak_bytes
    assert peak4 < peak2
    tight = plan(toy_model(), SHAPE, 2, 2, memory_budget=peak4)
    assert tight.fits is False and 2 < tight.smallest_fitting_stages <= 4
    assert "does not fit" in tight.table()
    with pytest.raises(GemsError, match="no number of stages fits .* however it is cut, the position holding unit "
                                        r"\w+ needs at least .* over the budget"):
        plan(toy_model(), SHAPE, 2, 2, memory_budget="1KiB")


def test_no_stage_count_fits_names_the_least_peak():
    prof = profile(toy_model(), SHAPE, 1)
    floor, _ = memory_floor(prof)
    n = len(prof)
    least = min(solve(n, k, *CostModel(prof, "mast", k, 1).objective("memory")[:2], mirror=True).value
                for k in range(2, n + 1))
    assert floor < least    # a budget in between passes the cheap test but fits no stage count
    with pytest.raises(GemsError, match=f"smallest possible peak is {format_size(least)}"):
        plan(toy_model(), SHAPE, 2, 2, memory_budget=int(floor) + 1)


@pytest.mark.parametrize("kwargs, message", [
    ({"stages": 0}, "positive integer"),
    ({"stages": 12}, "11 units, so it cannot be cut into 12 stages: use at most 11"),
    ({"stages": 2, "balance": [5, 5]}, "sum to 11"),
    ({"stages": 2, "balance": [11]}, "1 entries but there are 2 stages"),
    ({"stages": 2, "balance": [0, 11]}, "positive unit counts"),
    ({"stages": 2, "batch_size": 3}, "does not split into 1 group.* x 2 replica.* use a multiple of 2"),
    ({"stages": 2, "batch_size": 4, "micro_batches": 3, "schedule": "gpipe"}, "multiple of 3"),
    ({"stages": 2, "groups": 2, "batch_size": 2}, "multiple of 4"),
    ({"stages": 2, "schedule": "zigzag"}, "unknown schedule"),
    ({"stages": 2, "balance_by": "luck"}, "cannot balance by 'luck'"),
    ({"stages": 2, "optimizer": "lion"}, "unknown optimizer"),
    ({"stages": 2, "memory_budget": "40GB?"}, "40GiB"),
    ({"stages": 2, "memory_budget": 0}, "positive"),
    ({"stages": 2, "dtype": torch.int32}, "unsupported dtype"),
    ({"stages": 2, "input_shape": (3, 0, 4)}, "input shape"),
    ({"stages": 2, "unit_times": [1.0]}, "one non-negative time per unit"),
])
def test_bad_input_names_the_fix(kwargs, message):
    args = {"input_shape": SHAPE, "batch_size": 2, **kwargs}
    with pytest.raises(GemsError, match=message):
        plan(toy_model(), **args)


def test_bad_model():
    with pytest.raises(GemsError, match="the model must be an nn.Module, got function"):
        plan(lambda x: x, (2,), 2, 1)
    assert plan(nn.Linear(2, 2), (2,), 2, 1, schedule="mp").unit_names == ["linear"]   # any module plans
    with pytest.raises(GemsError, match="has 1 units, so it cannot be cut into 2 stages"):
        plan(nn.Linear(2, 2), (2,), 2, 2, schedule="mp")
    with pytest.raises(GemsError, match="cannot take 3x4x4 input"):
        plan(build("resnet18", num_classes=10), (3, 4, 4), 2, 2)



def test_equal_loads_are_cut_where_the_least_crosses():
    """Under mast K = 2 both positions hold both stages, so many cuts load them (almost) alike:
    the planner takes the one with the smallest boundary, not the first it meets (after conv1)."""
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(num_classes=10)
    p = plan(model, (3, 64, 64), 2, 2, "mast", 1)
    crossing = profile(graph_units(model, (3, 64, 64), 1), (3, 64, 64), 1).boundary_bytes()[1:-1]
    assert p.stage_estimates[0].output_bytes <= crossing.min() + 32   # one packed message: header, alignment
