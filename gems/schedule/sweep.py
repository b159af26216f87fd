"""Simulated sweeps over configurations: weak scaling over data-parallel groups, and every
(schedule, K, m, D) of a world ranked by throughput (``gems-plan --sweep``). Pure Python; each
point is one ``gems.schedule.simulate.simulate``."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from gems.schedule import generators as sch
from gems.schedule.simulate import Costs, Network, simulate


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


def sweep(costs_for: Callable[[str, int, int, int], tuple | None], world: int,
          network: Network = Network(), schedules: Sequence[str] = sch.SCHEDULES,
          stages: Sequence[int] = (1, 2, 4, 8), micro_batches: Sequence[int] = (1, 2, 4, 8),
          memory_budget: int | None = None, optimizer_time: float = 0.0, split: bool = False) -> list[Candidate]:
    """Every (schedule, K, m, D = world // K) that fits ``memory_budget``, fastest first.

    ``costs_for(schedule, K, m, D)`` gives that configuration's ``(Costs, micro-batch size)``
    or ``(Costs, micro-batch size, peak bytes)`` (e.g. from a plan made for it, whose peak
    knows memory policies and working memory), or None to skip it (say, a batch that does
    not split). Without a peak, the simulated static + activation peak is used. ``split``: every
    schedule with its backward split (``gems.pipeline.splitgrad``), unless a fourth element of the
    tuple says for that configuration (a plan that chose for itself); a fifth names the schedule
    search's order to replay (``Plan.order``; the search's own without).
    """
    found = []
    for name in schedules:
        for K in stages:
            if world % K:
                continue
            for m in ([1] if name == "mp" else micro_batches):
                made = costs_for(name, K, m, world // K)
                if made is None:
                    continue
                result = simulate(name, K, m, made[0], network, world // K, optimizer_time,
                                  made[3] if len(made) > 3 else split, order=made[4] if len(made) > 4 else "")
                peak = made[2] if len(made) > 2 and made[2] is not None else max(result.peak_bytes)
                if memory_budget is None or peak <= memory_budget:
                    found.append(Candidate(name, K, m, world // K, result.step_time,
                                           result.throughput(made[1]), peak))
    return sorted(found, key=lambda c: (-c.images_per_second, c.peak_bytes))
