"""The simulator against hand-computed timelines and closed forms, on the schedule's own lists."""
import math
import random

import pytest

from gems.errors import GemsError
from gems.plan import StageEstimate
from gems.schedule import generators as sch
from gems.schedule.network import IDEAL, Network
from gems.schedule.simulate import Costs, costs_from_plan, simulate
from gems.schedule.sweep import scaling, sweep


def equal(K, f=1.0, b=2.0, boundary=0, activation=None, params=None):
    return Costs(forward=[f] * K, backward=[b] * K, boundary_bytes=[boundary] * K,
                 activation_bytes=activation, param_bytes=params)


@pytest.mark.parametrize("K", [1, 2, 3, 5])
def test_mp_bubble_is_one_minus_one_over_k(K):
    r = simulate("mp", K, 1, equal(K), IDEAL)
    assert r.step_time == pytest.approx(3.0 * K)
    assert r.bubble_fraction == pytest.approx(1 - 1 / K)
    assert r.busy == pytest.approx([3.0] * K)


@pytest.mark.parametrize("K,m", [(2, 1), (2, 4), (4, 1), (4, 3), (4, 8), (6, 5)])
def test_gpipe_matches_the_textbook_bubble(K, m):
    r = simulate("gpipe", K, m, equal(K), IDEAL)
    assert r.step_time == pytest.approx((m + K - 1) * 3.0)
    assert r.bubble_fraction == pytest.approx((K - 1) / (m + K - 1))


def test_mast_k2_fills_the_bubble():
    # Hand timeline (module docstring): both positions F, F, B, B back to back, so the step
    # takes 2 (f + b) -- two micro-batches in the time mp needs for one on K = 2 -- with no bubble.
    f, b = 0.5, 1.0
    r = simulate("mast", 2, 1, equal(2, f, b), IDEAL)
    assert r.step_time == pytest.approx(2 * (f + b))
    assert abs(r.bubble_fraction) < 1e-12
    assert r.timeline[0] == [(0.0, 0.5, "forward d0.s0"), (0.5, 1.0, "forward u0.s1"),
                             (1.0, 2.0, "backward u0.s1"), (2.0, 3.0, "backward d0.s0"),
                             (3.0, 3.0, "sync"), (3.0, 3.0, "step")]
    mp = simulate("mp", 2, 1, equal(2, f, b), IDEAL)
    assert r.throughput() == pytest.approx(2 * mp.throughput())


def test_a_sharded_optimizer_steps_a_share_then_exchanges_the_parameters():
    """mast K = 2, D = 2: each stage syncs over 4 ranks; sharded, its gradients are reduce-scattered
    (half a ring allreduce), and a position's step is a quarter of the optimizer's time plus an
    allgather of the parameters it holds (each value crosses once)."""
    net = Network(latency=1e-3, bandwidth=1e6)
    costs = equal(2, params=[2e6, 2e6])
    sharded = simulate("mast", 2, 1, costs, net, groups=2, optimizer_time=0.8, shard=True)
    exchange = (2 * 3 / 4 * 4e6 / 1e6 + 2 * 3 * 1e-3) / 2   # both stages' parameters on each position
    scatter = 3 / 4 * 2e6 / 1e6 + 3 * 1e-3                 # stage 0's, after the last backward
    spans = {label: (s, e) for s, e, label in sharded.timeline[0]}
    assert spans["sync"][1] - spans["backward d0.s0"][1] == pytest.approx(scatter)
    assert spans["step"][1] - spans["step"][0] == pytest.approx(0.2 + exchange)


@pytest.mark.parametrize("name", sch.SCHEDULES)
@pytest.mark.parametrize("K", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_peak_activations_match_in_flight(name, K, m):
    if name == "mp" and m > 1:
        return
    activation = [1000 * (s + 1) for s in range(K)]
    r = simulate(name, K, m, equal(K, activation=activation), IDEAL)
    for p, counts in enumerate(sch.in_flight(name, K, m)):
        bound = sum(c * activation[s] for s, c in counts.items())
        if len(counts) == 1:
            assert r.peak_activation_bytes[p] == bound
        else:   # in_flight sums per-stage maxima: an upper bound
            assert max(c * activation[s] for s, c in counts.items()) <= r.peak_activation_bytes[p] <= bound


def test_messages_on_one_link_queue():
    # gpipe K=2 m=2, free compute: two 1 GB activations share link 0->1 at 1 GB/s plus 0.1 s latency.
    costs = Costs(forward=[0.0, 0.0], backward=[0.0, 0.0], boundary_bytes=[10**9, 0])
    r = simulate("gpipe", 2, 2, costs, Network(latency=0.1, bandwidth=1e9))
    starts = [start for start, _, label in r.timeline[1] if label.startswith("forward")]
    assert starts == pytest.approx([1.1, 2.1])


def test_sync_is_an_allreduce_over_the_sync_group():
    zero = Costs(forward=[0.0] * 4, backward=[0.0] * 4, boundary_bytes=[0] * 4, param_bytes=[10**9] * 4)
    ring, tree = Network(latency=0.0, bandwidth=1e9), Network(latency=0.0, bandwidth=1e9, allreduce="tree")
    # mast K=4 D=2: mirror groups of 4 ranks, each holding 2 stages = 2 GB of gradients
    assert simulate("mast", 4, 1, zero, ring, groups=2).step_time == pytest.approx(2 * 3 / 4 * 2.0)
    assert simulate("mast", 4, 1, zero, tree, groups=2).step_time == pytest.approx(2 * 2 * 2.0)
    assert simulate("1f1b", 4, 1, zero, ring, groups=2).step_time == pytest.approx(1.0)
    assert simulate("1f1b", 4, 1, zero, ring, groups=1).step_time == 0.0
    assert simulate("mp", 1, 1, Costs([1.0], [2.0], [0]), ring, optimizer_time=0.5).step_time == 3.5


def test_additions_cost_time_at_the_reduce_bandwidth_and_allgathers_add_nothing():
    """A CPU rank adds (n-1)/n of the bytes in a ring (ceil(log2 n) times them in a tree) at
    ``reduce_bandwidth``; a sharded optimizer's allgather is the ring's half without additions."""
    zero = Costs(forward=[0.0] * 4, backward=[0.0] * 4, boundary_bytes=[0] * 4, param_bytes=[10**9] * 4)
    for allreduce, added in [("ring", 3 / 4 * 2.0), ("tree", 2 * 2.0)]:
        free = Network(latency=0.0, bandwidth=1e9, allreduce=allreduce)
        adding = Network(latency=0.0, bandwidth=1e9, allreduce=allreduce, reduce_bandwidth=0.5e9)
        gap = simulate("mast", 4, 1, zero, adding, groups=2).step_time - simulate("mast", 4, 1, zero, free,
                                                                                  groups=2).step_time
        assert gap == pytest.approx(added / 0.5)
        assert adding.allgather_time(2e9, 4, 0.0, 1e9) == pytest.approx(free.allreduce_time(2e9, 4, 0.0, 1e9) / 2)
    sharded = Network(latency=0.0, bandwidth=1e9, reduce_bandwidth=0.5e9)
    step = simulate("mast", 4, 1, zero, sharded, groups=2, optimizer_time=0.0, shard=True).timeline[0][-1]
    assert step[1] - step[0] == pytest.approx(3 / 4 * 2.0)   # the exchange: an allgather, no additions


def test_collectives_move_their_pieces_at_the_collective_bandwidth():
    """gems-bench measures how fast a collective moves large buffers (slower than a ping-pong on
    CPU ranks); the sync's allreduce and a sharded step's exchange move at it, messages do not."""
    zero = Costs(forward=[0.0] * 4, backward=[0.0] * 4, boundary_bytes=[0] * 4, param_bytes=[10**9] * 4)
    fast, slow = Network(latency=0.0, bandwidth=1e9), Network(latency=0.0, bandwidth=1e9, collective_bandwidth=0.25e9)
    assert slow.collective(1e9) == 0.25e9 and Network(collective_bandwidth=1e12).collective(1e9) == 1e9
    assert simulate("mast", 4, 1, zero, slow, groups=2).step_time - simulate(
        "mast", 4, 1, zero, fast, groups=2).step_time == pytest.approx(3 * 2 * 3 / 4 * 2.0)   # 4x the ring's time
    step = simulate("mast", 4, 1, zero, slow, groups=2, shard=True).timeline[0][-1]
    assert step[1] - step[0] == pytest.approx(4 * 3 / 4 * 2.0)
    one = Costs(forward=[0.0] * 2, backward=[0.0] * 2, boundary_bytes=[10**9] * 2)
    assert simulate("mp", 2, 1, one, slow).step_time == simulate("mp", 2, 1, one, fast).step_time == pytest.approx(2.0)


def test_rings_leaving_a_node_share_its_network_link():
    # mast K=4 on 4-GPU nodes, D=2: both mirror rings leave every node, so each gets half the link
    zero = Costs(forward=[0.0] * 4, backward=[0.0] * 4, boundary_bytes=[0] * 4, param_bytes=[10**9] * 4)
    net = Network(latency=0.0, bandwidth=1e9, ranks_per_node=4, intra_bandwidth=1e12)
    assert simulate("mast", 4, 1, zero, net, groups=1).step_time == pytest.approx(2 * 1 / 2 * 2.0 / 1e3)
    assert simulate("mast", 4, 1, zero, net, groups=2).step_time == pytest.approx(2 * 3 / 4 * 2.0 / 0.5)


def random_costs(K, rng):
    return Costs(forward=[rng.uniform(0.5, 2) for _ in range(K)], backward=[rng.uniform(1, 4) for _ in range(K)],
                 boundary_bytes=[rng.randrange(10**6, 10**9) for _ in range(K)],
                 param_bytes=[rng.randrange(10**6, 10**8) for _ in range(K)])


def test_a_faster_network_never_slows_a_step():
    rng = random.Random(0)
    networks = [Network(latency=lat, bandwidth=bw, allreduce=algo, ranks_per_node=4, intra_bandwidth=bw * 10)
                for algo in ("ring", "tree") for lat, bw in [(1e-3, 1e8), (1e-4, 1e9), (1e-5, 1e10), (0.0, math.inf)]]
    for name in sch.SCHEDULES:
        for K, m, D in [(2, 1, 1), (3, 2, 2), (4, 3, 3), (5, 2, 2)]:
            m = 1 if name == "mp" else m
            costs = random_costs(K, rng)
            for algo in range(2):
                times = [simulate(name, K, m, costs, n, D).step_time for n in networks[4 * algo: 4 * algo + 4]]
                assert times == sorted(times, reverse=True), (name, K, m, D)


@pytest.mark.parametrize("name", sch.SCHEDULES)
@pytest.mark.parametrize("network", [Network(), Network(allreduce="tree", ranks_per_node=4, intra_bandwidth=1e11)])
def test_weak_scaling_efficiency_falls_with_groups(name, network):
    costs = equal(4, 0.01, 0.02, boundary=10**6, params=[10**7] * 4)
    points = scaling(name, 4, 1, costs, network, [1, 2, 4, 8, 16, 32])
    assert points[0].groups == 1 and points[0].efficiency == 1.0
    efficiencies = [p.efficiency for p in points]
    assert all(a > b for a, b in zip(efficiencies, efficiencies[1:]))
    assert all(0 < e <= 1 for e in efficiencies)


def test_groups_split_across_nodes_pay_the_slow_link():
    # K=3 on 4-GPU nodes: group 1 = ranks 3,4,5 straddles two nodes, so its 3->4 message is slow.
    costs = Costs(forward=[1.0] * 3, backward=[1.0] * 3, boundary_bytes=[10**9] * 3)
    net = Network(latency=0.0, bandwidth=1e9, ranks_per_node=4, intra_bandwidth=math.inf)
    assert simulate("mp", 3, 1, costs, net, groups=1).step_time == pytest.approx(6.0)
    assert simulate("mp", 3, 1, costs, net, groups=2).step_time == pytest.approx(8.0)


def test_deterministic():
    costs = random_costs(4, random.Random(1))
    assert simulate("mast", 4, 3, costs, groups=4) == simulate("mast", 4, 3, costs, groups=4)


def test_costs_from_plan_times_flops_at_the_device_rate():
    def stage(s, flops):
        return StageEstimate(stage=s, first_unit=s, end_unit=s + 1, unit_names=[f"u{s}"], param_bytes=40,
                             grad_bytes=40, optimizer_bytes=0, buffer_bytes=8, activation_bytes=1000,
                             transient_bytes=0, input_bytes=64, output_bytes=64, forward_flops=flops,
                             backward_flops=2 * flops)

    class FakePlan:
        stage_estimates = [stage(0, 10**12), stage(1, 2 * 10**12)]
    costs = costs_from_plan(FakePlan(), device_flops=1e13, efficiency=0.5)
    assert costs.forward == pytest.approx([0.2, 0.4]) and costs.backward == pytest.approx([0.4, 0.8])
    assert costs.boundary_bytes == [64, 64] and costs.static_bytes == [88, 88] and costs.param_bytes == [40, 40]
    with pytest.raises(GemsError):
        costs_from_plan(FakePlan(), efficiency=0.0)


def test_sweep_ranks_fitting_configurations():
    def costs_for(name, K, m, D):
        return equal(K, 1.0 / K, 2.0 / K, activation=[100] * K), 1
    found = sweep(costs_for, world=4, network=IDEAL, stages=(1, 2, 4), micro_batches=(1, 4))
    rates = [c.images_per_second for c in found]
    assert rates == sorted(rates, reverse=True)
    assert all(4 % c.stages == 0 and c.groups == 4 // c.stages for c in found)
    tight = sweep(costs_for, world=4, network=IDEAL, stages=(1, 2, 4), micro_batches=(1, 4), memory_budget=100)
    assert tight and all(c.peak_bytes <= 100 for c in tight) and len(tight) < len(found)
    # A planner's peak (memory policies, working memory), when given, decides instead.
    planned = sweep(lambda name, K, m, D: (*costs_for(name, K, m, D), 10 * K), world=4, network=IDEAL,
                    stages=(1, 2, 4), micro_batches=(1,), memory_budget=20)
    assert {c.stages for c in planned} == {1, 2} and all(c.peak_bytes == 10 * c.stages for c in planned)


def test_a_sweep_counts_the_ranks_of_tile_groups():
    """Layouts with tile groups: D x ranks per group <= world (a tile group of P at every position holding
    stage 0), D the most groups over which the batch splits; tiles grow while no layout fits or while the
    next P keeps D, and stop where they no longer lower the peak. The issue's case: mp K = 8 with tile
    groups of 4 on 16 ranks is one group of 11 ranks, not two (22)."""
    from gems.schedule.sweep import most_groups
    from gems.schedule.topology import ranks_per_group

    asked = []

    def costs_for(name, K, m, D, tiles=1):   # the peak falls with the tiles, for mast K = 1 not below 40
        asked.append((name, K, m, D, tiles))
        floor = 40 if (name, K) == ("mast", 1) else 0
        return equal(K, 1.0 / (K * tiles), 2.0 / (K * tiles)), 1, max(100 // tiles, floor)
    found = sweep(costs_for, 16, IDEAL, schedules=("mp", "mast"), stages=(1, 2, 8, 16), micro_batches=(1,),
                  memory_budget=30, tiles=(1, 2, 4, 8, 16), batch_size=2)
    assert found and all(c.peak_bytes <= 30 for c in found)
    for c in found:
        assert c.ranks == c.groups * ranks_per_group(c.stages, c.schedule, c.tiles) <= 16
        assert c.groups == most_groups(16, ranks_per_group(c.stages, c.schedule, c.tiles), 2,
                                       sch.replicas(c.schedule))
    assert ("mp", 8, 1, 1, 4) in asked and ("mp", 8, 1, 2, 4) not in asked   # 11 ranks: one group
    assert not any(a[1] == 8 and a[4] == 16 for a in asked)                  # 23 ranks: none
    assert {(c.schedule, c.stages, c.tiles, c.groups, c.ranks) for c in found} >= {
        ("mp", 1, 4, 2, 8), ("mp", 8, 4, 1, 11), ("mast", 2, 4, 1, 8)}   # mast: positions 0 and 1 hold stage 0
    # mp K = 1: P = 4 fits with 2 groups; P = 8 keeps them (its ranks were idle), P = 16 would halve them
    assert [a[4] for a in asked if a[:2] == ("mp", 1)] == [1, 2, 4, 8]
    # mast K = 1 (a group is one tile group): 8 tiles no longer lower the peak below 4's, so 16 are not tried
    assert [a[4] for a in asked if a[:2] == ("mast", 1)] == [1, 2, 4, 8]
    assert not any(a[1] == 16 and a[4] > 1 for a in asked)   # 16 positions and a tile group: over 16 ranks
    assert most_groups(16, 11) == 1 and most_groups(16, 4, batch_size=2, parts=1) == 2
    assert most_groups(3, 4) == 0


def test_bad_input_names_the_fix():
    with pytest.raises(GemsError, match="one per stage"):
        simulate("mp", 2, 1, equal(3))
    with pytest.raises(GemsError, match="allreduce"):
        simulate("mp", 2, 1, equal(2), Network(allreduce="butterfly"))
    with pytest.raises(GemsError, match="groups"):
        simulate("mp", 2, 1, equal(2), groups=0)
    with pytest.raises(GemsError, match="unknown schedule"):
        simulate("pipedream", 2, 1, equal(2))
