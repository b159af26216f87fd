"""The plan a training run follows: a ``--plan`` file checked against the run, or the planner's,
and with ``--spatial auto`` the tile count the launched ranks take.

``--spatial auto``: the launch fixes the world, so P fixes the groups, world = D x (K + (P - 1)
x tile groups). Auto keeps the smallest P -- 1 first, no spatial part -- whose layout splits the
batch (D x replicas x micro-batches divides it) and whose plan fits ``--memory-budget`` (the
first that splits, without one): tiles where data parallelism alone cannot fit or split the
batch, e.g. one image per step on many ranks.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from torch import nn

from gems import partition
from gems.errors import GemsError
from gems.graph import graph_units
from gems.plan import formats
from gems.schedule import generators as sch, search
from gems.schedule.topology import ranks_per_group
from gems.train.config import TrainConfig
from gems.units import format_size, parse_size


def make_plan(cfg: TrainConfig, model: nn.Sequential, groups: int, device: str = "cpu",
              loaded: partition.Plan | None = None):
    """The plan to train: ``loaded`` (``--plan``, read already) once checked against ``cfg`` and the
    model, else the planner's."""
    if cfg.plan:
        plan = loaded or partition.Plan.from_json(cfg.plan)
        wanted = {"stages": cfg.stages, "schedule": cfg.schedule, "micro_batches": cfg.micro_batches,
                  "batch_size": cfg.batch_size}
        for key, value in wanted.items():
            if getattr(plan, key) != value:
                raise GemsError(f"{cfg.plan} was made for {key.replace('_', '-')} {getattr(plan, key)}, "
                                f"not {value}: pass --{key.replace('_', '-')} {getattr(plan, key)} "
                                "or make a new plan")
        if cfg.channels_last is not None:   # the flag given: it decides the format, else the plan's stands
            plan.memory_format = cfg.memory_format(device) if formats.takes_format(model) else "contiguous"
        if cfg.compile and plan.split_backward:   # a compiled unit's backward is one node: it cannot be split
            raise GemsError(f"{cfg.plan} splits the backward, which compiled units cannot: make the plan with "
                            "gems-plan --compile or drop --compile")
        plan.compiled = cfg.compile
        if plan.tiles != cfg.tiles():
            raise GemsError(f"{cfg.plan} was made for tile groups of {plan.tiles} rank(s), not {cfg.tiles()}: pass "
                            f"--spatial {'x'.join(map(str, plan.spatial_grid)) or 1} or make a new plan")
        if tuple(plan.input_shape) != (3, cfg.image_size, cfg.image_size):
            raise GemsError(f"{cfg.plan} was made for inputs of {'x'.join(map(str, plan.input_shape))}, not "
                            f"3x{cfg.image_size}x{cfg.image_size}: pass the --image-size it was made for "
                            "or make a new plan")
        leaves = plan.leaf_modules
        if not (isinstance(leaves, list) and all(isinstance(name, str) for name in leaves)):
            raise GemsError(f"{cfg.plan} names leaf modules {leaves!r}, not a list of module names: make a new plan")
        # the units the engine runs: the model traced as gems-plan traced it, at this run's micro-batch
        micro = max(1, cfg.batch_size // (groups * sch.replicas(cfg.schedule) * cfg.micro_batches))
        names = graph_units(model, (3, cfg.image_size, cfg.image_size), micro, leaves).unit_names
        if plan.unit_names != names:
            raise GemsError(f"{cfg.plan} was made for a model of {_names(plan.unit_names)}, but "
                            f"{cfg.model} has {_names(names)}: make the plan for this model")
        try:   # the order the engine will build (gems.schedule.search)
            search.order(plan.schedule, plan.stages, plan.micro_batches, plan.split_backward, plan.order)
        except GemsError as error:
            raise GemsError(f"{cfg.plan}: {error}") from None
        return plan
    balance = None
    if cfg.balance:
        try:
            balance = [int(x) for x in cfg.balance.split(",")]
        except ValueError:
            raise GemsError(f"--balance takes comma-separated unit counts like 3,5,4, got {cfg.balance!r}") from None
    return partition.plan(model, input_shape=(3, cfg.image_size, cfg.image_size), batch_size=cfg.batch_size,
                          stages=cfg.stages, schedule=cfg.schedule, micro_batches=cfg.micro_batches,
                          balance_by=cfg.balance_by, balance=balance, optimizer=cfg.optimizer,
                          memory_budget=parse_size(cfg.memory_budget) if cfg.memory_budget else None,
                          groups=groups, model_name=cfg.model, recompute=cfg.recompute, offload=cfg.offload,
                          device=device, amp=cfg.amp, comm=cfg.comm, leaf_modules=cfg.leaf_module,
                          split_points=cfg.split_points.split(",") if cfg.split_points else None,
                          split_backward=cfg.split_backward, shard_optimizer=cfg.shard_optimizer,
                          state_placement=cfg.state_placement, host_memory_budget=cfg.host_memory_budget,
                          spatial=cfg.spatial, memory_format=cfg.memory_format(device), compile=cfg.compile)


def workspace_room(plan: partition.Plan, position: int, tile: int) -> int | None:
    """Bytes the memory budget leaves on this rank above the plan's estimate (its position's peak, a tile
    group member's own, and what a GPU holds besides tensors): room for cuDNN's workspace beyond the
    scratch the estimate counts. None without a budget."""
    if plan.memory_budget is None:
        return None
    estimate = plan.positions[position]
    peak = estimate.member_peak_bytes if tile and estimate.member_peak_bytes else estimate.peak_bytes
    return plan.memory_budget - peak - plan.overhead_bytes


def layouts(world: int, stages: int, schedule: str, micro_batches: int) -> Iterator[tuple[int, int, int]]:
    """(P, groups D, batch parts D x replicas x micro-batches) of every tile count P, 1 first, whose
    groups ``world`` ranks form."""
    for P in range(1, world + 1):
        size = ranks_per_group(stages, schedule, P)
        if world % size == 0:
            yield P, world // size, world // size * sch.replicas(schedule) * micro_batches


def auto_tiles(cfg: TrainConfig, world: int, model: nn.Module, device: str) -> tuple[str | None, partition.Plan]:
    """``--spatial auto`` on ``world`` ranks: the ``--spatial`` value to take (None: no spatial part)
    and its plan (module docstring); GemsError naming what each tile count lacked when none fits."""
    lacks = []
    for P, groups, parts in layouts(world, cfg.stages, cfg.schedule, cfg.micro_batches):
        if cfg.batch_size % parts:
            lacks.append(f"P = {P}: batch {cfg.batch_size} does not split into {parts}")
            continue
        try:
            # exactly P: the planner's own auto would tile where this P is 1
            plan = make_plan(replace(cfg, spatial=str(P) if P > 1 else None), model, groups, device)
        except GemsError as error:
            lacks.append(f"P = {P}: {str(error).rstrip('.')}")
            continue
        if plan.fits is not False:
            return (str(P) if P > 1 else None), plan
        lacks.append(f"P = {P}: a rank needs {format_size(max(p.peak_bytes for p in plan.positions))}")
    fits = f" and a plan that fits --memory-budget {cfg.memory_budget}" if cfg.memory_budget else ""
    raise GemsError(f"--spatial auto finds no tile count with which {world} ranks split batch {cfg.batch_size}{fits} "
                    f"({'; '.join(lacks) or 'no tile count divides them'}): launch more ranks or change the batch"
                    + (", or try --recompute auto or a smaller image" if fits else ""))


def check_task(task: str, output: list[int], model: str) -> None:
    """GemsError when the model's output (per image, from the plan) does not suit ``task``."""
    if task == "classification" and len(output) == 3 and min(output[1:]) > 1:
        raise GemsError(f"{model} outputs {'x'.join(map(str, output))} scores per image (a class per pixel): pass "
                        "--task segmentation (masks as labels), or train a model with one score per class")
    if task == "segmentation" and len(output) != 3:
        raise GemsError(f"{model} outputs {'x'.join(map(str, output))} scores per image, not a class per pixel: "
                        "pass --task classification, or train a segmentation model")


def _names(names: list[str]) -> str:
    """"3 units (0..2)" for messages."""
    return f"{len(names)} units ({names[0]}..{names[-1]})" if names else "no units"
