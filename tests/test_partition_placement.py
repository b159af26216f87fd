"""Where model state lives, priced (gems.partition.placement): host-optimizer takes the optimizer state off
the device and prices the host copies and the transfers; auto brings back to the device each stage that fits;
a host budget bounds them; plans carry the placement through JSON."""
from __future__ import annotations

import pytest

from gems.errors import GemsError
from gems.partition import Plan, plan
from gems.partition.accuracy import toy_model

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
        assert h.peak_bytes == d.peak_bytes - saved
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


def test_harmony_s_host_placement_is_refused_in_one_sentence():
    with pytest.raises(GemsError, match="--state-placement host .* is not built yet"):
        _plan(state_placement="host")
