"""``plan()``: validate the request, profile the model, cut it, choose memory policies,
estimate every position, and assemble the Plan.

    profile (fake run at the real size) -> PolicyModel, CostModel (schedule, K, m) -> solver
        -> budget (policies that fit, smallest K) -> Plan

Memory policies (recompute, offload; ``policy`` prices them): ``all`` puts one on every
stage and cuts with it priced in; ``auto`` (with a memory budget) keeps the plain plan when it
fits, else makes every stage as lean as allowed -- on the plain cuts and on cuts balanced for
that lean memory, keeping the faster of the two that fit -- and then, stage by stage, relaxes
to the cheapest policy that still fits (``budget.relax``). With a memory budget that the
requested K misses, the plan also names the smallest K that would fit
(``budget.smallest_fitting``).

A spatial part (``spatial``: P tiles, a grid, or ``auto`` when no plan without one fits the budget)
runs stage 0's first units on a tile group of P ranks: each candidate (grid, end) is priced on
the group leader's profile, planned as above, the best kept (``gems.partition.spatial``).

On a GPU, a rank also holds memory besides tensors (``overhead``: the CUDA context, NCCL's buffers);
with ``comm`` given, the plan reports it apart from the tensor peaks and leaves room for it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gems.errors import GemsError
from gems.graph import GraphUnits, balance_at, graph_units
from gems.plan import Plan, StagePolicy
from gems.plan import formats
from gems.schedule import generators as schedules
from gems.schedule.simulate import EFFICIENCY, V100_FLOPS
from gems.units import format_size, parse_size
from .backward import choose, split_mode
from .budget import relax, smallest_fitting
from .costs import BALANCE_BY, CostModel, unit_seconds
from .job import Job
from .options import HOST_BANDWIDTH, check_modes, check_placement, kinds, parse_bandwidth
from .placement import HOST, check_host_budget, on_device_where_it_fits, promoted
from .order import fastest_order
from .overhead import COMMS, device_overhead
from .policy import PolicyModel
from .profile import OPTIMIZER_STATE, profile
from .records import ModelProfile
from .cuts import balanced_cuts
from .solver import cuts_from_balance
from .request import dtype_of, input_shape_of, positive_int
from .spatial import AUTO_TILES, Tiling, parse_spatial, reaches, search, tiled_profile, tiled_times
from .swapping import SWAPPED

AMP = {"none": None, "bf16": torch.bfloat16}   # --amp: the dtype forwards autocast to


def plan(model: nn.Module, input_shape: Sequence[int], batch_size: int, stages: int,
         schedule: str = "mast", micro_batches: int = 1, balance_by: str = "memory",
         memory_budget: int | str | None = None, balance: Sequence[int] | None = None,
         optimizer: str = "sgd", dtype: torch.dtype | str = torch.float32, groups: int = 1,
         model_name: str | None = None, unit_times: Sequence[float] | None = None,
         recompute: str = "none", offload: str = "none", device: str = "cuda",
         host_bandwidth: float | str = HOST_BANDWIDTH, device_flops: float = V100_FLOPS,
         efficiency: float = EFFICIENCY, profiles: dict | None = None, amp: str = "none",
         comm: str | None = None, split_points: Sequence[str] | None = None,
         leaf_modules: Sequence[type[nn.Module] | str] = (), split_backward: bool | str | None = False,
         shard_optimizer: bool = False, spatial: int | str | tuple[int, int] | None = None,
         spatial_end: int | None = None, spatial_start: int | None = None, memory_format: str = "contiguous",
         compile: bool = False, state_placement: str = "device",
         host_memory_budget: int | str | None = None, host_update: dict[str, float] | None = None) -> Plan:
    """Cut ``model`` into ``stages`` stages for ``schedule``: an nn.Sequential's elements are its
    units; any other module is traced into units (``gems.graph.graph_units``, with
    ``leaf_modules`` run whole) at this plan's micro-batch shape. ``split_points`` (module paths,
    one per stage after the first: ``["encoder.layer3", "decoder.blocks.1"]``) fixes where stages
    begin instead of the solver.

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
    several times (a sweep), so each micro-batch size is profiled (and its reach found) once. ``amp`` "bf16" prices
    activations as forwards under ``torch.autocast(dtype=torch.bfloat16)`` keep them
    (``gems.partition.profile``). ``comm`` ("mpi" or "torch", the transport the job will use)
    adds, on device "cuda", what every rank holds besides tensors (``Plan.device_overhead``:
    CUDA context, NCCL buffers) and counts it against ``memory_budget``; None leaves it out.
    ``spatial``: a tile count P (the grid with the least halo traffic), a grid (rows, cols) or
    "RxC", or "auto" (P = 2, 4, 8, 16 in turn, only when no plan without tiles fits
    ``memory_budget``); the tiled prefix of stage 0 ends at ``spatial_end`` (units [0, end)) or
    where the plan is best (module docstring); a suffix of the last stage (units [spatial_start, n),
    for models at full resolution at their end) is tiled too from that unit, never (0), or with
    one stage or mast where the plan is best with one (``spatial_start`` None; a one-replica
    pipeline of K >= 2 only from a given start: its last position becomes a tile group too).
    ``split_backward``: True ("on") splits each backward into input- and weight-gradient actions,
    None ("auto") plans with and without and keeps the faster that fits (``gems.partition.backward``).
    ``compile``: the stages' units will run compiled (``gems.pipeline.compiled``; ``Plan.compiled``): a
    compiled unit's backward is one autograd node, so the backward is never split (auto plans unsplit,
    True is refused).
    ``memory_format`` ("contiguous" or "channels_last", ``gems.plan.formats``): how the stages will lay
    out their 4-D tensors, which the profile runs in (kernels take different scratch memory); a model
    without 4-D parameters stays contiguous, with a note.
    ``state_placement`` ("device", "host-optimizer", "host" or "auto"): where every stage's model state lives
    (``StagePolicy.state_placement``, priced by ``gems.partition.placement`` and, for "host", whose parameters
    come to the device per weight group, ``gems.partition.swapping``); "auto", with a memory budget that the
    state on the device misses, plans every stage's optimizer on the host and brings back to the device each
    stage that still fits; where even that misses, every stage on "host", then brings each stage back to the
    device, or else to "host-optimizer", where it still fits (``placement.promoted``); where the device fits
    only with memory policies, the first of those is taken instead if it predicts a faster step. ``host_memory_budget``
    (bytes or "64GiB" per rank; None: unbounded) bounds host memory for model state and offloaded activations.
    ``host_update``: seconds per byte of gradients of a host update per optimizer, as
    ``gems.partition.calibrate`` measures them (None: ``placement.HOST_UPDATE``).
    Raises GemsError naming the fix for any unusable input.
    """
    name = model_name or type(model).__name__
    if not isinstance(model, nn.Module):
        raise GemsError(f"the model must be an nn.Module, got {type(model).__name__}")
    K = positive_int(stages, "the number of stages")
    m = positive_int(micro_batches, "the number of micro-batches")
    groups = positive_int(groups, "the number of groups")
    batch_size = positive_int(batch_size, "the batch size")
    schedules.check(schedule, K, m)
    split_backward = split_mode(split_backward)
    if compile and split_backward:
        raise GemsError("a compiled unit's backward is one autograd node, which the split backward cannot split: "
                        "drop --split-backward (or --compile)")
    unsplit_auto, split_backward = (split_backward is None, False) if compile else (False, split_backward)
    if balance_by not in BALANCE_BY:
        raise GemsError(f"cannot balance by {balance_by!r}: choose one of {', '.join(BALANCE_BY)}")
    if optimizer not in OPTIMIZER_STATE:
        raise GemsError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATE)}")
    replicas = schedules.replicas(schedule)
    parts = groups * replicas * m   # micro-batches of the whole job
    if batch_size % parts:
        raise GemsError(f"batch size {batch_size} does not split into {groups} group(s) x {replicas} replica(s) x "
                        f"{m} micro-batch(es): use a multiple of {parts}")
    check_modes(recompute, offload)
    check_placement(state_placement)
    host_budget = None if host_memory_budget is None else parse_size(host_memory_budget)
    if host_update is not None and not (isinstance(host_update, dict) and isinstance(host_update.get(optimizer), float)
                                        and host_update[optimizer] > 0):
        raise GemsError(f"host_update must give {optimizer}'s seconds per byte of a host update, a positive float, "
                        f"e.g. {{'{optimizer}': 0.4e-9}}")
    if host_budget is not None and host_budget <= 0:
        raise GemsError("the host memory budget must be positive, e.g. 64GiB")
    if device not in ("cuda", "cpu"):
        raise GemsError(f"the device to plan for must be 'cuda' or 'cpu', got {device!r}")
    bandwidth = parse_bandwidth(host_bandwidth)
    if amp not in AMP or comm not in (None, *COMMS):
        raise GemsError(f"amp must be one of {', '.join(AMP)} and comm one of {', '.join(COMMS)} (or None), "
                        f"got {amp!r} and {comm!r}")
    if not (isinstance(device_flops, (int, float)) and device_flops > 0 and isinstance(efficiency, (int, float))
            and 0 < efficiency <= 1):
        raise GemsError(f"the device rate must be positive and the efficiency in (0, 1], got {device_flops!r} "
                        f"and {efficiency!r}: e.g. 15.7e12 and 0.4")
    request = parse_spatial(spatial)
    if spatial_end is not None and (request is None or isinstance(spatial_end, bool) or not isinstance(spatial_end, int)
                                    or spatial_end < 1):
        raise GemsError(f"the spatial part's end must be a positive unit count with --spatial, got {spatial_end!r}")
    # suffixes searched where the tile groups of stage 0 hold the last stage too (no extra ranks); a
    # one-replica pipeline of K >= 2 tiles one only from a given start (its last position becomes a tile group)
    suffixes = request is not None and (K == 1 or schedule == "mast" or bool(spatial_start))
    if spatial_start and (request is None or isinstance(spatial_start, bool) or not isinstance(spatial_start, int)
                          or spatial_start < 1):
        raise GemsError(f"a spatial suffix needs --spatial and a positive start unit, got {spatial_start!r}")
    budget = None if memory_budget is None else parse_size(memory_budget)
    if budget is not None and budget <= 0:
        raise GemsError("the memory budget must be positive, e.g. 40GiB")
    overhead = device_overhead(schedule, K, groups, comm) if device == "cuda" and comm is not None else {}
    if budget is not None and budget <= sum(overhead.values()):
        raise GemsError(f"the memory budget of {format_size(budget)} leaves nothing for tensors once every rank's "
                        f"{format_size(sum(overhead.values()))} besides them (CUDA context, communicator buffers) "
                        "is counted: raise --memory-budget")
    shape = input_shape_of(input_shape)
    torch_dtype = dtype_of(dtype)
    leaves = [c if isinstance(c, str) else c.__name__ for c in leaf_modules]
    if not isinstance(model, GraphUnits):   # any nn.Module: its chain of units (gems.graph)
        model = graph_units(model, shape, batch_size // parts, leaves, model_name=name)
    n = len(model)
    if n == 0:
        raise GemsError(f"{name} has no units to run: give it at least one module")
    if K > n:
        raise GemsError(f"{name} has {n} units, so it cannot be cut into {K} stages: use at most {n} stages")
    if split_points is not None:
        if balance is not None:
            raise GemsError("give either split points or a balance, not both")
        balance = balance_at(getattr(model, "unit_names", [str(i) for i in range(n)]), split_points, K)
    cuts = None if balance is None else cuts_from_balance(balance, n, K)
    if unit_times is not None and (len(unit_times) != n or any(not t >= 0 for t in unit_times)):
        raise GemsError(f"unit_times must give one non-negative time per unit ({n} values)")

    memory_format = formats.name_of(memory_format)
    format_note = memory_format == "channels_last" and not formats.takes_format(model)
    memory_format = "contiguous" if format_note else memory_format
    # oneDNN's scratch memory differs by format (measured: ``python -m gems.partition.accuracy``); cuDNN's
    # workspace is priced as measured in NCHW on a GPU whatever the format, until measured in NHWC there
    profiled_format = memory_format if device == "cpu" else "contiguous"
    key = (batch_size // parts, shape, torch_dtype, optimizer, amp, profiled_format)
    profiles = {} if profiles is None else profiles
    if key not in profiles:
        profiles[key] = profile(model, shape, batch_size // parts, torch_dtype, optimizer, name, AMP[amp],
                                profiled_format)
    prof = profiles[key]
    rate = float(device_flops * efficiency)
    sharers = groups * sum(0 in schedules.holds(schedule, K, p) for p in range(K)) if shard_optimizer else 1
    allowed = kinds(recompute, offload, device, budget is not None)

    def job(tiles: Tiling | None, placement: str | list[str]) -> Job:
        """What every plan with this spatial part (None: none) and state placement (of every unit, or per
        unit) shares: the profile and prices of the rank that holds the most, a tile group's leader, and of
        its other ranks (``gems.partition.spatial``)."""
        placements = [placement] * n if isinstance(placement, str) else placement
        share = [sharers * (tiles.tiles if tiles and shard_optimizer and tiles.tiled(u) else 1) for u in range(n)]
        def held(q: ModelProfile) -> ModelProfile:   # cut and fitted as the device holds it
            return q.sharded(share).on_host(where=[w != "device" for w in placements]).on_host(
                True, [w == SWAPPED for w in placements])
        p = held(prof if tiles is None else tiled_profile(prof, tiles))
        times = unit_times if tiles is None else tiled_times(unit_times, tiles)
        def priced(q: ModelProfile) -> PolicyModel:
            return PolicyModel(q, device, *unit_seconds(q, rate, times), bandwidth, tiles.barriers if tiles else ())
        member = priced(held(tiled_profile(prof, tiles, member=True))) if tiles else None
        return Job(p, model, priced(p), name, shape, batch_size, groups, budget, rate, overhead, amp, times, tiles,
                   member, placements, share, host_update)

    def solved(job: Job, split: bool) -> Plan:
        """The plan of ``job``: cut, assembled, with policies that fit the budget if any can."""
        costs = CostModel(job.prof, schedule, K, m, job.unit_times, job.policies, allowed[0], split,
                          job.tiling.end if job.tiling else 0, job.tiling.start if job.tiling else 0)
        found, loads = balanced_cuts(costs, balance_by, cuts)
        made = job.assemble(costs, found, loads, balance_by, _uniform(job.policies, costs, found, allowed[0]))
        if budget is not None and not made.fits and len(allowed) > 1:
            made = _fit(job, costs, found, loads, balance_by, allowed, recut=balance is None)

        def reordered(order: str) -> Plan:   # made's cuts and policies under another order of the search
            again = costs.reordered(order)
            return job.assemble(again, made.cuts, balanced_cuts(again, made.balance_by, made.cuts)[1], made.balance_by,
                                made.policies)
        return fastest_order(made, reordered)

    def planned(split: bool, plain: Job) -> tuple[Plan, str]:
        """The plan with the backward split or not, and what --spatial auto could not do."""
        result = solved(plain, split) if request in (None, "auto") else None
        why = ""   # for the error when nothing fits
        if request is not None and (result is None or (budget is not None and not result.fits)):
            reach, tail = reaches(profiles, list(model), prof, (batch_size // parts, *shape), K, spatial_start,
                                  suffixes and spatial_start != 0)   # kept with the profiles: once per size
            why = (f"; no spatial part helps either: {reach.reason}" if reach.end == 0 else
                   f", or tile stage 0 on more ranks than --spatial auto tries ({', '.join(map(str, AUTO_TILES))})")
            tiled = search(lambda tiles: solved(job(tiles, plain.placements), split), reach, request, spatial_end,
                           prof, K, cuts, tail)
            if tiled is not None and result is not None:
                tiled.notes.append(f"no plan without a spatial part fits the budget, so stage 0's units [0, "
                                   f"{tiled.spatial_end}) run on tile groups of {tiled.tiles} ranks (--spatial auto)")
            result = tiled or result
        return result, why

    def placed(placement: str) -> tuple[Plan, str, Job]:
        plain = job(None, placement)
        made, why = (choose(lambda split: planned(split, plain)) if split_backward is None
                     else planned(split_backward, plain))
        return made, why, plain

    def reassembled(made: Plan, placements: list[str]) -> Plan:
        """``made``'s cuts and policies with these per-stage placements."""
        again = job(None, [placements[s] for s in range(K) for _ in range(made.cuts[s], made.cuts[s + 1])])
        costs = CostModel(again.prof, schedule, K, m, again.unit_times, again.policies, allowed[0],
                          made.split_backward, order=made.order)
        return again.assemble(costs, made.cuts, balanced_cuts(costs, made.balance_by, made.cuts)[1], made.balance_by,
                              made.policies)

    result, why, plain = placed(state_placement if state_placement in (HOST, SWAPPED) else "device")
    if state_placement == "auto" and budget is not None and result.fits and any(p.kind != "none"
                                                                                 for p in result.policies):
        # the device fits by recomputing or offloading: the optimizer on the host may cost less
        lean = placed(HOST)
        if lean[0].fits:
            mixed = on_device_where_it_fits(lean[0], lean[2].room)
            if mixed.fits and mixed.step_seconds < result.step_seconds:
                mixed.notes.append(f"--state-placement auto: predicted {mixed.step_seconds:.4g} s per step, against "
                                   f"{result.step_seconds:.4g} s with every stage's state on the device and the "
                                   "memory policies it needs")
                result, why, plain = mixed, lean[1], lean[2]
    if state_placement == "auto" and budget is not None and not result.fits:
        lean = placed(HOST)
        if lean[0].fits:
            result, why, plain = on_device_where_it_fits(lean[0], plain.room), lean[1], lean[2]
        else:
            leaner = placed(SWAPPED)   # parameters on the host too, only where the optimizer's state is not enough
            if leaner[0].fits and not leaner[0].spatial_grid:
                leaner = (promoted(leaner[0], reassembled), *leaner[1:])
            result, why, plain = min((leaner, lean, (result, why, plain)),
                                     key=lambda made: (not made[0].fits, made[0].peak_bytes))
    check_host_budget(result, host_budget)
    if budget is not None and not result.fits and not result.spatial_grid:
        try:
            result.smallest_fitting_stages = smallest_fitting(plain.prof, schedule, K, m, plain.room, name,
                                                              plain.policies, allowed[-1], result.split_backward)
        except GemsError as error:
            raise GemsError(f"{str(error).rstrip('.')}{why}") from None
    if device == "cpu" and any(p.offload for p in result.policies):
        result.notes.append("offload on a CPU device: host memory is the device's memory, so it saves nothing "
                            "(the estimates count no saving)")
    result.leaf_modules = leaves   # the engine traces the model the same way
    result.shard_optimizer = shard_optimizer
    result.compiled = bool(compile)
    if unsplit_auto:
        result.notes.append("backward not split (--split-backward auto): a compiled unit's backward is one "
                            "autograd node (--compile)")
    result.memory_format = memory_format
    if format_note:
        result.notes.append(f"channels_last asked for, but {name} has no 4-D parameters for it to change: its stages "
                            "run in the default (contiguous) format")
    return result


def _uniform(policies: PolicyModel, costs: CostModel, cuts: list[int], kind: str) -> list[StagePolicy]:
    """``kind`` on every stage, recompute segments chosen per stage."""
    return [policies.choose(kind, cuts[s], cuts[s + 1], costs.holders(s)) for s in range(costs.K)]


def _fit(job: Job, costs: CostModel, cuts: list[int], loads: list[float], balance_by: str, allowed: list[str],
         recut: bool) -> Plan:
    """The fastest plan within the budget with policies from ``allowed`` on these cuts or (with
    ``recut``) on cuts balanced for the leanest of them (module docstring); the leanest plan
    when none fits."""
    options = [(cuts, loads, balance_by)]
    if recut:
        lean = CostModel(costs.profile, costs.schedule, costs.K, costs.m, None, job.policies, allowed[-1],
                         costs.split, costs.spatial_end, costs.spatial_start)
        options.append((*balanced_cuts(lean, "memory"), "memory"))
    found = []
    for option_cuts, option_loads, option_by in options:
        # message buffers and resident weight groups depend on the cuts (and the schedule) alone: the policies
        # must fit beside them
        chosen = relax(costs, option_cuts, allowed, job.room - job.reserved(costs, option_cuts))
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
