"""Offload (gems.pipeline.stage): the copy back starts one compute action ahead of its backward,
an in-place write after autograd saved a tensor stops with a sentence, and host memory comes
from a bounded, counted pool that is reused; the planner prices what that pool holds.

All on CPU: offload copies every saved tensor to a separate host tensor and back there too
(unpinned), so the bookkeeping and the math run; the CUDA streams and events do not.
"""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn

import gems
from gems import partition
from gems.comm import loopback
from gems.errors import GemsError
from gems.partition import Plan, profile
from gems.partition.costs import CostModel, host_moments, unit_seconds
from gems.partition.policy import PolicyModel
from gems.pipeline.executor import Executor
from gems.pipeline.offload import HostPool, _Offload
from gems.pipeline.stage import StageRunner
from gems.plan import StagePolicy
from gems.schedule import generators as sch
from gems.schedule.generators import prefetch_points

from test_policies import ROWS, SIDE, SoloComm, plain

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")
OFFLOAD = StagePolicy(offload=True)


def compute(actions, picked) -> list[str]:
    """``F d0.s0``-style names of the compute actions at the indices ``picked`` maps, with its value."""
    return [f"{a.op[0].upper()} {sch.REPLICA_NAMES[a.replica]}{a.micro}.s{a.stage} -> {picked[i]}"
            for i, a in enumerate(actions) if i in picked]


# ---------------------------------------------------------------- prefetch one compute action ahead
def test_prefetch_points_are_the_compute_action_before_a_waiting_forwards_backward():
    gpipe = sch.schedule("gpipe", 1, 3)[0]                          # F0 F1 F2 B0 B1 B2
    assert compute(gpipe, prefetch_points(gpipe)) == ["F d2.s0 -> (0, 0, 0)", "B d0.s0 -> (0, 1, 0)",
                                                      "B d1.s0 -> (0, 2, 0)"]
    mast = sch.schedule("mast", 2, 1)[0]                             # F d0.s0  F u0.s1  B u0.s1  B d0.s0
    assert compute(mast, prefetch_points(mast)) == ["B u0.s1 -> (0, 0, 0)"]
    assert prefetch_points(sch.schedule("1f1b", 2, 2)[1]) == {}      # F0 B0 F1 B1: every forward immediate


def test_engine_prefetches_one_compute_action_ahead(monkeypatch):
    events: list[str] = []
    for cls, name, label in ((Executor, "_forward", "F"), (Executor, "_backward", "B")):
        original = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, a, original=original, label=label:
                            (events.append(f"{label}{a.micro}"), original(self, a))[1])
    prefetch = StageRunner.prefetch
    monkeypatch.setattr(StageRunner, "prefetch",
                        lambda self, key: (events.append(f"P{key[1]}"), prefetch(self, key))[1])
    offloaded = train(OFFLOAD, "gpipe", 3, steps=1)
    assert " ".join(events) == "F0 F1 P0 F2 P1 B0 P2 B1 B2"
    assert offloaded["pool"].held_bytes == 0 and not offloaded["engine"].runners[0].offload.saved
    events.clear()
    reference = train(StagePolicy(), "gpipe", 3, steps=1)
    for k, v in reference["state"].items():
        assert torch.allclose(offloaded["state"][k], v, rtol=1e-5, atol=1e-7), k


def test_prefetch_twice_does_nothing():
    offload = _Offload(nn.Identity(), CPU, HostPool())
    x = torch.randn(ROWS, 8, SIDE, SIDE, requires_grad=True)
    with offload.saving((0, 0, 0), ()):
        y = x.sigmoid()                                              # saves its output
    (item,) = offload.saved[(0, 0, 0)]
    offload.prefetch((0, 0, 0))
    back = item.device
    assert item.host is None and offload.pool.held_bytes == 0
    offload.prefetch((0, 0, 0))
    assert item.device is back and offload.pool.held_bytes == 0
    y.sum().backward()
    assert torch.allclose(x.grad, (y * (1 - y)).detach())


# ---------------------------------------------------------------- in-place writes after the pack
def test_in_place_write_after_the_pack_is_caught_at_unpack():
    offload = _Offload(nn.Identity(), CPU, HostPool())
    x = torch.randn(ROWS, 8, SIDE, SIDE, requires_grad=True)
    with offload.saving((0, 0, 2), ()):
        y = x.sigmoid()
    y.add_(1.0)                       # sigmoid's backward reads y: autograd alone would raise here
    with pytest.raises(GemsError, match=r"a module of stage 2 modified a tensor in place after autograd saved it "
                                        r".*use inplace=False there or exclude stage 2 from offload"):
        y.sum().backward()


def test_in_place_activation_after_an_offloaded_output_is_caught_in_the_forward():
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Sigmoid(), nn.ReLU(inplace=True),
                          nn.Conv2d(8, 8, 3, padding=1))
    runner = StageRunner(stage, 0, OFFLOAD, CPU)
    x = torch.randn(ROWS, 8, SIDE, SIDE, requires_grad=True)
    with pytest.raises(GemsError, match="stage 1 modified a tensor in place.*nn.ReLU"):
        runner.forward((x,), (0, 0, 1), waiting=True)


def test_in_place_activation_on_an_unsaved_tensor_is_fine():
    """BatchNorm then ReLU(inplace=True), as ResNets write it: BatchNorm saves its input, not
    the output that ReLU overwrites, so offloading changes nothing."""
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.Conv2d(8, 8, 3, padding=1))
    x = torch.randn(ROWS, 8, SIDE, SIDE, requires_grad=True)
    runner = StageRunner(stage, 0, OFFLOAD, CPU)
    (y,) = runner.forward((x,), (0, 0, 0), waiting=True)
    assert runner.offload.bytes > 0
    runner.prefetch((0, 0, 0))
    y.sum().backward()
    ref = x.detach().clone().requires_grad_(True)
    stage(ref).sum().backward()
    assert torch.allclose(x.grad, ref.grad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the host pool
def test_pool_reuses_buffers_and_counts_bytes():
    pool = HostPool(limit=4096)
    a, done = pool.take(1024)
    b, _ = pool.take(1024)
    assert done is None and (pool.held_bytes, pool.pooled_bytes) == (2048, 2048)
    pool.give(a)
    again, _ = pool.take(1024)
    assert again.data_ptr() == a.data_ptr() and pool.pooled_bytes == 2048   # reused, not allocated
    pool.give(again)
    pool.give(b)
    assert (pool.held_bytes, pool.peak_bytes) == (0, 2048)


def test_pool_over_its_bound_falls_back_to_unpinned_memory_with_one_warning():
    pool = HostPool(limit=3000)
    kept, _ = pool.take(2048)
    with pytest.warns(RuntimeWarning, match="host pool is full"):
        over, _ = pool.take(2048)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again, _ = pool.take(2048)                                  # no second warning
    assert (pool.pooled_bytes, pool.held_bytes, pool.peak_bytes) == (2048, 3 * 2048, 3 * 2048)
    pool.give(over)
    pool.give(again)
    pool.give(kept)
    assert pool.held_bytes == 0 and pool.pooled_bytes == 2048      # fallback buffers are not kept
    assert pool.take(2048)[0].data_ptr() == kept.data_ptr()


def test_engine_reuses_the_pool_across_micro_batches_and_steps_within_the_planned_bound():
    run = train(OFFLOAD, "gpipe", 3, steps=1)
    pool = run["pool"]
    pinned = pool.pooled_bytes
    step = torch.Generator().manual_seed(5)
    run["engine"].step(torch.randn(3 * ROWS, 3, SIDE, SIDE, generator=step), torch.randint(0, 5, (3 * ROWS,)))
    assert pool.held_bytes == 0 and pool.pooled_bytes == pinned     # the second step allocated nothing
    # F0 F1 F2 B0 B1 B2: micro-batch 0 comes back as F2 begins, so F2 reuses its buffers: two in the pool.
    prof = profile(plain(), (3, SIDE, SIDE), ROWS)
    costs = CostModel(prof, "gpipe", 1, 3, None, PolicyModel(prof, "cuda", *unit_seconds(prof, 1e12)), "offload")
    back = costs.policies.memory(0, len(prof), OFFLOAD).back
    assert pool.peak_bytes == pinned == 2 * back
    assert costs.host_bytes([0, len(prof)], [OFFLOAD]) == [2 * back]   # the last unit's output is tiny


# ---------------------------------------------------------------- what the planner counts
def test_host_moments_follow_the_prefetch():
    assert host_moments(sch.schedule("gpipe", 1, 3)[0]) == [(0, {}), (0, {0: 1}), (None, {0: 1}), (None, {})]
    # F d0.s0 (waits)  F u0.s1 (immediate)  B u0.s1  B d0.s0: d0.s0 comes back as B u0.s1 begins.
    assert host_moments(sch.schedule("mast", 2, 1)[0]) == [(0, {}), (None, {0: 1}), (None, {})]
    assert host_moments(sch.schedule("mp", 2, 1)[1]) == [(None, {})]


@pytest.mark.parametrize("schedule,m,recompute,batchnorm", [("mast", 2, "none", True), ("gpipe", 3, "all", False),
                                                           ("1f1b", 4, "none", True)])
def test_planned_host_bytes_are_what_each_rank_pool_holds_at_its_peak(schedule, m, recompute, batchnorm):
    """K = 2 on loopback ranks, the engine's one pool per rank shared by its stages (mast: two),
    bounded by the plan's figure: that figure is the pool's measured peak, to the byte, and the
    pool never allocates past it (no unpinned fallback)."""
    model = functools.partial(plain, batchnorm)
    batch = ROWS * m * sch.replicas(schedule)
    p = partition.plan(model(), input_shape=(3, SIDE, SIDE), batch_size=batch, stages=2, schedule=schedule,
                       micro_batches=m, recompute=recompute, offload="all")
    prof = profile(model(), (3, SIDE, SIDE), ROWS)
    prices = PolicyModel(prof, "cuda", *unit_seconds(prof, 1e12))
    planned = CostModel(prof, schedule, 2, m, None, prices, p.policies[0].kind).host_bytes(p.cuts, p.policies)

    def rank(comm) -> tuple[int, int, int]:
        engine = gems.Engine(model(), copy.deepcopy(p), optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
                             loss_fn=nn.CrossEntropyLoss(), comm=comm)
        pool = engine.host_pool
        assert pool.limit == p.host_bytes[engine.position]
        assert all(runner.offload.pool is pool for runner in engine.runners.values())
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            engine.step(torch.randn(batch, 3, SIDE, SIDE, generator=g), torch.randint(0, 5, (batch,), generator=g))
        assert pool.pooled_bytes <= pool.limit
        return engine.position, pool.peak_bytes, pool.held_bytes

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # the pool's fallback warns
        measured = sorted(loopback.run(2, rank))
    assert p.host_bytes == planned
    assert [peak for _, peak, _ in measured] == planned and max(planned) > 0
    assert all(held == 0 for _, _, held in measured)


def test_host_bytes_appear_in_the_plan_only_with_offload():
    p = partition.plan(plain(), input_shape=(3, SIDE, SIDE), batch_size=2 * ROWS, stages=1, schedule="gpipe",
                       micro_batches=2)
    assert p.host_bytes == [] and "host_bytes" not in p.to_json() and "host (offload)" not in p.table()
    p.policies, p.host_bytes = [OFFLOAD], [3 * 2**20]
    assert Plan.from_json(p.to_json()).host_bytes == [3 * 2**20]
    assert "host (offload)" in p.table() and "3.00 MiB" in p.table()
    p.host_bytes = [1, 2]
    with pytest.raises(GemsError, match="2 host memory figures for 1 positions"):
        p.check()


# ---------------------------------------------------------------- helpers
def train(policy: StagePolicy, schedule: str, m: int, steps: int) -> dict:
    """Train ``plain`` with K = 1 in process under ``policy``; its state, engine and host pool."""
    plan = partition.plan(plain(), input_shape=(3, SIDE, SIDE), batch_size=ROWS * m * sch.replicas(schedule),
                          stages=1, schedule=schedule, micro_batches=m)
    plan.policies = [policy]
    torch.manual_seed(1)   # dropout masks: the same in every run
    engine = gems.Engine(plain(), plan, optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
                         loss_fn=nn.CrossEntropyLoss(), comm=SoloComm())
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        engine.step(torch.randn(plan.batch_size, 3, SIDE, SIDE, generator=g),
                    torch.randint(0, 5, (plan.batch_size,), generator=g))
    offload = engine.runners[0].offload
    return {"state": engine.state_dict(), "engine": engine, "pool": offload.pool if offload else None}
