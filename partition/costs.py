"""What a stage costs on a position: memory, time or FLOPs, as matrices over segments.

For K stages under a schedule with m micro-batches per replica, stage s = units [lo, hi)
held by position p costs

    memory  static(lo, hi) + in_flight[p][s] * activations(lo, hi)   (+ transient, by max)
            + in_between[p][s] * captured(lo, hi)   with the backward split
    time    handled(p, s) * (forward + backward time of [lo, hi) per micro-batch)
    flops   handled(p, s) * forward FLOPs of [lo, hi) per micro-batch

static = parameters + gradients + optimizer state + buffers; in_flight comes from
``gems.schedule.generators.in_flight`` (micro-batches whose activations are alive at once at the
peak); handled(p, s) = m times the number of replicas that run stage s on position p. The
transient part (working memory of one forward or backward) counts once per position: a
position runs one stage at a time. Without measured times, "time" counts forward plus
backward FLOPs, a proxy that ranks stages the same way on one kind of device.
With the backward split (``gems.pipeline.splitgrad``), a micro-batch between its input half and
its weight half also keeps the gradient arriving at every op a parameter enters
(``UnitProfile.captured_bytes``), for as many micro-batches as are between the halves at once
(``in_between``); none for a stage from unit 0, whose backward is the weight half alone.

With a memory policy chosen per stage, ``CostModel.stage`` gives what the stage then puts on
each position holding it (kept bytes per micro-batch, transient bytes, seconds and FLOPs
added; ``gems.partition.policy`` prices the policy, ``unit_seconds`` turns FLOPs or
measured times into seconds) and ``highest`` a position's peak moment under the schedule.

Offload's host memory is priced apart from the device's (``CostModel.host_bytes``, the plan's
``host_bytes``): what a waiting forward offloads (``StageMemory.back``) stays in host memory
until the executor prefetches it, as the compute action before its backward begins
(``host_moments``); the forward running then adds its own, and a copy of its output, when
saved, that it lets go as it ends (the engine keeps the output on the device).

With a spatial part (``spatial_end``; the profile is then the tile group leader's,
``gems.partition.spatial``), the solver's costs keep it whole inside stage 0, and a suffix
(``spatial_start``) whole inside the last stage.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from gems.plan import StagePolicy
from gems.schedule import ir
from gems.schedule import generators as schedules
from .policy import Holder, PolicyModel
from .records import ModelProfile

BALANCE_BY = ("memory", "time", "flops")


def unit_seconds(profile: ModelProfile, rate: float,
                 unit_times: Sequence[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward seconds per unit for one micro-batch: FLOPs at ``rate`` FLOP/s, or
    measured forward + backward ``unit_times`` split in the ratio of the FLOPs (1:2 without)."""
    forward = np.array([u.forward_flops for u in profile.units], dtype=np.float64)
    backward = np.array([u.backward_flops for u in profile.units], dtype=np.float64)
    if unit_times is None:
        return forward / rate, backward / rate
    total = forward + backward
    share = np.divide(forward, total, out=np.full(total.shape, 1 / 3), where=total > 0)
    times = np.asarray(unit_times, dtype=np.float64)
    return times * share, times * (1 - share)


def _segments(prefix: np.ndarray) -> np.ndarray:
    """M[lo, hi] = prefix[hi] - prefix[lo]."""
    return prefix[None, :] - prefix[:, None]


def memory_floor(profile: ModelProfile, activations: np.ndarray | None = None,
                 extra: np.ndarray | None = None) -> tuple[float, int]:
    """A peak no partition can beat, whatever K or schedule, and the unit that forces it: the
    position holding unit u holds at least the cheapest stage containing u (its static
    memory, one micro-batch of its activations, its working memory). The max over u.
    ``activations`` / ``extra``: what a memory policy keeps and brings back (its least). A
    policy does not lower every stage's peak (a recomputed segment's backward can rise above
    the stage's own), so each stage counts the lesser of with and without it."""
    n = len(profile)
    plain = profile.activation_matrix()
    kept = plain if activations is None else np.minimum(plain, activations + _or(extra, 0.0))
    cost = _segments(profile.unit_sums("static_bytes")) + kept + profile.working_matrix()
    cost[np.tril_indices(n + 1)] = np.inf                             # only lo < hi are stages
    beyond = np.minimum.accumulate(cost[:, ::-1], axis=1)[:, ::-1]    # [lo, u+1] -> min over hi > u
    cheapest = np.diagonal(np.minimum.accumulate(beyond[:n, 1:], axis=0))   # u -> min over lo <= u
    unit = int(np.argmax(cheapest))
    return float(cheapest[unit]), unit


def memory_average(profile: ModelProfile, K: int, activations: np.ndarray | None = None) -> float:
    """A peak no partition into K stages can beat, whatever the schedule: every stage is held
    once or more with a micro-batch or more in flight, so the loads sum to at least the
    static memory plus the activations of the whole model (those a policy keeps, if given)."""
    n = len(profile)
    return float(profile.unit_sums("static_bytes")[-1] + _or(activations, profile.activation_matrix())[0, n]) / K


def _or(matrix, default):
    return default if matrix is None else matrix


def highest(moments: list[schedules.Moment], kept: dict[int, int], transient: dict[int, int],
            back: dict[int, int] | None = None, between: dict[int, int] | None = None,
            gradients: dict[int, int] | None = None) -> tuple[dict[int, int], int, int, int]:
    """A position's highest moment (``gems.schedule.generators.moments``): its live micro-batches per
    stage, the bytes they keep -- plus ``between`` per micro-batch between the halves of a split
    backward (none without) --, the transient bytes then: the stage computed's, plus ``back``
    of the stage whose offloaded tensors its prefetch brings back during it (none without), and the
    ``gradients`` of the stages whose step's gradients exist only from their first backward to their
    reduce (``host-optimizer``; none without)."""
    back, between, gradients = back or {}, between or {}, gradients or {}
    return max(((live, sum(n * kept[s] for s, n in live.items())
                 + sum(n * between.get(s, 0) for s, n in halves.items()),
                 transient[stage] + (back.get(early, 0) if early is not None else 0),
                 sum(gradients.get(s, 0) for s in made))
                for stage, live, early, halves, made in moments),
               key=lambda moment: moment[1] + moment[2] + moment[3])


def host_moments(actions: list[ir.Action]) -> list[tuple[int | None, dict[int, int]]]:
    """Every distinct moment of one position's compute actions for offload's host memory:
    (the stage of the waiting forward computed then, else None; {stage: earlier waiting
    forwards whose offloaded tensors are in host memory}). Those leave as the compute action
    before their backward begins (``gems.schedule.generators.prefetch_points``)."""
    def key(a: ir.Action) -> tuple[int, int, int]:
        return a.replica, a.micro, a.stage
    waiting = {key(a) for a in schedules.waiting_forwards(actions)}
    leaving = schedules.prefetch_points(actions)   # index -> the backward prefetched as it begins
    held: set[tuple[int, int, int]] = set()
    seen: list[tuple[int | None, dict[int, int]]] = []
    for i, a in enumerate(actions):
        if a.op not in ir.COMPUTE:
            continue
        held.discard(leaving.get(i))
        filling = a.stage if a.op == ir.FORWARD and key(a) in waiting else None
        moment = (filling, dict(sorted(Counter(k[2] for k in held).items())))
        if moment not in seen:
            seen.append(moment)
        if filling is not None:
            held.add(key(a))
    return seen


class OnPosition(NamedTuple):
    """What one stage with a policy puts on one position holding it, per step."""

    kept: int           # per micro-batch alive
    transient: int      # working memory + what comes back at a backward
    back: int           # what comes back from the host (offload), on the device from the action before
    seconds: float      # added by the policy
    flops: int          # forward FLOPs recomputed


class CostModel:
    """Cost matrices of one profile under (schedule, K, m), every stage with memory policy
    ``kind`` priced by ``policies`` (none without); see module docstring."""

    def __init__(self, profile: ModelProfile, schedule: str, K: int, micro_batches: int,
                 unit_times: Sequence[float] | None = None, policies: PolicyModel | None = None,
                 kind: str = "none", split: bool = False, spatial_end: int = 0, spatial_start: int = 0,
                 order: str = "") -> None:
        self.profile, self.schedule, self.K, self.m = profile, schedule, K, micro_batches
        self.spatial_end = spatial_end   # stage 0 must hold units [0, spatial_end): a spatial part (0: none)
        self.spatial_start = spatial_start   # the last stage must hold units [spatial_start, n): a suffix (0: none)
        self.split = split   # backward split into input and weight halves (gems.pipeline.splitgrad)
        self.order = order   # the schedule search's variant (Plan.order; empty: its choice on equal costs)
        self.unit_times = unit_times
        self.policies, self.kind = policies, kind
        self.mirror = schedules.replicas(schedule) == 2
        lists = schedules.schedule(schedule, K, micro_batches, split=split, order=order)
        self.moments = [schedules.moments(actions) for actions in lists]
        self.host_moments = [host_moments(actions) for actions in lists]
        self.in_flight = [schedules.most_alive(moments) for moments in self.moments]
        self.in_between = [schedules.most_alive(moments, between=True) for moments in self.moments]
        self._waiting = [Counter(a.stage for a in schedules.waiting_forwards(actions)) for actions in lists]
        self._holds = [schedules.holds(schedule, K, p) for p in range(K)]
        expected = [sorted({p, K - 1 - p}) if self.mirror else [p] for p in range(K)]
        if self._holds != expected:   # the solver's placement must be the schedule's
            raise RuntimeError(f"schedule {schedule} places stages as {self._holds}, the solver as {expected}")
        self.static = _segments(profile.unit_sums("static_bytes"))
        self.activations = profile.activation_matrix() if policies is None else policies.kept(kind)
        # kept per micro-batch between the halves of a split backward: the gradients arriving at the ops
        # the stage's parameters enter; none for a stage from unit 0, whose input (the image) takes no
        # gradient, so that its whole backward is the weight half (gems.pipeline.splitgrad)
        self.captured = _segments(profile.unit_sums("captured_bytes")) if split else \
            np.zeros((len(profile) + 1, len(profile) + 1))
        self.captured[0, :] = 0
        self.transient = profile.working_matrix()
        self.forward_flops = _segments(profile.unit_sums("forward_flops"))
        self._remainder: np.ndarray | None = None
        self._memory: dict[tuple, np.ndarray] = {}
        if unit_times is None:
            self.time = self.forward_flops + _segments(profile.unit_sums("backward_flops"))
            self.forward_time = self.forward_flops
            self.time_unit = "FLOP"
        else:
            forward, backward = unit_seconds(profile, 1.0, unit_times)
            self.time = _segments(np.concatenate([[0.0], np.cumsum(forward + backward)]))
            self.forward_time = _segments(np.concatenate([[0.0], np.cumsum(forward)]))
            self.time_unit = "s"

    def reordered(self, order: str) -> CostModel:
        """These costs under another order of the schedule search (``Plan.order``)."""
        return CostModel(self.profile, self.schedule, self.K, self.m, self.unit_times, self.policies, self.kind,
                         self.split, self.spatial_end, self.spatial_start, order)

    def holds(self, position: int) -> list[int]:
        """Stages a position holds (mirrored: p and K-1-p), per ``gems.schedule.generators.holds``."""
        return self._holds[position]

    def handled(self, position: int, stage: int) -> int:
        """Micro-batches of ``stage`` that ``position`` runs per step."""
        replicas = (stage == position) + (self.mirror and self.K - 1 - stage == position)
        return self.m * int(replicas)

    def waiting(self, position: int, stage: int) -> int:
        """Forwards of ``stage`` on ``position`` per step whose backward is not the next compute
        action (``gems.schedule.generators.waiting_forwards``): those a policy applies to in full."""
        return self._waiting[position][stage]

    def holders(self, stage: int) -> list[Holder]:
        """The positions holding ``stage``, with what its policy's price depends on."""
        return [Holder(p, self.in_flight[p][stage], self.handled(p, stage), self.waiting(p, stage))
                for p in range(self.K) if stage in self.holds(p)]

    def stage(self, cuts: list[int], s: int, policy: StagePolicy) -> dict[int, OnPosition]:
        """Per position holding stage s with ``policy``: its kept activations, transient bytes,
        added time and FLOPs (``policies`` prices the policy)."""
        lo, hi = cuts[s], cuts[s + 1]
        mem = self.policies.memory(lo, hi, policy)
        return {h.position: OnPosition(mem.kept, int(self.transient[lo, hi]) + mem.extra, mem.back,
                                       self.policies.seconds(lo, hi, policy, mem, h),
                                       self.policies.recompute_flops(hi, policy, h))
                for h in self.holders(s)}

    def host_bytes(self, cuts: list[int], policies: list[StagePolicy]) -> list[int]:
        """Per position, the host bytes offload holds at its highest (``host_moments``; what
        its pinned pool must hold); empty when no stage offloads or offloading saves nothing."""
        if not any(p.offload for p in policies) or not self.policies.offload_works:
            return []
        back, filling = {}, {}
        for s, policy in enumerate(policies):
            if policy.offload:
                back[s] = self.policies.memory(cuts[s], cuts[s + 1], policy).back
                filling[s] = back[s] + self.policies.output_copied(cuts[s], cuts[s + 1], policy)
        return [max(sum(n * back.get(s, 0) for s, n in held.items()) + filling.get(stage, 0)
                    for stage, held in self.host_moments[p]) for p in range(self.K)]

    def compute_seconds(self, position: int, cuts: list[int]) -> float:
        """Seconds of forward and backward per step on ``position`` under these cuts, at the
        policy model's seconds per unit (what policies add aside)."""
        compute = self.policies.compute
        return sum(self.handled(position, s) * (compute[cuts[s + 1]] - compute[cuts[s]]) for s in self.holds(position))

    def between(self, cuts: Sequence[int], s: int, policy: StagePolicy | None = None) -> int:
        """Bytes a micro-batch of stage s keeps between the halves of a split backward; none when
        ``policy`` recomputes in every forward, whose whole backward then runs in the input half
        (``gems.pipeline.executor``; a waiting forward alone recomputing still counts)."""
        if policy is not None and policy.checkpointed(False, cuts[s + 1]):
            return 0
        return int(self.captured[cuts[s], cuts[s + 1]])

    def memory(self, position: int, stage: int) -> np.ndarray:
        kept = self._scaled(self.activations, self.in_flight[position].get(stage, 0), self.static)
        return self._scaled(self.captured, self.in_between[position].get(stage, 0), kept) if self.split else kept

    def peak(self, position: int, stage: int) -> np.ndarray:
        if self.kind == "none":
            return self.transient
        return self._scaled(self.policies.extra(self.kind), 1, self.transient)

    def timeline_peak(self, cuts: Sequence[int]) -> int:
        """The largest position peak of these cuts priced moment by moment (``highest``), as
        the plan estimates it; the solver's ``memory`` + ``peak`` bound it from above."""
        stages = range(self.K)
        kept = {s: int(self.activations[cuts[s], cuts[s + 1]]) for s in stages}
        transient = {s: int(self.peak(0, s)[cuts[s], cuts[s + 1]]) for s in stages}
        between = {s: self.between(cuts, s) for s in stages}
        return max(sum(int(self.static[cuts[s], cuts[s + 1]]) for s in self.holds(p))
                   + sum(highest(self.moments[p], kept, transient, None, between)[1:]) for p in range(self.K))

    def time_cost(self, position: int, stage: int) -> np.ndarray:
        return self._scaled(self.time, self.handled(position, stage), self._rerun(position, stage, self.forward_time))

    def flops_cost(self, position: int, stage: int) -> np.ndarray:
        return self._scaled(self.forward_flops, self.handled(position, stage),
                            self._rerun(position, stage, self.forward_flops))

    def _rerun(self, position: int, stage: int, forward: np.ndarray) -> np.ndarray | None:
        """What recomputation in natural segments re-runs of ``forward`` (a segment matrix) per
        step: all of it per waiting forward, all but the last segment per immediate one."""
        if "recompute" not in self.kind:
            return None
        waiting, handled = self.waiting(position, stage), self.handled(position, stage)
        key = ("rerun", id(forward), waiting, handled)
        if key not in self._memory:
            n = len(self.profile)
            last = forward[self.policies.last_start(), np.arange(n + 1)[None, :]]
            self._memory[key] = handled * forward - (handled - waiting) * last
        return self._memory[key]

    def _scaled(self, matrix: np.ndarray, factor: int, plus: np.ndarray | None = None) -> np.ndarray:
        """factor * matrix (+ plus), one object per (matrix, factor, plus): the solver converts
        each once."""
        key = (id(matrix), factor, id(plus))
        if key not in self._memory:
            self._memory[key] = factor * matrix if plus is None else plus + factor * matrix
        return self._memory[key]

    def memory_lower_bound(self) -> float:
        """A peak no partition into K stages can beat (see ``memory_remainder``)."""
        return float(self.memory_remainder()[0, len(self.profile)]) / self.K

    def memory_remainder(self) -> np.ndarray:
        """T[lo, hi]: however units [lo, hi) are cut into stages, the positions holding them
        carry at least T in total, so the largest of k such positions at least T / k.

        A stage's static memory counts once per position holding it, and every storage kept
        by [lo, hi) is kept by at least one of its stages (the parts' activations sum to at
        least the whole's), once per micro-batch in flight there.
        """
        if self._remainder is None:
            holders = [[p for p in range(self.K) if s in self.holds(p)] for s in range(self.K)]
            copies = min(len(h) for h in holders)
            in_flight = min(sum(self.in_flight[p].get(s, 0) for p in h) for s, h in enumerate(holders))
            self._remainder = copies * self.static + in_flight * self.activations
        return self._remainder

    def objective(self, balance_by: str):
        """Solver arguments for what ``balance_by`` minimises: (cost, transient, remainder)."""
        if balance_by == "memory":
            return self._whole_spatial(self.memory), self.peak, self.memory_remainder()
        if balance_by == "time":
            return self._whole_spatial(self.time_cost), None, None
        return self._whole_spatial(self.flops_cost), None, None

    def _whole_spatial(self, cost):
        """``cost`` with every stage that would split the spatial part priced out (+inf): stage 0
        ending before ``spatial_end``, a later stage starting before it; with a suffix, the last
        stage starting after ``spatial_start``, an earlier one ending after it."""
        if not self.spatial_end:
            return cost
        edges = np.arange(len(self.profile) + 1)
        start = self.spatial_start or len(self.profile)

        def whole(position: int, stage: int) -> np.ndarray:
            matrix = cost(position, stage)
            first, last = stage == 0, stage == self.K - 1
            key = ("whole spatial", id(matrix), first, last)
            if key not in self._memory:
                split = edges[None, :] < self.spatial_end if first else edges[:, None] < self.spatial_end
                split = split | (edges[:, None] > start if last else edges[None, :] > start)
                self._memory[key] = np.where(split, np.inf, matrix)
            return self._memory[key]
        return whole
