"""``plan()``: validate the request, profile the model, cut it, estimate every position.

    profile (fake run at the real size) -> CostModel (schedule, K, m) -> solver -> Plan

With a memory budget that the requested K misses, the plan also names the smallest K that
would fit, checking K+1, K+2, ...: lower bounds rule most out without solving, the rest run
the solver with the budget as its limit (it gives up early when the budget is far off).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from gems import schedule as schedules
from gems.errors import GemsError
from gems.units import format_size, parse_size
from .costs import BALANCE_BY, CostModel, memory_average, memory_floor
from .plan import Plan, PositionEstimate, StageEstimate
from .profile import OPTIMIZER_STATE, ModelProfile, profile
from .solver import cuts_from_balance, evaluate, solve

POLICY_MODES = ("none", "auto", "all")


def plan(model: nn.Sequential, input_shape: Sequence[int], batch_size: int, stages: int,
         schedule: str = "mast", micro_batches: int = 1, balance_by: str = "memory",
         memory_budget: int | str | None = None, balance: Sequence[int] | None = None,
         optimizer: str = "sgd", dtype: torch.dtype | str = torch.float32, groups: int = 1,
         model_name: str | None = None, unit_times: Sequence[float] | None = None,
         recompute: str = "none", offload: str = "none", device: str = "cuda") -> Plan:
    """Cut ``model`` (an nn.Sequential of units) into ``stages`` stages for ``schedule``.

    ``input_shape`` is one sample's shape (e.g. (3, 2048, 2048)); ``batch_size`` the images
    per optimizer step over the whole job, split into ``groups`` x replicas x
    ``micro_batches`` micro-batches. ``balance`` (units per stage) skips the solver.
    ``memory_budget`` (bytes or "40GiB") sets ``fits`` and, when it does not fit, the smallest
    stage count that would. ``unit_times`` (seconds per unit for one micro-batch, forward +
    backward, e.g. from ``measure_times``) makes ``balance_by="time"`` use measurements
    instead of FLOPs. ``recompute`` / ``offload`` ("none", "auto", "all") choose per-stage
    memory policies (``auto``: only where ``memory_budget`` needs them); ``device`` ("cuda" or
    "cpu") is where stages run: offloading from a CPU device to host memory saves nothing.
    Raises GemsError naming the fix for any unusable input.
    """
    name = model_name or type(model).__name__
    if not isinstance(model, nn.Sequential) or len(model) == 0:
        raise GemsError("the model must be a non-empty nn.Sequential of units: build it with gems.models.build")
    n = len(model)
    K = _positive_int(stages, "the number of stages")
    m = _positive_int(micro_batches, "the number of micro-batches")
    groups = _positive_int(groups, "the number of groups")
    batch_size = _positive_int(batch_size, "the batch size")
    schedules.check(schedule, K, m)
    if K > n:
        raise GemsError(f"{name} has {n} units, so it cannot be cut into {K} stages: use at most {n} stages")
    if balance_by not in BALANCE_BY:
        raise GemsError(f"cannot balance by {balance_by!r}: choose one of {', '.join(BALANCE_BY)}")
    if optimizer not in OPTIMIZER_STATE:
        raise GemsError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATE)}")
    replicas = schedules.replicas(schedule)
    split = groups * replicas * m
    if batch_size % split:
        raise GemsError(f"batch size {batch_size} does not split into {groups} group(s) x {replicas} replica(s) x "
                        f"{m} micro-batch(es): use a multiple of {split}")
    for flag, value in (("recompute", recompute), ("offload", offload)):
        if value not in POLICY_MODES:
            raise GemsError(f"--{flag} must be one of {', '.join(POLICY_MODES)}, got {value!r}")
    if device not in ("cuda", "cpu"):
        raise GemsError(f"the device to plan for must be 'cuda' or 'cpu', got {device!r}")
    budget = None if memory_budget is None else parse_size(memory_budget)
    if budget is not None and budget <= 0:
        raise GemsError("the memory budget must be positive, e.g. 40GiB")
    shape = _input_shape(input_shape)
    torch_dtype = _dtype(dtype)
    cuts = None if balance is None else cuts_from_balance(balance, n, K)
    if unit_times is not None and (len(unit_times) != n or any(not t >= 0 for t in unit_times)):
        raise GemsError(f"unit_times must give one non-negative time per unit ({n} values)")

    prof = profile(model, shape, batch_size // split, torch_dtype, optimizer, name)
    costs = CostModel(prof, schedule, K, m, unit_times)
    cost, transient, remainder = costs.objective(balance_by)
    if cuts is None:
        cuts = solve(n, K, cost, transient, costs.mirror, remainder=remainder).cuts
    loads = evaluate(cuts, cost, transient, costs.mirror)
    result = _assemble(prof, costs, cuts, loads, name, shape, batch_size, groups, balance_by, budget)
    if budget is not None and not result.fits:
        result.smallest_fitting_stages = _smallest_fitting(prof, schedule, K, m, budget, name)
    return result


def _assemble(prof: ModelProfile, costs: CostModel, cuts: list[int], loads: list[float], name: str,
              shape: tuple[int, ...], batch_size: int, groups: int, balance_by: str, budget: int | None) -> Plan:
    K, units = costs.K, prof.units
    act = costs.activations
    stage_estimates = []
    for s in range(K):
        lo, hi = cuts[s], cuts[s + 1]
        part = units[lo:hi]
        stage_estimates.append(StageEstimate(
            stage=s, first_unit=lo, end_unit=hi, unit_names=[u.name for u in part],
            param_bytes=sum(u.param_bytes for u in part), grad_bytes=sum(u.grad_bytes for u in part),
            optimizer_bytes=sum(u.optimizer_bytes for u in part), buffer_bytes=sum(u.buffer_bytes for u in part),
            activation_bytes=int(act[lo, hi]), transient_bytes=int(costs.transient[lo, hi]),
            input_bytes=units[lo - 1].output_bytes if lo > 0 else 0, output_bytes=units[hi - 1].output_bytes,
            forward_flops=sum(u.forward_flops for u in part), backward_flops=sum(u.backward_flops for u in part)))
    positions = []
    for p in range(K):
        held = costs.holds(p)
        est = [stage_estimates[s] for s in held]
        in_flight = {s: int(costs.in_flight[p].get(s, 0)) for s in held}
        activations = sum(in_flight[s] * stage_estimates[s].activation_bytes for s in held)
        transient = max(e.transient_bytes for e in est)
        static = sum(e.static_bytes for e in est)
        positions.append(PositionEstimate(
            position=p, stages=held, units=sum(e.end_unit - e.first_unit for e in est),
            param_bytes=sum(e.param_bytes for e in est), static_bytes=static, in_flight=in_flight,
            activation_bytes=activations, transient_bytes=transient, peak_bytes=static + activations + transient,
            flops=sum(costs.handled(p, s) * stage_estimates[s].forward_flops for s in held), load=loads[p]))
    mean = float(np.mean(loads))
    fits = None if budget is None else max(p.peak_bytes for p in positions) <= budget
    return Plan(
        model_name=name, input_shape=shape, batch_size=batch_size, groups=groups, stages=K,
        schedule=costs.schedule, micro_batches=costs.m, balance_by=balance_by, optimizer=prof.optimizer,
        dtype=prof.dtype, memory_budget=budget, micro_batch_size=prof.micro_batch_size, cuts=list(cuts),
        unit_names=[u.name for u in units],
        stage_output_shapes=[list(units[cuts[s + 1] - 1].output_shapes) for s in range(K)],
        stage_output_dtypes=[list(units[cuts[s + 1] - 1].output_dtypes) for s in range(K)],
        stage_estimates=stage_estimates, positions=positions,
        load_unit={"memory": "B", "flops": "FLOP"}.get(balance_by, costs.time_unit),
        imbalance=max(loads) / mean if mean > 0 else 1.0, fits=fits)


def _smallest_fitting(prof: ModelProfile, schedule: str, K: int, m: int, budget: int, name: str) -> int:
    """The least stage count above K whose memory-balanced partition fits ``budget``.

    Stage counts that a lower bound already rules out are skipped without solving. When no
    stage count fits, the error names either a unit that no partition can fit (cheap) or the
    least peak over all stage counts >= K (a solve per stage count: slow for 300+ units).
    """
    n = len(prof)
    floor, unit = memory_floor(prof)
    if floor > budget:
        raise GemsError(f"no number of stages fits {name} in the memory budget of {format_size(budget)}: "
                        f"however it is cut, the position holding unit {prof.units[unit].name} needs at least "
                        f"{format_size(floor)}, {format_size(floor - budget)} over the budget; "
                        "raise the budget or shrink the batch or image size")
    for k in range(K + 1, n + 1):
        if memory_average(prof, k) > budget:
            continue
        costs = CostModel(prof, schedule, k, m)
        if costs.memory_lower_bound() > budget:
            continue
        if solve(n, k, costs.memory, costs.peak, costs.mirror, limit=budget, refine=False,
                 remainder=costs.memory_remainder()) is not None:
            return k
    best = None
    for k in range(n, K - 1, -1):   # nothing fits: the least peak any stage count reaches
        if best is not None and max(floor, memory_average(prof, k)) >= best:
            continue
        costs = CostModel(prof, schedule, k, m)
        if best is not None and costs.memory_lower_bound() >= best:
            continue
        found = solve(n, k, costs.memory, costs.peak, costs.mirror, limit=best, refine=False,
                      remainder=costs.memory_remainder())
        if found is not None:
            best = found.value
    raise GemsError(f"no number of stages fits {name} in the memory budget of {format_size(budget)}: the smallest "
                    f"possible peak is {format_size(best)}, {format_size(best - budget)} over the budget; "
                    "raise the budget or shrink the batch or image size")


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise GemsError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def _input_shape(shape: Sequence[int]) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if not dims or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in dims):
        raise GemsError(f"the input shape must be positive sizes per sample such as (3, 2048, 2048), got {shape!r}")
    return tuple(int(d) for d in dims)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise GemsError(f"unsupported dtype {dtype!r}: choose one of {', '.join(_DTYPES)}")
