"""Where model state lives, priced (gems.partition.placement, .swapping): host-optimizer takes the optimizer
state off the device and prices the host copies and the transfers; host keeps the parameters there too, on the
device per weight group, moved once per visit (grouped: per run of a stage's actions); auto brings back to the
device each stage that fits, and uses host only where host-optimizer does not fit; a host budget bounds them;
plans carry the placement through JSON; --calibrate measures the host updates."""
from __future__ import annotations

import pytest

from torch import nn

from gems import models
from gems.errors import GemsError
from gems.partition import OPTIMIZER_STATE, Plan, plan, swapping
from gems.partition.accuracy import toy_model
from gems.partition.calibrate import host_update_rates
from gems.partition.swapping import swap_volume
from gems.schedule import generators as schedules
from gems.schedule.simulate import Costs, simulate
from gems.schedule.visits import group_major, visit_counts

SHAPE = (3, 32, 32)
_PROFILES: dict = {}   # one fake run for every plan here


def _plan(**kw) -> Plan:
    return plan(toy_model(), SHAPE, batch_size=4, stages=2, schedule="mast", optimizer="adam", model_name="toy",
                profiles=_PROFILES, **kw)


def test_host_optimizer_moves_the_optimizer_state_off_the_device():
    device, host = _plan(), _plan(state_placement="host-optimizer")
    assert not device.state_host_bytes and all(p.state_placement == "device" for p in device.policies)
    assert all(p.state_placement == "host-optimizer" for p in host.policies)
    for e in host.stage_estimates:
        assert e.optimizer_bytes == 0 and e.swap_bytes == 2 * e.grad_bytes + e.buffer_bytes
    same = _plan(state_placement="host-optimizer", balance=device.balance)   # the device plan's cuts
    for d, h in zip(device.stage_estimates, same.stage_estimates):
        assert d.optimizer_bytes > 0 and h.host_state_bytes == d.optimizer_bytes + h.swap_bytes
    for d, h in zip(device.positions, same.positions):
        saved = sum(device.stage_estimates[s].optimizer_bytes for s in d.stages)
        # the gradients exist from a stage's first backward to its copy out: not static, priced when alive
        grads = sum(device.stage_estimates[s].grad_bytes for s in d.stages)
        assert h.static_bytes == d.static_bytes - saved - grads and 0 < h.gradient_bytes <= grads
        assert d.peak_bytes - saved - grads <= h.peak_bytes <= d.peak_bytes - saved
        assert same.state_host_bytes[h.position] == sum(same.stage_estimates[s].host_state_bytes for s in h.stages)
    # the host updates and copies back follow the sync: the step is predicted with them
    assert device.step_seconds is None and same.step_seconds > 0 and all(e.host_seconds > 0 for e in same.stage_estimates)
    again = Plan.from_json(same.to_json())
    assert again.policies == same.policies and again.state_host_bytes == same.state_host_bytes
    assert "host (state)" in same.table() and "host-optimizer" in same.table()


def test_auto_keeps_on_the_device_what_fits():
    device, host = _plan(), _plan(state_placement="host-optimizer")
    assert _plan(state_placement="auto", memory_budget=device.peak_bytes).policies == device.policies
    between = (device.peak_bytes + host.peak_bytes) // 2
    mixed = _plan(state_placement="auto", memory_budget=between)
    assert mixed.fits and mixed.peak_bytes <= between
    assert {p.state_placement for p in mixed.policies} == {"device", "host-optimizer"}
    assert mixed.step_seconds < host.step_seconds   # a stage back on the device updates there
    assert any("--state-placement auto" in note for note in mixed.notes)
    squeezed = _plan(state_placement="auto", memory_budget=between, host_memory_budget=1024)
    assert not squeezed.fits and any("--host-memory-budget" in note for note in squeezed.notes)


def _chain(**kw) -> Plan:
    """Weights over activations: eight 256x256 linear layers (1 MiB of Adam state each), gpipe K = 2."""
    return plan(nn.Sequential(*(nn.Linear(256, 256) for _ in range(8))), (256,), batch_size=4, stages=2,
                schedule="gpipe", micro_batches=4, optimizer="adam", model_name="chain", profiles=_CHAIN, **kw)


_CHAIN: dict = {}


@pytest.fixture
def small_groups(monkeypatch):
    """Weight groups of one linear layer each (the floor is 64 MiB for real models)."""
    monkeypatch.setattr(swapping, "MIN_GROUP_BYTES", 1)


def test_host_placement_keeps_the_weights_on_the_host_and_moves_them_per_visit(small_groups):
    device, host = _chain(balance=[6, 2]), _chain(balance=[6, 2], state_placement="host")
    assert [p.weight_groups for p in host.policies] == [[[u, u + 1] for u in range(6)], [[6, 7], [7, 8]]]
    layer = 256 * 257 * 4   # one layer's parameters (= its gradients, = each Adam moment)
    for d, h, e in zip(device.positions, host.positions, host.stage_estimates):
        assert d.static_bytes == 4 * layer * len(e.unit_names)
        assert h.static_bytes == 3 * layer   # one group with its gradients, the next one's weights
        assert h.peak_bytes == h.static_bytes + h.activation_bytes + h.transient_bytes + h.send_bytes
        # its parameters, gradients and Adam's two moments; on CUDA (the default device) each gradient also lands
        # in a pinned staging copy before it is added on the host (HostTier.grad_out)
        assert e.host_state_bytes == 5 * layer * len(e.unit_names) and e.group_bytes == [layer] * len(e.unit_names)
        # grouped: one forward run and one backward run of 4 micro-batches each per step
        assert host.swap_bytes[h.position] == [2 * e.param_bytes, e.grad_bytes]
    assert host.state_host_bytes == [e.host_state_bytes for e in host.stage_estimates]
    on_cpu = _chain(balance=[6, 2], state_placement="host", device="cpu")   # no staging: added as they come
    assert [e.host_state_bytes for e in on_cpu.stage_estimates] == [4 * layer * len(e.unit_names)
                                                                    for e in host.stage_estimates]
    assert host.swap_grouped   # tiny layers: transfers dominate, so grouped is predicted faster
    assert any("3.01 MiB up and 1.51 MiB down per step (12.05 MiB and 6.02 MiB once per forward and backward "
               "action;" in n for n in host.notes)   # 4 micro-batches: 4 times the volume ungrouped
    assert host.step_seconds > 0 and all(e.host_seconds > 0 for e in host.stage_estimates)
    again = Plan.from_json(host.to_json())
    assert again.policies == host.policies and again.swap_bytes == host.swap_bytes
    assert "host (6 groups)" in host.table() and "swap up/down per step" in host.table()
    # a frozen layer stays on the device and moves nothing (as BatchNorm's statistics would, but once a step)
    layers = nn.Sequential(*(nn.Linear(256, 256) for _ in range(8)))
    layers[0].requires_grad_(False)
    frozen = plan(layers, (256,), batch_size=4, stages=2, schedule="gpipe", micro_batches=4, optimizer="adam",
                  balance=[6, 2], state_placement="host", profiles={})
    assert frozen.positions[0].static_bytes == layer + 3 * layer and frozen.policies[0].weight_groups[0] == [0, 2]
    assert frozen.swap_bytes[0] == [2 * 5 * layer, 5 * layer]


def test_grouping_moves_the_weights_once_per_run():
    lists = schedules.schedule("gpipe", 4, 8)
    for actions in lists:
        (stage, (fv, bv)), = visit_counts(actions, grouped=True).items()
        assert (fv, bv) == (1, 1) and visit_counts(actions, grouped=False)[stage] == (8, 8)
    weights = {s: (1000, 0) for s in range(4)}
    for actions in lists:
        assert 4 * sum(swap_volume(actions, weights, True)) <= sum(swap_volume(actions, weights, False))
    # group-major (3 groups): every micro-batch through the first group, the middle, then the last, which sends
    runs = group_major(schedules.schedule("gpipe", 2, 2), {0: 3})[0][:8]
    assert [(a.op, getattr(a, "part", None)) for a in runs] == [
        ("forward", 0), ("forward", 0), ("forward", 1), ("forward", 1),
        ("forward", 2), ("send_act", None), ("forward", 2), ("send_act", None)]
    # the simulator: transfers cost time; grouped, fewer of them, but a run's outputs leave late (group-major)
    def step(upload: float, grouped: bool) -> float:
        return simulate("gpipe", 4, 8, Costs([1.0] * 4, [2.0] * 4, [0] * 4, uploads=[[upload] * 2] * 4,
                                             download=[upload] * 4, grouped=grouped)).step_time
    free = simulate("gpipe", 4, 8, Costs([1.0] * 4, [2.0] * 4, [0] * 4)).step_time
    assert free < step(0.01, False) < step(0.01, True)   # compute-bound: pipelining wins
    assert step(5.0, True) < step(5.0, False)            # transfer-bound: grouping wins
    # the host link is shared with activation offload: a backward's offloaded activations come back up the
    # link its second weight group comes up (a forward's go down, beside its weights going up); while the
    # backward's compute (2 s) hides both, offload costs a swapped stage nothing more; beyond it the weights
    # are exposed, by at most their own upload (the rest is the offload policy's own price)
    def shared(offload: float) -> float:
        return simulate("gpipe", 2, 4, Costs([1.0] * 2, [2.0] * 2, [0] * 2, uploads=[[0.1, 0.8], []],
                                             download=[0.1, 0.0], offload=[offload, 0.0])).step_time
    assert shared(0.0) == shared(1.0) < shared(1.5) < shared(2.0) == shared(3.0)
    assert shared(2.0) - shared(0.0) == pytest.approx(4 * 0.8)   # four backward visits, each 0.8 s later


def test_auto_weighs_the_host_update_against_the_recomputation_the_device_needs():
    """resnet18 at 256^2 under 90% of its plain peak: on the device it fits by recomputing; auto takes the
    optimizer off the device instead only where the host update is predicted cheaper than that."""
    profiles = {}
    def made(**kw) -> Plan:
        return plan(models.build("resnet18", num_classes=10), (3, 256, 256), batch_size=4, stages=2,
                    schedule="mast", optimizer="adam", model_name="resnet18", profiles=profiles, recompute="auto", **kw)
    budget = int(0.9 * made().peak_bytes)
    device = made(memory_budget=budget)
    assert device.fits and device.policies[0].kind == "recompute"
    # at the default host rates (one CPU thread) the update costs more than recomputing two units
    assert made(memory_budget=budget, state_placement="auto").policies == device.policies
    fast = made(memory_budget=budget, state_placement="auto", host_update={"adam": 1e-13}, host_bandwidth=1e13)
    assert fast.fits and fast.step_seconds < device.step_seconds
    assert [(p.kind, p.state_placement) for p in fast.policies] == [("none", "host-optimizer"), ("none", "device")]
    assert any("with every stage's state on the device and the memory policies it needs" in n for n in fast.notes)


def test_auto_puts_the_weights_on_the_host_only_where_less_does_not_fit(small_groups):
    host_optimizer = _chain(balance=[6, 2], state_placement="host-optimizer")
    host = _chain(balance=[6, 2], state_placement="host")
    budget = (host_optimizer.peak_bytes + host.peak_bytes) // 2
    auto = _chain(balance=[6, 2], state_placement="auto", memory_budget=budget)
    # stage 1 (2 layers) fits with its parameters on the device, not with its optimizer state too
    assert auto.fits and [p.state_placement for p in auto.policies] == ["host", "host-optimizer"]
    assert auto.step_seconds < host.step_seconds
    assert any("parameters of stage(s) 0 in host memory too" in n and "optimizer state of stage(s) 1" in n
               for n in auto.notes)
    assert auto.swap_bytes[0] == host.swap_bytes[0] and sum(auto.swap_bytes[1]) < sum(host.swap_bytes[1])
    # where the optimizer's state on the host suffices, auto does as before
    assert {p.state_placement for p in _chain(balance=[6, 2], state_placement="auto",
                                              memory_budget=host_optimizer.peak_bytes).policies} != {"host"}


def test_calibrate_measures_the_host_updates():
    rates = host_update_rates(elements=2**16)
    assert set(rates) == set(OPTIMIZER_STATE) and all(0 < r < 1e-6 for r in rates.values())
    slow = _plan(state_placement="host-optimizer", host_update={"adam": 1e-6})
    assert slow.step_seconds > _plan(state_placement="host-optimizer").step_seconds
    with pytest.raises(GemsError, match="host_update must give adam's seconds per byte"):
        _plan(state_placement="host-optimizer", host_update={"sgd": 1e-9})
