"""Gradient sync overlapped with backward: each stage's reduce starts once its last backward on
the position is done, mirror partners start theirs in one order, the engine trains like one
process either way (overlapped, or started at the sync as over NCCL), and the simulator counts
only what the backward does not hide."""
from __future__ import annotations

import math

import pytest

from gems.comm.loopback import LoopbackComm
from gems.schedule import generators as sch, ir, simulate
from gems.schedule.network import Network
from gems.schedule.validate import validate

from equivalence import run_loopback

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_stage_reduce_follows_its_last_backward_and_its_sends():
    ops = [str(a) for a in sch.schedule("mast", 2, 1)[0]]
    assert ops[ops.index("backward u0.s1") + 1:ops.index("backward d0.s0")] == \
        ["send_grad u0.s1 @1", "reduce s1", "recv_grad d0.s0 @1"]
    assert ops[-3:] == ["reduce s0", "sync", "step"]


def test_mirror_partners_start_reduces_in_one_order_even_when_they_finish_in_another():
    lists = sch.schedule("mast", 4, 2, split=True)
    reduces = [[a.stage for a in actions if a.op == ir.REDUCE] for actions in lists]
    assert reduces[1] == reduces[2] == [1, 2] and reduces[0] == reduces[3] == [3, 0]
    # position 2 is done with stage 2 before stage 1, yet waits for stage 1's reduce
    last = {s: max(i for i, a in enumerate(lists[2]) if a.op == ir.BACKWARD_WEIGHT and a.stage == s) for s in (1, 2)}
    assert last[2] < last[1]


def test_the_validator_refuses_reduces_out_of_order_or_too_early():
    lists = sch.schedule("mast", 2, 1)
    swapped = [list(actions) for actions in lists]
    i, j = [k for k, a in enumerate(swapped[0]) if a.op == ir.REDUCE]
    swapped[0][i], swapped[0][j] = swapped[0][j], swapped[0][i]
    with pytest.raises(ValueError):
        validate("mast", 2, 1, swapped)
    early = [list(actions) for actions in lists]
    early[1].insert(0, early[1].pop(next(k for k, a in enumerate(early[1]) if a.op == ir.REDUCE)))
    with pytest.raises(ValueError, match="before backward"):
        validate("mast", 2, 1, early)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("schedule,K,m,D", [("mast", 2, 2, 2), ("mast", 3, 1, 2)])
def test_reduces_started_at_the_sync_train_like_one_process(schedule, K, m, D, monkeypatch):
    """As over NCCL; the overlapped reduces are what every test_equivalence layout runs."""
    monkeypatch.setattr(LoopbackComm, "overlaps_collectives", False)
    run_loopback("transparency", schedule, K, m, D, steps=2)


@pytest.mark.timeout(60)
def test_batchnorm_statistics_ride_along_per_stage():
    run_loopback("batchnorm", "mast", 4, 1, 1, steps=2)


def test_the_simulator_hides_a_reduce_behind_the_other_stage_backward():
    # mast K=2 m=1, forward 1, backward 2: position 0 runs B u.s1 in [2, 4], B d.s0 in [4, 6];
    # stage 1's reduce (1.5 s) runs in [4, 5.5] behind B d.s0, stage 0's (1 s) in [6, 7]
    # (a ring on 2 ranks moves 2 (n-1)/n B = B bytes: stage 0's 2 B take 1 s, stage 1's 3 B 1.5 s)
    net = Network(latency=0.0, bandwidth=2.0)
    costs = simulate.Costs(forward=[1.0, 1.0], backward=[2.0, 2.0], boundary_bytes=[0, 0], param_bytes=[2, 3])
    result = simulate.simulate("mast", 2, 1, costs, net)
    assert math.isclose(result.step_time, 7.0)   # after the backward, only stage 0's reduce is left (1 s)
