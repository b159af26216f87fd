"""A sweep's plans: every layout of ``gems.schedule.sweep`` on a number of ranks planned for one
model, simulated and ranked (``gems-plan --sweep``).

    swept = sweep_plans(model, (3, 16384, 16384), options, world=16, tiles=tile_counts("auto"))
    swept.best         # the plan of the fastest layout that fits (None: none does)
    swept.found        # the layouts that fit, fastest first (gems.schedule.sweep.Candidate)

Each layout is planned with ``plan()`` and the caller's options (memory budget, policies, split
backward, ...), its spatial part -- a tile count or grid, the prefix's end and a suffix (a U-Net's
decoder) where the plan is best, or as ``spatial_end`` / ``spatial_start`` ask -- searched by the
planner as ``gems-plan --spatial P`` does. The layouts share one ``profiles`` dict, so a model is
profiled, and its spatial reach found, once per micro-batch size. Tile counts grow only while they
can pay (``gems.schedule.sweep``), which keeps a sweep at 16384^2 on 16 ranks within a minute.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from gems.errors import GemsError
from gems.graph import GraphUnits, graph_units
from gems.plan import Plan
from gems.schedule.generators import replicas
from gems.schedule.network import V100_CLUSTER, Network
from gems.schedule.simulate import EFFICIENCY, V100_FLOPS, costs_from_plan
from gems.schedule.sweep import Candidate, most_groups, sweep, tile_count
from gems.schedule.topology import ranks_per_group
from gems.units import parse_size
from .planner import plan
from .spatial import AUTO_TILES, parse_spatial


def tile_counts(spatial: int | tuple[int, int] | str | None) -> tuple[int | tuple[int, int], ...]:
    """The tile counts a sweep tries for a ``--spatial`` request: None or "auto", no spatial part first,
    then ``AUTO_TILES``; a tile count or grid, only it."""
    request = parse_spatial(spatial)
    return (1, *AUTO_TILES) if request in (None, "auto") else (request,)


@dataclass
class Swept:
    """What a sweep planned: ``found`` the layouts that fit, fastest first; ``plans`` per (schedule,
    K, m, P) the plan made; ``over`` how many of them miss the budget; ``failed`` why layouts could
    not be planned (the planner's sentences)."""

    world: int
    found: list[Candidate]
    plans: dict[tuple[str, int, int, int], Plan]
    over: int
    failed: list[str]

    def plan_of(self, candidate: Candidate) -> Plan:
        return self.plans[candidate.schedule, candidate.stages, candidate.micro_batches, candidate.tiles]

    @property
    def best(self) -> Plan | None:
        """The plan of the fastest layout that fits; None when none does."""
        return self.plan_of(self.found[0]) if self.found else None


def sweep_plans(model: nn.Module, shape: Sequence[int], options: dict, world: int,
                tiles: Sequence[int | tuple[int, int]] = (1,), network: Network = V100_CLUSTER) -> Swept:
    """Every layout of (schedule, K dividing ``world``, m, P in ``tiles``, D) planned with ``plan()``'s
    keyword ``options`` (those of one ``gems-plan`` command: its stages, schedule, micro-batches,
    groups, balance and split points are the sweep's), simulated on ``network`` at the options'
    device rate x efficiency, fastest first (module docstring).
    GemsError in one sentence when no layout could be planned at all."""
    plans: dict[tuple[str, int, int, int], Plan] = {}
    failed: list[str] = []
    rate = options.get("device_flops", V100_FLOPS)
    efficiency = options.get("efficiency", EFFICIENCY)
    options = {**options, "profiles": options.get("profiles", {})}   # shared by every layout
    suffix = bool(options.get("spatial_start"))

    traced: dict[int, GraphUnits] = {}

    def units(micro_batch: int) -> GraphUnits:
        """The model's units traced at ``micro_batch`` (as ``plan()`` would), once per micro-batch size."""
        if micro_batch not in traced:
            traced[micro_batch] = model if isinstance(model, GraphUnits) else graph_units(
                model, shape, micro_batch, options.get("leaf_modules", ()), model_name=options.get("model_name"))
        return traced[micro_batch]

    def costs_for(name: str, K: int, m: int, D: int, tiles: int | tuple[int, int] = 1):
        spatial = ({"spatial": None, "spatial_end": None, "spatial_start": None} if tiles == 1 else
                   {"spatial": tiles, "spatial_end": options.get("spatial_end"),
                    "spatial_start": options.get("spatial_start")})
        try:
            p = plan(units(options["batch_size"] // (D * replicas(name) * m)), shape,
                     **{**options, "stages": K, "schedule": name, "micro_batches": m, "groups": D, "balance": None,
                        "split_points": None, **spatial})
        except GemsError as error:   # nothing fits this K, the model cannot be tiled so, ...
            failed.append(str(error))
            return None
        plans[name, K, m, tile_count(tiles)] = p
        return (costs_from_plan(p, rate, efficiency), p.micro_batch_size, p.peak_bytes + p.overhead_bytes,
                p.split_backward, p.order)   # with --split-backward auto, each plan's own choice

    # the unit count does not depend on the micro-batch: that of data parallelism on every rank, say
    n = len(units(options["batch_size"] // most_groups(world, 1, options["batch_size"])))
    stages = [k for k in range(1, world + 1) if world % k == 0 and k <= n]
    budget = None if options.get("memory_budget") is None else parse_size(options["memory_budget"])
    found = sweep(costs_for, world, network, stages=stages, memory_budget=budget, tiles=tiles,
                  batch_size=options["batch_size"], suffix=suffix)
    if not plans:
        raise GemsError(_nothing_tried(world, tiles, failed))
    over = sum(p.fits is False for p in plans.values())
    return Swept(world, found, plans, over, failed)


def _nothing_tried(world: int, tiles: Sequence[int | tuple[int, int]], failed: list[str]) -> str:
    """Why a sweep planned nothing, in one sentence."""
    if failed:
        reason, _ = Counter(failed).most_common(1)[0]
        return f"no layout on {world} ranks could be planned: {reason.rstrip('.')}"
    fewest = min(ranks_per_group(1, "mp", tile_count(t)) for t in tiles)
    return (f"{world} ranks are too few for any layout: a group with tile groups of {fewest} ranks needs at least "
            f"{fewest}; give --sweep {fewest} or more, or fewer tiles with --spatial")
