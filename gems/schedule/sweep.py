"""Simulated sweeps over configurations: weak scaling over data-parallel groups, and every layout
of a world ranked by throughput (``gems-plan --sweep``). Pure Python; each point is one
``gems.schedule.simulate.simulate``.

A layout is (schedule, K, m, P, D): K positions per group, P ranks at every position that is a
tile group (``topology.ranks_per_group``; P = 1: no spatial part), D groups. D is the most groups
the world holds, D x ranks per group <= world, over which the batch splits; ranks beyond them
stay idle. For each (schedule, K, m) the tile counts are tried in increasing order (1 first), and
the growth stops where more tiles cannot pay::

    P = 1, 2, 4, ...      planned (``costs_for``) and simulated while
      - no layout of (schedule, K, m) fits yet, or the next P keeps D (its tile ranks were idle);
      - a P that missed the budget had a lower peak than the P before it at the same D;
      - the planner could tile the model at all (``costs_for`` None for P > 1 ends the growth).

A P whose groups the world cannot hold (or over which the batch does not split) is skipped. So
tile groups are tried wherever the layout without them misses the budget or leaves ranks idle.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod
from typing import NamedTuple

from gems.schedule import generators as sch
from gems.schedule.network import Network
from gems.schedule.simulate import Costs, simulate
from gems.schedule.topology import ranks_per_group


class ScalingPoint(NamedTuple):
    groups: int          # D
    step_time: float     # seconds
    efficiency: float    # t(1 group) / t(D groups)


def scaling(name: str, K: int, m: int, costs: Costs, network: Network = Network(),
            groups_list: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
            optimizer_time: float = 0.0) -> list[ScalingPoint]:
    """Weak scaling: the same work per group on D groups; efficiency 1.0 means no cost of scale."""
    base = simulate(name, K, m, costs, network, 1, optimizer_time).step_time
    points = []
    for D in groups_list:
        t = simulate(name, K, m, costs, network, D, optimizer_time).step_time
        points.append(ScalingPoint(D, t, base / t if t > 0 else 1.0))
    return points


class Candidate(NamedTuple):
    schedule: str
    stages: int
    micro_batches: int
    groups: int
    step_time: float
    images_per_second: float
    peak_bytes: int      # the largest position's peak: the planner's when given, else static + activations
    tiles: int = 1       # P, ranks per tile group (1: no spatial part)
    ranks: int = 0       # ranks the layout uses: groups x ranks per group


def tile_count(tiles: int | tuple[int, int]) -> int:
    """P of a tile count or of a (rows, cols) grid."""
    return prod(tiles) if isinstance(tiles, tuple) else tiles


def most_groups(world: int, ranks: int, batch_size: int | None = None, parts: int = 1) -> int:
    """D: the most groups of ``ranks`` ranks that ``world`` holds and, with ``batch_size``, over which
    the batch splits into ``parts`` micro-batches per group (replicas x m); 0 when there are none."""
    for D in range(world // ranks, 0, -1):
        if batch_size is None or batch_size % (D * parts) == 0:
            return D
    return 0


def sweep(costs_for: Callable[..., tuple | None], world: int,
          network: Network = Network(), schedules: Sequence[str] = sch.SCHEDULES,
          stages: Sequence[int] = (1, 2, 4, 8), micro_batches: Sequence[int] = (1, 2, 4, 8),
          memory_budget: int | None = None, optimizer_time: float = 0.0, split: bool = False,
          tiles: Sequence[int | tuple[int, int]] = (1,), batch_size: int | None = None,
          suffix: bool = False) -> list[Candidate]:
    """Every layout (schedule, K, m, P, D) that fits ``memory_budget`` on ``world`` ranks, fastest
    first (fewer ranks, then less memory, on ties); the tile counts ``tiles`` (ascending, 1 for no
    spatial part, a (rows, cols) grid allowed) grown as the module docstring says.

    ``costs_for(schedule, K, m, D)`` -- with ``tiles=`` the tile count or grid for a layout with tile
    groups -- gives that configuration's ``(Costs, micro-batch size)`` or ``(Costs, micro-batch size,
    peak bytes)`` (e.g. from a plan made for it, whose peak knows memory policies and working
    memory), or None to skip it (say, a plan that cannot be made). Without a peak, the simulated
    static + activation peak is used. ``split``: every schedule with its backward split
    (``gems.pipeline.splitgrad``), unless a fourth element of the tuple says for that configuration
    (a plan that chose for itself); a fifth names the schedule search's order to replay
    (``Plan.order``; the search's own without). ``batch_size``: D also splits it (else D is the most
    groups the world holds). ``suffix``: a spatial suffix is asked for, so a one-replica pipeline's
    last position is a tile group too (``topology.tiled_positions``).
    """
    found = []
    for name in schedules:
        for K in stages:
            for m in ([1] if name == "mp" else micro_batches):
                found += _grown(costs_for, world, name, K, m, network, memory_budget, optimizer_time, split, tiles,
                                batch_size, suffix)
    return sorted(found, key=lambda c: (-c.images_per_second, c.ranks, c.peak_bytes))


def _grown(costs_for: Callable[..., tuple | None], world: int, name: str, K: int, m: int, network: Network,
           memory_budget: int | None, optimizer_time: float, split: bool, tiles: Sequence[int | tuple[int, int]],
           batch_size: int | None, suffix: bool) -> list[Candidate]:
    """The layouts of (``name``, K, m) that fit, P grown as the module docstring says."""
    found, fitted, last = [], 0, None   # fitted: D of the first layout that fits (0: none yet); last: (D, peak)
    for tile in tiles:
        P = tile_count(tile)
        size = ranks_per_group(K, name, P, suffix)
        D = most_groups(world, size, batch_size, sch.replicas(name) * m)
        if D == 0:
            continue
        if fitted and D < fitted:   # more tiles would only take ranks from data parallelism
            break
        made = costs_for(name, K, m, D) if P == 1 else costs_for(name, K, m, D, tiles=tile)
        if made is None:
            if P > 1:
                break
            continue
        result = simulate(name, K, m, made[0], network, D, optimizer_time, made[3] if len(made) > 3 else split,
                          order=made[4] if len(made) > 4 else "")
        peak = made[2] if len(made) > 2 and made[2] is not None else max(result.peak_bytes)
        if memory_budget is None or peak <= memory_budget:
            found.append(Candidate(name, K, m, D, result.step_time, result.throughput(made[1]), peak, P, D * size))
            fitted = fitted or D
        elif P > 1 and last is not None and last[0] == D and peak >= last[1]:   # more tiles no longer help
            break
        last = D, peak
    return found
