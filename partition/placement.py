"""Where model state lives, priced (``StagePolicy.state_placement``, ``--state-placement``).

``device``: a stage's parameters, gradients, optimizer state and buffers on its device, as the
profile measured them. ``host-optimizer`` (``gems.pipeline.hostopt``) takes the optimizer state off
the device; each holder keeps in host memory, beside it, a copy of the stage's trainable parameters
and of its gradient segment (gradients, then the floating buffers), and per step moves the segment
down and the parameters up::

    device   parameters + gradients + buffers                       (optimizer state: none)
    host     optimizer state + parameters + gradients + buffers     (StageEstimate.host_state_bytes)
             (+ the gradients' pinned staging, for ``host`` on CUDA)
    link     gradients + buffers down, parameters up, per step      (StageEstimate.swap_bytes)

Time: the copy out overlaps the rest of the backward; the host update and the parameters' copy
back follow the step's sync, so each adds to the step (``StageEstimate.host_seconds``, which the
simulator adds to each holder's optimizer step, ``gems.schedule.simulate.Costs.host_seconds``): the
update at ``HOST_UPDATE`` seconds per byte of the gradients the rank updates, the copy back at the host
bandwidth.

These are model state, apart from the offload pool (``Plan.host_bytes``); unlike offloaded
activations they are priced on a CPU device too, whose ranks keep the host tier in allocations of
its own. On the device, a host-optimizer stage's gradients exist only from its first backward to its copy
out (``PositionEstimate.gradient_bytes`` prices them moment by moment, ``costs.highest``); the solver and the
policies' budget count them as static, a bound.

``auto`` (``on_device_where_it_fits``): every stage on the host plans the cuts and activation
policies (the leanest the device can be); then, stage by stage, from the most host state down,
a stage comes back to the device wherever every holder still fits the budget -- a stage on the
device needs no transfers nor host update, so it is never slower. Where even every stage's optimizer on
the host does not fit, every stage goes to ``host`` (parameters too, ``gems.partition.swapping``), and
``promoted`` brings each back, to the device or else to ``host-optimizer``, where every holder still fits.
Where the device fits only by recomputing or offloading, the plan with the optimizers on the host (stages
brought back as above) competes with it: the faster predicted step wins -- a host update costs per byte of
parameters, a recomputation per FLOP of activations, so which is cheaper depends on the model, the image
and the host's cores (``--calibrate``). A plan whose host state exceeds ``host_budget`` does not fit.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from gems.plan import Plan
from gems.units import format_size
from .records import UnitProfile
from .swapping import NOTE, SWAPPED

HOST = "host-optimizer"
# Seconds per byte of gradients of one host update, torch's fused CPU kernels on one thread (gems.train.optim:
# resnet18's 11.7 M float32 parameters, SGD with momentum 12.1 ms, Adam 18.4, AdamW 19.9), until --calibrate
# measures them (``gems.partition.calibrate``, on one 4 Mi-element tensor, so fewer kernel launches: SGD with
# momentum 0.10, Adam 0.14, AdamW 0.15 ns/byte on one thread here); a rank with more threads is faster.
HOST_UPDATE = {"sgd": 0.26e-9, "sgd-nomomentum": 0.26e-9, "adam": 0.39e-9, "adamw": 0.43e-9}


def stage_state(units: Sequence[UnitProfile], placement: str, shares: Sequence[int],
                pinned: bool = False) -> tuple[int, int, int]:
    """(device optimizer bytes, host state bytes, gradient bytes the rank updates on the host) of a stage of
    ``units`` (of a profile with its optimizer state on the device or moved by ``ModelProfile.on_host``),
    each unit's update shared by ``shares`` ranks (``--shard-optimizer``); ``pinned`` (CUDA): a ``host``
    stage's gradients also land in a pinned staging copy before they are added on the host
    (``HostTier.grad_out``). What it moves per step: ``optimizer_swap``, or for ``host`` per visit
    (``gems.partition.swapping``)."""
    optimizer = sum(u.optimizer_bytes + u.host_optimizer_bytes for u in units)
    if placement not in (HOST, SWAPPED):
        return optimizer, 0, 0
    grads, buffers = sum(u.grad_bytes for u in units), sum(u.buffer_bytes for u in units)
    updated = sum(-(-u.grad_bytes // n) for u, n in zip(units, shares))
    staging = grads if pinned and placement == SWAPPED else 0
    return 0, optimizer + 2 * grads + buffers + staging, updated   # host: the same tier, the device's copy swapped


def optimizer_swap(grad_bytes: int, buffer_bytes: int) -> tuple[int, int]:
    """(bytes up, bytes down) per step of a ``host-optimizer`` stage: the new parameters up, its gradient
    segment (gradients, then the floating buffers) down."""
    return grad_bytes, grad_bytes + buffer_bytes


def host_seconds(updated: int, params: int, optimizer: str, bandwidth: float,
                 rates: dict[str, float] | None = None) -> float:
    """A stage's host update of ``updated`` gradient bytes (at ``rates``, seconds per byte per optimizer
    as ``--calibrate`` measures them, else ``HOST_UPDATE``) and the copy back of its ``params`` bytes."""
    return updated * (rates or HOST_UPDATE)[optimizer] + params / bandwidth


def slowest_host(plan: Plan) -> float:
    """The most seconds any position spends on its host updates and copies back per step."""
    return max(sum(plan.stage_estimates[s].host_seconds for s in p.stages) for p in plan.positions)


def host_state(plan: Plan) -> list[int]:
    """Per position, the host bytes of the model state its stages keep there (empty: none)."""
    held = [sum(plan.stage_estimates[s].host_state_bytes for s in p.stages) for p in plan.positions]
    return held if any(held) else []


def host_need(plan: Plan) -> list[int]:
    """Per position, host memory for model state and the offload pool together."""
    state, pool = plan.state_host_bytes or [0] * plan.stages, plan.host_bytes or [0] * plan.stages
    return [a + b for a, b in zip(state, pool)]


def host_overflow(plan: Plan, host_budget: int | None) -> str | None:
    """A sentence naming the position whose host memory exceeds ``host_budget``; None if none does."""
    if host_budget is None or not plan.state_host_bytes:
        return None
    need = host_need(plan)
    worst = max(range(plan.stages), key=need.__getitem__)
    if need[worst] <= host_budget:
        return None
    return (f"position {worst} needs {format_size(need[worst])} of host memory for model state and offloaded "
            f"activations, over --host-memory-budget {format_size(host_budget)}")


def check_host_budget(plan: Plan, host_budget: int | None) -> None:
    """Mark ``plan`` as not fitting, with a note, when a position's host memory exceeds ``host_budget``."""
    over = host_overflow(plan, host_budget)
    if over:
        plan.fits = False
        plan.notes.append(f"does not fit the host: {over}")


def on_device_where_it_fits(plan: Plan, room: int) -> Plan:
    """``plan`` (every stage on the host) with each stage whose optimizer state fits beside every
    holder's peak within ``room`` back on the device, the stages with the most host state first."""
    peaks = {p.position: p.peak_bytes for p in plan.positions}
    estimates, policies = list(plan.stage_estimates), list(plan.policies)
    for s in sorted(range(plan.stages), key=lambda s: -estimates[s].host_state_bytes):
        e = estimates[s]
        if policies[s].state_placement != HOST:
            continue
        optimizer = e.host_state_bytes - e.swap_bytes   # the optimizer state
        # what the device takes back: the optimizer state, and the gradients for the whole step (a bound: the
        # peak moment may have counted them already, PositionEstimate.gradient_bytes)
        back = optimizer + e.grad_bytes
        holders = [p.position for p in plan.positions if s in p.stages]
        if all(peaks[p] + back <= room for p in holders):
            for p in holders:
                peaks[p] += back
            estimates[s] = replace(e, optimizer_bytes=optimizer, host_state_bytes=0, swap_bytes=0, host_seconds=0.0)
            policies[s] = replace(policies[s], state_placement="device")
    added = {p.position: peaks[p.position] - p.peak_bytes for p in plan.positions}
    positions = [replace(p, static_bytes=p.static_bytes + added[p.position], peak_bytes=peaks[p.position],
                         plain_peak_bytes=p.plain_peak_bytes + added[p.position]) for p in plan.positions]
    placed = replace(plan, stage_estimates=estimates, policies=policies, positions=positions, notes=list(plan.notes))
    placed.state_host_bytes = host_state(placed)
    moved = [[optimizer_swap(estimates[s].grad_bytes, estimates[s].buffer_bytes) for s in p.stages
              if policies[s].state_placement == HOST] for p in plan.positions]
    placed.swap_bytes = [[sum(up for up, _ in m), sum(down for _, down in m)] for m in moved] \
        if placed.state_host_bytes else []
    slower = slowest_host(placed) - slowest_host(plan)
    placed.step_seconds = None if plan.step_seconds is None else plan.step_seconds + slower
    placed.plain_step_seconds = None if plan.plain_step_seconds is None else plan.plain_step_seconds + slower
    placed.fits = max(peaks.values()) <= room
    on_host = [s for s, p in enumerate(policies) if p.state_placement == HOST]
    placed.notes.append(f"--state-placement auto: the optimizer state of stage(s) {','.join(map(str, on_host))} in "
                        "host memory (host-optimizer), the rest on the device" if on_host else
                        "--state-placement auto: every stage's state fits on the device")
    return placed


def promoted(plan: Plan, reassembled: Callable[[Plan, list[str]], Plan]) -> Plan:
    """``plan`` (every stage ``host``, fitting) with stages brought back where every holder still fits:
    the stage moving the most bytes first, to the device or else to ``host-optimizer`` -- either needs no
    weight transfers, so it is never slower. ``reassembled(plan, placements)``: the plan's cuts and
    policies estimated with these per-stage placements."""
    placements = [p.state_placement for p in plan.policies]
    best = plan
    for s in sorted(range(plan.stages), key=lambda s: -plan.stage_estimates[s].swap_bytes):
        for target in ("device", HOST):
            trial = reassembled(plan, placements[:s] + [target] + placements[s + 1:])
            if trial.fits:
                placements[s], best = target, trial
                break
    best.notes = [n for n in plan.notes if not n.startswith(NOTE)] + [n for n in best.notes if n.startswith(NOTE)]
    moved = [s for s, p in enumerate(placements) if p == SWAPPED]
    lighter = [s for s, p in enumerate(placements) if p == HOST]
    best.notes.append("--state-placement auto: the parameters of stage(s) " + ",".join(map(str, moved))
                      + " in host memory too, on the device per weight group (host)"
                      + (f"; the optimizer state of stage(s) {','.join(map(str, lighter))} (host-optimizer)"
                         if lighter else "") + "; the rest on the device")
    return best
