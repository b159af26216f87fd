"""One candidate plan's shared inputs and its assembly: ``Job`` holds what every plan of one request,
spatial part and state placement shares (the profile as the device holds it, its policy prices, the
budget), and ``Job.assemble`` turns cuts and per-stage policies into a ``Plan`` with every stage's and
position's estimates (the planner, ``gems.partition.planner``, chooses the cuts and policies).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from torch import nn

from gems.pipeline.routes import Routes, tiled_sources
from gems.graph import stage_routes
from gems.plan import Plan, PositionEstimate, StageEstimate, StagePolicy
from gems.schedule import generators as schedules
from gems.schedule.simulate import costs_from_plan
from gems.schedule.topology import Topology, ranks_per_group
from gems.units import format_size
from .backward import predicted_step
from .costs import CostModel, highest
from .forward import forward_bytes, message_buffers
from .placement import HOST, host_seconds, host_state, optimizer_swap, stage_state
from .policy import PolicyModel
from .records import ModelProfile
from .spatial import Tiling, member_peaks
from .swapping import NOTE, SWAPPED, faster_grouping, group_bytes, resident_bytes, swap_volume, weight_groups


class Job:
    """What every candidate plan shares: the profile, its policy prices (``member``: of a tile group's
    other ranks), the request. ``room``: the budget left for tensors once ``overhead`` is counted."""

    def __init__(self, prof: ModelProfile, units: nn.Sequential, policies: PolicyModel, name: str,
                 shape: tuple[int, ...], batch_size: int, groups: int, budget: int | None, rate: float,
                 overhead: dict[str, int], amp: str, unit_times: Sequence[float] | None,
                 tiling: Tiling | None, member: PolicyModel | None = None, placements: Sequence[str] = (),
                 shares: Sequence[int] = (), update_rates: dict[str, float] | None = None) -> None:
        self.prof, self.units, self.policies, self.member, self.name = prof, units, policies, member, name
        # per unit, where its model state lives (gems.partition.placement, .swapping): a stage's is its first unit's
        self.placements = list(placements) or ["device"] * len(prof)
        self.shares = list(shares) or [1] * len(prof)   # per unit, the ranks sharing its optimizer
        self.update_rates = update_rates   # host updates' seconds per byte, measured (None: placement.HOST_UPDATE)
        self.shape, self.batch_size, self.groups, self.budget, self.rate = shape, batch_size, groups, budget, rate
        self.overhead, self.amp, self.unit_times, self.tiling = overhead, amp, unit_times, tiling
        self.room = None if budget is None else budget - sum(overhead.values())
        self.working = prof.working_matrix()
        self._sending: dict[tuple, list[int]] = {}

    def edges(self, cuts: Sequence[int]) -> Routes:
        """The messages between the stages of these cuts (``gems.pipeline.routes``), the skips of a
        spatial part that go tile to tile as tiles."""
        units, K, tiles = self.prof.units, len(cuts) - 1, self.tiling
        return Routes(stage_routes(self.units, cuts),
                      [list(units[cuts[s + 1] - 1].output_shapes) for s in range(K)],
                      [list(units[cuts[s + 1] - 1].output_dtypes) for s in range(K)],
                      tiled=tiled_sources(self.units, cuts, tiles.end, tiles.start) if tiles else (),
                      grid=tiles.grid if tiles else (1, 1))

    def sending(self, costs: CostModel, cuts: Sequence[int]) -> list[int]:
        """Per position, message buffers beyond the stages' own tensors at most (``message_buffers``)."""
        key = (costs.schedule, costs.K, costs.m, tuple(cuts), costs.split, costs.order)
        if key not in self._sending:
            self._sending[key] = message_buffers(*key[:3], self.edges(cuts), self.prof.micro_batch_size, costs.split,
                                                 order=costs.order)
        return self._sending[key]

    def resident(self, cuts: Sequence[int], held: Sequence[int]) -> int:
        """The device bytes the weight groups of the ``held`` stages on the host (``host``) take at most."""
        units = self.prof.units
        return resident_bytes([(units[cuts[s]:cuts[s + 1]], weight_groups(units[cuts[s]:cuts[s + 1]], cuts[s]), cuts[s])
                               for s in held if self.placements[cuts[s]] == SWAPPED], self.policies.device == "cuda")

    def reserved(self, costs: CostModel, cuts: Sequence[int]) -> int:
        """The most any position needs beside its stages' static memory, activations and working memory:
        message buffers and resident weight groups."""
        return max(sent + self.resident(cuts, costs.holds(p)) for p, sent in enumerate(self.sending(costs, cuts)))

    def swaps(self, lists: list, cuts: Sequence[int], estimates: list[StageEstimate],
              costs: CostModel, grouped: bool) -> list[dict[int, tuple[int, int]]]:
        """Per position, {stage: (bytes up, bytes down) per step} of the stages whose state is in host memory
        (``host``: moved per visit, ``grouped`` or not, ``gems.partition.swapping``)."""
        out: list[dict[int, tuple[int, int]]] = []
        for p, actions in enumerate(lists):
            moved = {}
            for s in costs.holds(p):
                e, placement = estimates[s], self.placements[cuts[s]]
                if placement == SWAPPED:
                    moved[s] = swap_volume(actions, {s: (e.grad_bytes, e.buffer_bytes)}, grouped)
                elif placement == HOST:
                    moved[s] = optimizer_swap(e.grad_bytes, e.buffer_bytes)
            out.append(moved)
        return out

    def assemble(self, costs: CostModel, cuts: list[int], loads: list[float], balance_by: str,
                 policies: list[StagePolicy]) -> Plan:
        K, units, prices = costs.K, self.prof.units, self.policies
        policies = [replace(p, state_placement=self.placements[cuts[s]], weight_groups=[])
                    for s, p in enumerate(policies)]
        edges = self.edges(cuts)
        sent = edges.message_bytes(self.prof.micro_batch_size)   # per edge: packed forward message
        stage_estimates, on = [], []
        tiles = self.tiling
        for s in range(K):
            lo, hi = cuts[s], cuts[s + 1]
            part, policy = units[lo:hi], policies[s]
            mem = prices.memory(lo, hi, policy)
            on.append(costs.stage(cuts, s, policy))
            optimizer, host, updated = stage_state(part, policy.state_placement, self.shares[lo:hi],
                                                   self.policies.device == "cuda")
            swapped = policy.state_placement == SWAPPED
            if swapped:
                policies[s] = policy = replace(policy, weight_groups=weight_groups(part, lo))
            stage_estimates.append(StageEstimate(
                stage=s, first_unit=lo, end_unit=hi, unit_names=[u.name for u in part],
                param_bytes=sum(u.param_bytes for u in part), grad_bytes=sum(u.grad_bytes for u in part),
                optimizer_bytes=optimizer, buffer_bytes=sum(u.buffer_bytes for u in part),
                activation_bytes=mem.kept, transient_bytes=int(self.working[lo, hi]),
                input_bytes=sum(b for (_, j), b in sent.items() if j == s),
                output_bytes=sum(b for (i, _), b in sent.items() if i == s),
                sends=[[j, b] for (i, j), b in sent.items() if i == s],
                forward_flops=sum(u.forward_flops for u in part), backward_flops=sum(u.backward_flops for u in part),
                plain_activation_bytes=mem.plain, recompute_bytes=mem.remat, offload_bytes=mem.back,
                extra_seconds=sum(c.seconds for c in on[s].values()),
                spatial_seconds=tiles.seconds if tiles and s == 0 else 0.0,
                split_bytes=costs.between(cuts, s, policy), host_state_bytes=host,
                host_seconds=host_seconds(updated, 0 if swapped else sum(u.grad_bytes for u in part),
                                          self.prof.optimizer, prices.host_bandwidth, self.update_rates) if host
                else 0.0,
                group_bytes=group_bytes(part, policy.weight_groups, lo) if swapped else []))
        positions = []
        sending = self.sending(costs, cuts)
        for p in range(K):
            held = costs.holds(p)
            est = [stage_estimates[s] for s in held]
            parts = [on[s][p] for s in held]
            between = {s: stage_estimates[s].split_bytes for s in held}
            # a host-optimizer stage's gradients exist from its first backward to its copy out, priced so
            lazy = {s: sum(u.lazy_grad_bytes for u in units[cuts[s]:cuts[s + 1]]) for s in held}
            live, activations, transient, gradients = highest(
                costs.moments[p], {s: on[s][p].kept for s in held}, {s: on[s][p].transient for s in held},
                {s: on[s][p].back for s in held}, between, lazy)
            _, plain_activations, plain_transient, plain_gradients = highest(
                costs.moments[p], {s: stage_estimates[s].plain_activation_bytes for s in held},
                {s: stage_estimates[s].transient_bytes for s in held}, None, between, lazy)
            in_flight = {s: int(live.get(s, 0)) for s in held}
            static = sum(e.param_bytes - e.grad_bytes + e.buffer_bytes if policies[e.stage].state_placement == SWAPPED
                         else e.static_bytes - lazy.get(e.stage, 0) for e in est) + self.resident(cuts, held)
            extra = sum(c.seconds for c in parts)
            compute = costs.compute_seconds(p, cuts) + costs.handled(p, 0) * stage_estimates[0].spatial_seconds
            positions.append(PositionEstimate(
                position=p, stages=held, units=sum(e.end_unit - e.first_unit for e in est),
                param_bytes=sum(e.param_bytes for e in est), static_bytes=static, in_flight=in_flight,
                activation_bytes=activations, transient_bytes=transient, gradient_bytes=gradients,
                peak_bytes=static + activations + transient + gradients + sending[p], send_bytes=sending[p],
                flops=sum(costs.handled(p, s) * stage_estimates[s].forward_flops for s in held), load=loads[p],
                plain_peak_bytes=static + plain_activations + plain_transient + plain_gradients + sending[p],
                recompute_flops=sum(c.flops for c in parts), seconds=float(compute + extra), extra_seconds=extra))
        P, suffix = (tiles.tiles, bool(tiles.start)) if tiles else (1, False)
        ranks = Topology(ranks_per_group(K, costs.schedule, P, suffix), K, costs.schedule, P, suffix)
        if tiles:   # a member's peak, its receives and sends of the skips' tiles (gems.pipeline.routes) included,
            buffers = message_buffers(costs.schedule, K, costs.m, edges, self.prof.micro_batch_size, costs.split,
                                      order=costs.order, members=ranks)
            tiled = {0, K - 1} if suffix else {0}   # and its resident weight groups (a bound: the whole stage's)
            for p, peak in enumerate(member_peaks(self.member, costs, cuts, policies, tiles)):
                resident = self.resident(cuts, [s for s in costs.holds(p) if s in tiled])
                positions[p].member_peak_bytes = peak + buffers[p] + resident if peak else 0
        lists = schedules.schedule(costs.schedule, K, costs.m, edges.skips, costs.split, costs.order)
        for p, got in enumerate(edges.received_bytes(lists, ranks, self.prof.micro_batch_size)):
            positions[p].received_bytes = got
        mean = float(np.mean(loads))
        fits = None if self.room is None else max(p.peak_bytes for p in positions) <= self.room
        result = Plan(
            model_name=self.name, input_shape=self.shape, batch_size=self.batch_size, groups=self.groups, stages=K,
            schedule=costs.schedule, micro_batches=costs.m, balance_by=balance_by, optimizer=self.prof.optimizer,
            dtype=self.prof.dtype, memory_budget=self.budget, micro_batch_size=self.prof.micro_batch_size,
            cuts=list(cuts), unit_names=[u.name for u in units],
            stage_output_shapes=edges.shapes, stage_output_dtypes=edges.names,
            stage_estimates=stage_estimates, positions=positions,
            load_unit={"memory": "B", "flops": "FLOP"}.get(balance_by, costs.time_unit),
            imbalance=max(loads) / mean if mean > 0 else 1.0, fits=fits, policies=list(policies),
            device=prices.device, host_bandwidth=prices.host_bandwidth, flops_per_second=self.rate, amp=self.amp,
            device_overhead=dict(self.overhead), host_bytes=costs.host_bytes(cuts, policies),
            forward_bytes=forward_bytes(self.prof, costs.schedule, K, costs.m, list(cuts), edges, order=costs.order),
            routes=edges.routes, split_backward=costs.split,
            order=costs.order or schedules.variant(costs.schedule, K, costs.m, costs.split),
            spatial_grid=list(tiles.grid) if tiles else [], spatial_end=tiles.end if tiles else 0,
            spatial_start=tiles.start if tiles else 0)
        result.state_host_bytes = host_state(result)
        if any(e.group_bytes for e in stage_estimates):
            result.swap_grouped = faster_grouping(result)
        swaps = self.swaps(lists, cuts, stage_estimates, costs, result.swap_grouped)
        for s, e in enumerate(stage_estimates):   # its busiest holder's, both ways
            e.swap_bytes = max((sum(moved[s]) for moved in swaps if s in moved), default=0)
        if result.state_host_bytes:
            result.swap_bytes = _totals(swaps)
        if any(e.group_bytes for e in stage_estimates):
            other = _totals(self.swaps(lists, cuts, stage_estimates, costs, not result.swap_grouped))
            result.notes.append(_swap_note(result, other))
        policed = any(p.kind != "none" for p in policies)
        if policed or tiles or result.state_host_bytes:   # the simulator counts the host updates and transfers
            timed = costs_from_plan(result, self.rate, 1.0)
            result.step_seconds = predicted_step(result, timed)
        if policed:
            runs = result.micro_batches * schedules.replicas(result.schedule)
            timed.backward = [b - s.extra_seconds / runs for b, s in zip(timed.backward, stage_estimates)]
            result.plain_step_seconds = predicted_step(result, timed)
        return result


def _totals(swaps: list[dict[int, tuple[int, int]]]) -> list[list[int]]:
    """Per position, [bytes up, bytes down] per step over its stages."""
    return [[sum(up for up, _ in moved.values()), sum(down for _, down in moved.values())] for moved in swaps]


def _swap_note(plan: Plan, other: list[list[int]]) -> str:
    """What the ``host`` stages' weight groups move per step, grouped as planned and the other way."""
    worst = max(range(plan.stages), key=lambda p: sum(plan.swap_bytes[p]))
    groups = sum(len(p.weight_groups) for p in plan.policies if p.state_placement == SWAPPED)
    ways = ("once per forward and backward action",
            "once per run of a stage's consecutive forwards (backwards) on a rank, group-major")
    up, down = plan.swap_bytes[worst]
    said = (f"{NOTE} {groups} weight group(s) come to the device {ways[plan.swap_grouped]}: position {worst} moves "
            f"{format_size(up)} up and {format_size(down)} down per step")
    if other == plan.swap_bytes:   # no run of two actions of a host stage: grouping changes nothing
        return f"{said}, as many grouped or not"
    why = ("fewer transfers outweigh less pipelining" if plan.swap_grouped else
           "more pipelining outweighs more transfers")
    return (f"{said} ({format_size(other[worst][0])} and {format_size(other[worst][1])} "
            f"{ways[not plan.swap_grouped]}; predicted slower: {why})")
