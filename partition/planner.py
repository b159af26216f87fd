"""``plan()``: validate the request, profile the model, cut it, choose memory policies,
estimate every position.

    profile (fake run at the real size) -> CostModel (schedule, K, m) -> solver -> Plan

Memory policies (recompute, offload; ``policy`` prices them): ``all`` puts one on every
stage and cuts with it priced in; ``auto`` (with a memory budget) keeps the plain plan when it
fits, else makes every stage as lean as allowed -- on the plain cuts and on cuts balanced for
that lean memory, keeping the faster of the two that fit -- and then, stage by stage from the
one whose lean policy costs the most time, relaxes to the cheapest policy that still fits.
A stage's choices include recomputing only some of its segments (``PolicyModel.partial``), so
a budget a little short of the plain plan costs a little recomputation, not a whole stage's.

With a memory budget that the requested K misses, the plan also names the smallest K that
would fit with the leanest allowed policy, checking K+1, K+2, ...: lower bounds rule most out
without solving, the rest run the solver with the budget as its limit (it gives up early
when the budget is far off).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from gems.pipeline import schedule as schedules
from gems.errors import GemsError
from gems.pipeline.simulate import EFFICIENCY, IDEAL, V100_FLOPS, costs_from_plan, simulate
from gems.units import format_size, parse_size
from .costs import BALANCE_BY, CostModel, highest, memory_average, memory_floor
from gems.plan import Plan, PositionEstimate, StageEstimate, StagePolicy
from .policy import (HOST_BANDWIDTH, MODES, PolicyModel, kind_words, kinds, parse_bandwidth,
                     unit_seconds)
from .profile import OPTIMIZER_STATE, ModelProfile, profile
from .solver import cuts_from_balance, evaluate, solve



def plan(model: nn.Sequential, input_shape: Sequence[int], batch_size: int, stages: int,
         schedule: str = "mast", micro_batches: int = 1, balance_by: str = "memory",
         memory_budget: int | str | None = None, balance: Sequence[int] | None = None,
         optimizer: str = "sgd", dtype: torch.dtype | str = torch.float32, groups: int = 1,
         model_name: str | None = None, unit_times: Sequence[float] | None = None,
         recompute: str = "none", offload: str = "none", device: str = "cuda",
         host_bandwidth: float | str = HOST_BANDWIDTH, device_flops: float = V100_FLOPS,
         efficiency: float = EFFICIENCY, profiles: dict | None = None) -> Plan:
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
    ``host_bandwidth`` (bytes/s or "12GB/s") prices offloading; FLOPs become seconds at
    ``device_flops`` x ``efficiency``. ``profiles``: a dict the caller keeps to plan one model
    several times (a sweep), so each micro-batch size is profiled once. Raises GemsError
    naming the fix for any unusable input.
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
        if value not in MODES:
            raise GemsError(f"--{flag} must be one of {', '.join(MODES)}, got {value!r}")
    if device not in ("cuda", "cpu"):
        raise GemsError(f"the device to plan for must be 'cuda' or 'cpu', got {device!r}")
    bandwidth = parse_bandwidth(host_bandwidth)
    if not (isinstance(device_flops, (int, float)) and device_flops > 0 and isinstance(efficiency, (int, float))
            and 0 < efficiency <= 1):
        raise GemsError(f"the device rate must be positive and the efficiency in (0, 1], got {device_flops!r} "
                        f"and {efficiency!r}: e.g. 15.7e12 and 0.4")
    budget = None if memory_budget is None else parse_size(memory_budget)
    if budget is not None and budget <= 0:
        raise GemsError("the memory budget must be positive, e.g. 40GiB")
    shape = _input_shape(input_shape)
    torch_dtype = _dtype(dtype)
    cuts = None if balance is None else cuts_from_balance(balance, n, K)
    if unit_times is not None and (len(unit_times) != n or any(not t >= 0 for t in unit_times)):
        raise GemsError(f"unit_times must give one non-negative time per unit ({n} values)")

    key = (batch_size // split, shape, torch_dtype, optimizer)
    prof = profiles.get(key) if profiles is not None else None
    if prof is None:
        prof = profile(model, shape, batch_size // split, torch_dtype, optimizer, name)
        if profiles is not None:
            profiles[key] = prof
    rate = float(device_flops * efficiency)
    policies = PolicyModel(prof, device, *unit_seconds(prof, rate, unit_times), bandwidth)
    allowed = kinds(recompute, offload, device, budget is not None)
    job = _Job(prof, policies, name, shape, batch_size, groups, budget, rate)
    costs = CostModel(prof, schedule, K, m, unit_times, policies, allowed[0])
    cuts, loads = _cut(costs, balance_by, cuts)
    result = job.assemble(costs, cuts, loads, balance_by, _uniform(policies, costs, cuts, allowed[0]))
    if budget is not None and not result.fits and len(allowed) > 1:
        result = _fit(job, costs, cuts, loads, balance_by, allowed, recut=balance is None)
    if budget is not None and not result.fits:
        result.smallest_fitting_stages = _smallest_fitting(prof, schedule, K, m, budget, name, policies, allowed[-1])
    if device == "cpu" and any(p.offload for p in result.policies):
        result.notes.append("offload on a CPU device: host memory is the device's memory, so it saves nothing "
                            "(the estimates count no saving)")
    return result


def _cut(costs: CostModel, balance_by: str, cuts: list[int] | None = None) -> tuple[list[int], list[float]]:
    """The balanced cuts (unless given) and every position's load under ``balance_by``."""
    cost, transient, remainder = costs.objective(balance_by)
    if cuts is None:
        cuts = solve(len(costs.profile), costs.K, cost, transient, costs.mirror, remainder=remainder).cuts
    return cuts, evaluate(cuts, cost, transient, costs.mirror)


def _uniform(policies: PolicyModel, costs: CostModel, cuts: list[int], kind: str) -> list[StagePolicy]:
    """``kind`` on every stage, recompute segments chosen per stage."""
    return [policies.choose(kind, cuts[s], cuts[s + 1], costs.holders(s)) for s in range(costs.K)]


def _fit(job: _Job, costs: CostModel, cuts: list[int], loads: list[float], balance_by: str, allowed: list[str],
         recut: bool) -> Plan:
    """The fastest plan within the budget with policies from ``allowed`` on these cuts or (with
    ``recut``) on cuts balanced for the leanest of them (module docstring); the leanest plan
    when none fits."""
    options = [(cuts, loads, balance_by)]
    if recut:
        lean = CostModel(costs.profile, costs.schedule, costs.K, costs.m, None, job.policies, allowed[-1])
        options.append((*_cut(lean, "memory"), "memory"))
    found = []
    for option_cuts, option_loads, option_by in options:
        chosen = _relax(job, costs, option_cuts, allowed)
        if chosen is not None:
            found.append(job.assemble(costs, option_cuts, option_loads, option_by, chosen))
    if not found:
        leanest = options[-1]
        return job.assemble(costs, *leanest, _uniform(job.policies, costs, leanest[0], allowed[-1]))
    best = min(found, key=lambda p: max(q.seconds for q in p.positions))
    if best.balance_by != balance_by:
        best.notes.append(f"balanced by memory with the policies priced in, not by {balance_by}: "
                          "that fits the budget with the least added time")
    return best


def _relax(job: _Job, costs: CostModel, cuts: list[int], allowed: list[str]) -> list[StagePolicy] | None:
    """Per stage, the cheapest allowed policy that keeps every position within the budget:
    start from the leanest everywhere, then relax the stages greedily, the one whose lean
    policy costs the most time first. None when even the leanest does not fit."""
    K = costs.K
    options, leanest = [], []
    for s in range(K):
        lo, hi, holders = cuts[s], cuts[s + 1], costs.holders(s)
        found = {}
        for kind in allowed:   # least saving first: the last kind's own choice is the leanest
            whole = job.policies.choose(kind, lo, hi, holders)
            for policy in [whole, *job.policies.partial(kind, lo, hi, holders),
                           *job.policies.partial(kind, lo, hi, holders, whole.recompute)]:
                found.setdefault(repr(policy), (policy, job.stage(costs, cuts, s, policy)))
        options.append(sorted(found.values(), key=lambda option: sum(c.seconds for c in option[1].values())))
        leanest.append(next(i for i, (policy, _) in enumerate(options[-1]) if policy == whole))
    static = [sum(job.static(cuts, s) for s in costs.holds(p)) for p in range(K)]

    def fits(choice: list[int]) -> bool:
        for p in range(K):
            parts = {s: options[s][choice[s]][1][p] for s in costs.holds(p)}
            _, activations, transient = highest(costs.moments[p], {s: c.kept for s, c in parts.items()},
                                                {s: c.transient for s, c in parts.items()})
            if static[p] + activations + transient > job.budget:
                return False
        return True

    def seconds(s: int, i: int) -> float:
        return sum(c.seconds for c in options[s][i][1].values())

    if not fits(leanest):
        return None
    choice = leanest
    for s in sorted(range(K), key=lambda s: seconds(s, 0) - seconds(s, choice[s])):
        for i in range(len(options[s])):
            trial = choice[:s] + [i] + choice[s + 1:]
            if i == choice[s] or fits(trial):
                choice = trial
                break
    return [options[s][i][0] for s, i in enumerate(choice)]


class _OnPosition(NamedTuple):
    """What one stage with a policy puts on one position holding it, per step."""

    kept: int           # per micro-batch alive
    transient: int      # working memory + what comes back at a backward
    seconds: float      # added by the policy
    flops: int          # forward FLOPs recomputed


class _Job:
    """What every candidate plan shares: the profile, its policy prices, the request."""

    def __init__(self, prof: ModelProfile, policies: PolicyModel, name: str, shape: tuple[int, ...],
                 batch_size: int, groups: int, budget: int | None, rate: float) -> None:
        self.prof, self.policies, self.name, self.shape = prof, policies, name, shape
        self.batch_size, self.groups, self.budget, self.rate = batch_size, groups, budget, rate
        self.working = prof.working_matrix()

    def static(self, cuts: list[int], s: int) -> int:
        return sum(u.static_bytes for u in self.prof.units[cuts[s]:cuts[s + 1]])

    def stage(self, costs: CostModel, cuts: list[int], s: int, policy: StagePolicy) -> dict[int, _OnPosition]:
        """Per position holding stage s: its kept activations, transient bytes, added time and FLOPs."""
        lo, hi = cuts[s], cuts[s + 1]
        mem = self.policies.memory(lo, hi, policy)
        return {h.position: _OnPosition(mem.kept, int(self.working[lo, hi]) + mem.extra,
                                        self.policies.seconds(lo, hi, policy, mem, h),
                                        self.policies.recompute_flops(hi, policy, h))
                for h in costs.holders(s)}

    def assemble(self, costs: CostModel, cuts: list[int], loads: list[float], balance_by: str,
                 policies: list[StagePolicy]) -> Plan:
        K, units, prices = costs.K, self.prof.units, self.policies
        stage_estimates, on = [], []
        for s in range(K):
            lo, hi = cuts[s], cuts[s + 1]
            part, policy = units[lo:hi], policies[s]
            mem = prices.memory(lo, hi, policy)
            on.append(self.stage(costs, cuts, s, policy))
            stage_estimates.append(StageEstimate(
                stage=s, first_unit=lo, end_unit=hi, unit_names=[u.name for u in part],
                param_bytes=sum(u.param_bytes for u in part), grad_bytes=sum(u.grad_bytes for u in part),
                optimizer_bytes=sum(u.optimizer_bytes for u in part), buffer_bytes=sum(u.buffer_bytes for u in part),
                activation_bytes=mem.kept, transient_bytes=int(self.working[lo, hi]),
                input_bytes=units[lo - 1].output_bytes if lo > 0 else 0, output_bytes=units[hi - 1].output_bytes,
                forward_flops=sum(u.forward_flops for u in part), backward_flops=sum(u.backward_flops for u in part),
                plain_activation_bytes=mem.plain, recompute_bytes=mem.remat, offload_bytes=mem.back,
                extra_seconds=sum(c.seconds for c in on[s].values())))
        positions = []
        for p in range(K):
            held = costs.holds(p)
            est = [stage_estimates[s] for s in held]
            parts = [on[s][p] for s in held]
            live, activations, transient = highest(costs.moments[p], {s: on[s][p].kept for s in held},
                                                   {s: on[s][p].transient for s in held})
            _, plain_activations, plain_transient = highest(
                costs.moments[p], {s: stage_estimates[s].plain_activation_bytes for s in held},
                {s: stage_estimates[s].transient_bytes for s in held})
            in_flight = {s: int(live.get(s, 0)) for s in held}
            static = sum(e.static_bytes for e in est)
            extra = sum(c.seconds for c in parts)
            compute = sum(costs.handled(p, s) * (prices.compute[cuts[s + 1]] - prices.compute[cuts[s]]) for s in held)
            positions.append(PositionEstimate(
                position=p, stages=held, units=sum(e.end_unit - e.first_unit for e in est),
                param_bytes=sum(e.param_bytes for e in est), static_bytes=static, in_flight=in_flight,
                activation_bytes=activations, transient_bytes=transient, peak_bytes=static + activations + transient,
                flops=sum(costs.handled(p, s) * stage_estimates[s].forward_flops for s in held), load=loads[p],
                plain_peak_bytes=static + plain_activations + plain_transient,
                recompute_flops=sum(c.flops for c in parts), seconds=float(compute + extra), extra_seconds=extra))
        mean = float(np.mean(loads))
        fits = None if self.budget is None else max(p.peak_bytes for p in positions) <= self.budget
        result = Plan(
            model_name=self.name, input_shape=self.shape, batch_size=self.batch_size, groups=self.groups, stages=K,
            schedule=costs.schedule, micro_batches=costs.m, balance_by=balance_by, optimizer=self.prof.optimizer,
            dtype=self.prof.dtype, memory_budget=self.budget, micro_batch_size=self.prof.micro_batch_size,
            cuts=list(cuts), unit_names=[u.name for u in units],
            stage_output_shapes=[list(units[cuts[s + 1] - 1].output_shapes) for s in range(K)],
            stage_output_dtypes=[list(units[cuts[s + 1] - 1].output_dtypes) for s in range(K)],
            stage_estimates=stage_estimates, positions=positions,
            load_unit={"memory": "B", "flops": "FLOP"}.get(balance_by, costs.time_unit),
            imbalance=max(loads) / mean if mean > 0 else 1.0, fits=fits, policies=list(policies),
            device=prices.device, host_bandwidth=prices.host_bandwidth, flops_per_second=self.rate)
        if any(p.kind != "none" for p in policies):
            def step(costs_of_plan) -> float:
                return simulate(result.schedule, K, result.micro_batches, costs_of_plan, IDEAL, self.groups).step_time
            timed = costs_from_plan(result, self.rate, 1.0)
            result.step_seconds = step(timed)
            runs = result.micro_batches * schedules.replicas(result.schedule)
            timed.backward = [b - s.extra_seconds / runs for b, s in zip(timed.backward, stage_estimates)]
            result.plain_step_seconds = step(timed)
        return result


def _smallest_fitting(prof: ModelProfile, schedule: str, K: int, m: int, budget: int, name: str,
                      policies: PolicyModel, kind: str) -> int:
    """The least stage count above K whose memory-balanced partition fits ``budget`` with
    ``kind`` on every stage.

    Stage counts that a lower bound already rules out are skipped without solving; the first
    one left that the solver's bound misses is also priced as the plan prices it (moment by
    moment), which can be lower. When no
    stage count fits, the error names either a unit that no partition can fit (cheap) or the
    least peak over all stage counts >= K (a solve per stage count: slow for 300+ units).
    """
    n = len(prof)
    kept = policies.kept(kind)
    floor, unit = memory_floor(prof, kept, policies.extra(kind))
    even = "" if kind == "none" else f" even with {kind_words(kind)} everywhere"
    if floor > budget:
        raise GemsError(f"no number of stages fits {name} in the memory budget of {format_size(budget)}{even}: "
                        f"however it is cut, the position holding unit {prof.units[unit].name} needs at least "
                        f"{format_size(floor)}, {format_size(floor - budget)} over the budget; "
                        "raise the budget or shrink the batch or image size")
    exact_tried = False
    for k in range(K + 1, n + 1):
        if memory_average(prof, k, kept) > budget:
            continue
        costs = CostModel(prof, schedule, k, m, None, policies, kind)
        if costs.memory_lower_bound() > budget:
            continue
        if solve(n, k, costs.memory, costs.peak, costs.mirror, limit=budget, refine=False,
                 remainder=costs.memory_remainder()) is not None:
            return k
        if not exact_tried:   # the solver's bound sums per-stage maxima; the plan prices moments
            exact_tried = True
            found = solve(n, k, costs.memory, costs.peak, costs.mirror, refine=False,
                          remainder=costs.memory_remainder())
            if found is not None and costs.timeline_peak(found.cuts) <= budget:
                return k
    best = None
    for k in range(n, K - 1, -1):   # nothing fits: the least peak any stage count reaches
        if best is not None and max(floor, memory_average(prof, k, kept)) >= best:
            continue
        costs = CostModel(prof, schedule, k, m, None, policies, kind)
        if best is not None and costs.memory_lower_bound() >= best:
            continue
        found = solve(n, k, costs.memory, costs.peak, costs.mirror, limit=best, refine=False,
                      remainder=costs.memory_remainder())
        if found is not None:
            best = found.value
    raise GemsError(f"no number of stages fits {name} in the memory budget of {format_size(budget)}{even}: the "
                    f"smallest possible peak is {format_size(best)}, {format_size(best - budget)} over the budget; "
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
