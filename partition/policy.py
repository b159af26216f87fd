"""What per-stage memory policies save and cost: recomputation and offloading, priced from
the profile's storages. ``gems.pipeline.stage`` applies them; its docstring is the contract priced here.

Stage [lo, hi) with policy (segments, offload), on a position with f micro-batches of it in
flight, costs f x ``kept`` bytes plus ``extra`` bytes once (like the working memory: a
position runs one stage at a time)::

    D       = the stage input and output (the engine holds both until the backward)
    kept    = D + what is still saved: every unit's saved storages, except that a recompute
              segment keeps only its input (the storages crossing into its first unit)
    offload = of that, everything beyond D goes to host memory, except storages < 64 KiB
              (``back``; what that holds in host memory: ``costs.CostModel.host_bytes``)
    extra   = back + how far the highest segment backward rises above what the stage retains
              (on the device or back from the host) plus its working memory: while segment
              [a, b) runs its backward, the device holds D, what units < b retain (the later
              ones are done and freed), the segment's rematerialised bytes and its own working
              memory W[a, b] (without recompute, the stage's W hides under activations of later
              units already freed) (back = what returns from the host; without recompute, A - kept)
    peak    = static + at the position's highest moment (``gems.schedule.generators.moments``): f x kept
              of every stage alive then + working + extra of the stage computed (the solver
              balances a bound: sum over its stages of f x kept + max over them of working + extra)

A forward whose next compute action is its own backward (*immediate*, as opposed to
*waiting*: ``gems.schedule.generators.waiting_forwards``) offloads nothing and leaves its stage's last
segment unchecked; it reaches the same peak. Time added per step on a position, with seconds
per unit from FLOPs at the device rate (or measured times)::

    recompute   waiting forwards x forward seconds of every segment
              + immediate forwards x forward seconds of the segments but the last
    offload     waiting forwards x max(0, 2 x back / host bandwidth - stage compute): the
                copies out (in forward) and back (beside the compute action before the
                backward) hide behind compute if they can

On a CPU device host memory is device memory: offloading saves nothing (nor is it timed).

A stage's segmentation minimises its peak: with S = bytes of the segment inputs kept and M =
the largest segment's rematerialised bytes, each position holding it costs w S + M + c for
constants w, c that depend on f and offloading (``segments.best_segments``: exact, by a DP
over every candidate value of M), then checked against two fixed segmentations at exact
prices. The solver, which prices every [lo, hi) at once, uses "natural" segments
(``PolicyModel.natural``: a new segment wherever the next unit saves its input anyway, so
recomputing never keeps more than no policy; one per unit for ResNets).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gems.plan import MIN_OFFLOAD_BYTES, StagePolicy
from .options import HOST_BANDWIDTH, parts
from .records import ModelProfile, Storage, segment_bytes
from .segments import best_segments

MAX_PARTIAL = 32             # partial-recompute policies tried per stage and kind


@dataclass(frozen=True)
class Holder:
    """A position holding a stage: its micro-batches in flight at the peak, run per step, and
    the waiting forwards among them (module docstring)."""

    position: int
    in_flight: int
    handled: int
    waiting: int


@dataclass(frozen=True)
class StageMemory:
    """Bytes of one micro-batch of a stage under a policy (module docstring)."""

    plain: int    # A: kept without a policy
    kept: int     # kept per micro-batch in flight
    back: int     # returns from the host before its backward
    remat: int    # the largest segment's rematerialised bytes + its working memory, beyond the stage's

    @property
    def extra(self) -> int:
        """Bytes on top of the working memory while the stage runs a backward."""
        return self.back + self.remat


class PolicyModel:
    """Memory and time of policies for one profile on one device (module docstring).

    ``forward_seconds`` / ``backward_seconds``: per unit, one micro-batch.
    """

    def __init__(self, profile: ModelProfile, device: str, forward_seconds: Sequence[float],
                 backward_seconds: Sequence[float], host_bandwidth: float = HOST_BANDWIDTH,
                 barriers: Sequence[int] = ()) -> None:
        self.profile, self.device, self.host_bandwidth = profile, device, host_bandwidth
        self.offload_works = device != "cpu"
        self.forward = np.concatenate([[0.0], np.cumsum(forward_seconds)])    # prefix sums
        self.compute = self.forward + np.concatenate([[0.0], np.cumsum(backward_seconds)])
        self.forward_flops = profile.unit_sums("forward_flops")
        n = len(profile)
        self.plain = profile.activation_matrix()
        self.working = profile.working_matrix()
        self.nbytes = np.array([s.nbytes for s in profile.storages], dtype=np.int64)
        self.saved_by: list[list[int]] = [[] for _ in range(n)]
        self.crossing: list[list[int]] = [[] for _ in range(n + 1)]       # [b + 1]: boundary b
        for i, s in enumerate(profile.storages):
            for u in s.savers:
                self.saved_by[u].append(i)
            for b in s.boundaries:
                self.crossing[b + 1].append(i)
        # A segment starts for free at unit a when a saves all it receives anyway (ResNet blocks do).
        self.free_start = [a > 0 and all(a in profile.storages[i].savers for i in self.crossing[a]) for a in range(n)]
        # No segment crosses an edge of a spatial part (``barriers``: its end, a suffix's start): one starts there.
        self.barriers = [b for b in barriers if 0 < b < n]
        for b in self.barriers:
            self.free_start[b] = True
        self.touchers = [s.touchers() for s in profile.storages]
        self._matrices: dict[str, np.ndarray] = {}
        self._memories: dict[tuple, StageMemory] = {}

    # -- natural segments, every [lo, hi) at once: for the solver --------------------------
    def natural(self, lo: int, hi: int) -> list[list[int]]:
        """Segments of [lo, hi) starting at lo and at every free start: they keep no more than
        the stage keeps without a policy (for ResNets: one segment per unit)."""
        starts = [lo] + [a for a in range(lo + 1, hi) if self.free_start[a]]
        return [[a, b] for a, b in zip(starts, starts[1:] + [hi])]

    def kept(self, kind: str) -> np.ndarray:
        """K[lo, hi]: bytes kept per micro-batch in flight when every stage has ``kind``
        (recompute: in natural segments, on the stages where it lowers the peak of one
        micro-batch; the others keep what they keep without a policy, as ``auto`` chooses)."""
        if not parts(kind)[0]:
            return self._kept(kind)
        return self._matrix(f"kept where helps {kind}",
                            lambda: np.where(self.helps(kind), self._kept(kind), self.plain))

    def extra(self, kind: str) -> np.ndarray:
        """X[lo, hi] >= ``StageMemory.extra`` when every stage has ``kind`` (as ``kept``;
        exact but for the rematerialised bytes, an upper bound)."""
        if not parts(kind)[0]:
            return self._extra(kind)
        return self._matrix(f"extra where helps {kind}", lambda: np.where(self.helps(kind), self._extra(kind), 0.0))

    def helps(self, kind: str) -> np.ndarray:
        """Where recomputing lowers a stage's peak for one micro-batch: a segment's backward can
        rise above what the whole stage needs without it (module docstring)."""
        return self._matrix(f"helps {kind}", lambda: self._kept(kind) + self._extra(kind) < self.plain)

    def _kept(self, kind: str) -> np.ndarray:
        recompute, offload = parts(kind)
        offload = offload and self.offload_works
        if not recompute and not offload:
            return self.plain
        n = len(self.profile)

        def savers(s: Storage) -> tuple[int, ...]:     # recompute: segment starts keep their input
            return tuple(b + 1 for b in s.boundaries if b + 1 < n and self.free_start[b + 1]) if recompute \
                else s.savers
        return self._matrix(f"kept {recompute} {offload}", lambda: self._union([
            Storage(s.nbytes, savers(s), s.boundaries) for s in self.profile.storages
            if not offload or s.nbytes < MIN_OFFLOAD_BYTES or s.boundaries], tiny_only=offload))

    def _extra(self, kind: str) -> np.ndarray:
        recompute, _ = parts(kind)
        if not recompute:
            return self._matrix(f"extra {kind}", lambda: self.plain - self._kept(kind))
        return self._matrix(f"extra {kind}", lambda: self._kept("recompute") - self._kept(kind)
                            + np.maximum(self._largest() - self.working, 0.0))

    def last_start(self) -> np.ndarray:
        """L[lo, hi]: where the last natural segment of [lo, hi) starts."""
        def build() -> np.ndarray:
            n = len(self.profile)
            latest = np.maximum.accumulate([a if a == 0 or self.free_start[a] else 0 for a in range(n)])
            before_end = np.concatenate([[0], latest])      # [hi]: the last free start below hi
            return np.maximum(np.arange(n + 1)[:, None], before_end[None, :])
        return self._matrix("last start", build)

    def _remat(self) -> np.ndarray:
        """R[a, b] >= how far segment [a, b)'s backward rises above what it keeps: what it saves
        beyond its input and output, rematerialised, plus its own working memory (which, once
        rematerialised, no longer hides under activations of later units already freed)."""
        return self._matrix("remat", lambda: np.maximum(self.plain - self._union(
            [Storage(s.nbytes, (), s.boundaries) for s in self.profile.storages], False), 0.0) + self.working)

    def _largest(self) -> np.ndarray:
        """M[lo, hi]: the largest ``_remat`` over the natural segments of [lo, hi)."""
        def build() -> np.ndarray:
            n, remat = len(self.profile), self._remat()
            out = np.zeros((n + 1, n + 1))
            for lo in range(n):
                done, start = 0.0, lo
                for hi in range(lo + 1, n + 1):
                    out[lo, hi] = max(done, remat[start, hi])
                    if hi < n and self.free_start[hi]:
                        done, start = out[lo, hi], hi
            return out
        return self._matrix("largest", build)

    def _union(self, storages: list[Storage], tiny_only: bool) -> np.ndarray:
        """The activation matrix of other storages: bytes of D plus storages 'saved' inside."""
        if tiny_only:
            storages = [s if s.nbytes < MIN_OFFLOAD_BYTES else Storage(s.nbytes, (), s.boundaries) for s in storages]
        return segment_bytes(len(self.profile), storages)

    def _matrix(self, key: str, build) -> np.ndarray:
        if key not in self._matrices:
            self._matrices[key] = build()
        return self._matrices[key]

    # -- one stage, exactly ---------------------------------------------------------------
    def memory(self, lo: int, hi: int, policy: StagePolicy) -> StageMemory:
        """Bytes of stage [lo, hi) under ``policy``, from the storages (module docstring). Kept per
        stage, recompute segments and offload: a plan's search asks for the same ones again and again
        (a sweep of resnet50 at 16384^2 on 16 ranks: 119 thousand times for 35 thousand)."""
        key = (lo, hi, tuple(tuple(segment) for segment in policy.recompute), bool(policy.offload))
        if key not in self._memories:
            self._memories[key] = self._memory(lo, hi, policy)
        return self._memories[key]

    def _memory(self, lo: int, hi: int, policy: StagePolicy) -> StageMemory:
        boundary = self._held(lo, hi, lo) | self._held(lo, hi, hi)
        in_segment = np.zeros(hi - lo, dtype=bool)
        retained = set(boundary)
        for a, b in policy.recompute:
            in_segment[a - lo:b - lo] = True
            retained.update(self._held(lo, hi, a))
        everything = set(boundary)
        for u in range(lo, hi):
            everything.update(self.saved_by[u])
            if not in_segment[u - lo]:
                retained.update(self.saved_by[u])
        kept = retained
        if policy.offload and self.offload_works:
            kept = boundary | {i for i in retained if self.nbytes[i] < MIN_OFFLOAD_BYTES}
        # The backward runs the stage from its last unit down: while segment [a, b) is
        # rematerialised, what units >= b alone held for backward is already freed.
        held_from = {}                                  # storage -> first unit holding it for backward
        for u in range(lo, hi):
            if not in_segment[u - lo]:
                for i in self.saved_by[u]:
                    held_from.setdefault(i, u)
        for a, _ in policy.recompute:
            for i in self._held(lo, hi, a):
                held_from[i] = min(held_from.get(i, a), a)
        largest = max((self._bytes(boundary | {i for i in retained if held_from.get(i, lo) < b})
                       + self._bytes({i for u in range(a, b) for i in self.saved_by[u]} - retained)
                       + self.working[a, b] for a, b in policy.recompute), default=0)
        # beyond what the stage holds anyway: all it retains, plus its own working memory
        remat = int(max(0, largest - self._bytes(retained) - self.working[lo, hi]))
        kept_bytes = self._bytes(kept)
        return StageMemory(plain=self._bytes(everything), kept=kept_bytes,
                           back=self._bytes(retained) - kept_bytes, remat=remat)

    def _held(self, lo: int, hi: int, a: int) -> set[int]:
        """The storages crossing into unit ``a`` (``a = hi``: out of the stage) that stage [lo, hi)
        holds: those it makes, reads or saves; a skip connection passing by is not sent to it."""
        return {i for i in self.crossing[a] if any(lo <= u < hi for u in self.touchers[i])}

    def _bytes(self, storages: set[int]) -> int:
        return int(self.nbytes[list(storages)].sum()) if storages else 0

    def choose(self, kind: str, lo: int, hi: int, holders: Sequence[Holder]) -> StagePolicy:
        """Stage [lo, hi) with ``kind``; recompute segments that minimise its peak on its holders."""
        recompute, offload = parts(kind)
        if not recompute:
            return StagePolicy(offload=offload)
        natural = StagePolicy(self.natural(lo, hi), offload)
        if hi - lo == 1:
            return natural
        hidden = offload and self.offload_works
        ends = self._held(lo, hi, lo) | self._held(lo, hi, hi)
        D = self._bytes(ends)
        # f (D + S) + M, or offloaded f D + S + M (the inputs come back one micro-batch at a time)
        terms = [(1.0 if hidden else float(h.in_flight), True, float(h.in_flight * D)) for h in holders]
        start_cost = [self._bytes(self._held(lo, hi, lo + j) - ends) for j in range(hi - lo)]
        remat = self._remat()[lo:hi + 1, lo:hi + 1]
        chosen = StagePolicy(self._split([[lo + a, lo + b] for a, b in best_segments(start_cost, remat, terms)]),
                             offload)
        # The DP prices approximately; the exact prices decide. Natural segments and one segment
        # for the whole stage never keep more than no policy -- unless cut at a spatial part's
        # edges (barriers), whose boundaries a segment keeps: then recomputing nothing is the choice.
        candidates = [p for p in (chosen, natural, StagePolicy(self._split([[lo, hi]]), offload))
                      if self.memory(lo, hi, p).kept <= self.plain[lo, hi]] or [StagePolicy(offload=offload)]
        return min(candidates, key=lambda p: (self.peak(lo, hi, p, holders), len(p.recompute)))

    def _split(self, segments: list[list[int]]) -> list[list[int]]:
        """``segments`` cut in two at every barrier one crosses."""
        for b in self.barriers:
            segments = [part for a, e in segments for part in ([[a, b], [b, e]] if a < b < e else [[a, e]])]
        return segments

    def partial(self, kind: str, lo: int, hi: int, holders: Sequence[Holder],
                segments: Sequence[Sequence[int]] | None = None, most: int = MAX_PARTIAL) -> list[StagePolicy]:
        """Stage [lo, hi) with ``kind`` recomputing only some of ``segments`` (default: the
        natural ones), for a budget that needs less than the whole stage recomputed: the
        segments ranked by bytes saved per second re-run on ``holders`` (free ones first, such
        as the last of an immediate forward), then the policies recomputing the first 1, 2, ...
        of them (not all; at most ``most``, evenly spaced)."""
        recompute, offload = parts(kind)
        segments = [list(s) for s in (self.natural(lo, hi) if segments is None else segments)]
        if not recompute or len(segments) < 2:
            return []
        base = self.memory(lo, hi, StagePolicy(offload=offload)).kept
        ranked = []
        for segment in segments:
            alone = StagePolicy([segment], offload)
            saved = base - self.memory(lo, hi, alone).kept
            cost = sum(self._rerun(hi, alone, h, self.forward) for h in holders)
            if saved > 0:
                ranked.append((-saved / cost if cost > 0 else -np.inf, segment[0], segment))
        ranked.sort()
        longest = len(ranked) - (len(ranked) == len(segments))
        counts = np.unique(np.linspace(1, longest, min(most, longest)).round().astype(int)) if longest else []
        return [StagePolicy(sorted(segment for _, _, segment in ranked[:count]), offload) for count in counts]

    def output_copied(self, lo: int, hi: int, policy: StagePolicy) -> int:
        """Bytes of stage [lo, hi)'s output that an offloading forward copies to the host and
        lets go as it ends (the engine keeps the output on the device): output storages of
        ``MIN_OFFLOAD_BYTES`` or more that units outside recompute segments save."""
        segmented = {u for a, b in policy.recompute for u in range(a, b)}
        saved = {i for u in range(lo, hi) if u not in segmented for i in self.saved_by[u]}
        output = self._held(lo, hi, hi) - set(self.crossing[lo])     # skips passing through are inputs
        return self._bytes({i for i in output & saved if self.nbytes[i] >= MIN_OFFLOAD_BYTES})

    def peak(self, lo: int, hi: int, policy: StagePolicy, holders: Sequence[Holder]) -> int:
        """The stage's largest contribution to a holder's peak, working memory aside."""
        mem = self.memory(lo, hi, policy)
        return max(h.in_flight for h in holders) * mem.kept + mem.extra

    def seconds(self, lo: int, hi: int, policy: StagePolicy, mem: StageMemory, holder: Holder) -> float:
        """Seconds the policy adds per step on ``holder``'s position (module docstring)."""
        total = self._rerun(hi, policy, holder, self.forward)
        if policy.offload and self.offload_works:
            total += holder.waiting * max(0.0, 2 * mem.back / self.host_bandwidth
                                          - (self.compute[hi] - self.compute[lo]))
        return float(total)

    def recompute_flops(self, hi: int, policy: StagePolicy, holder: Holder) -> int:
        """Forward FLOPs re-run per step on ``holder``'s position, for a stage ending at ``hi``."""
        return int(self._rerun(hi, policy, holder, self.forward_flops))

    def _rerun(self, hi: int, policy: StagePolicy, holder: Holder, prefix: np.ndarray) -> float:
        """A per-unit quantity (prefix sums) over what recomputation re-runs: every segment of
        a waiting forward, all but a last one ending the stage of an immediate forward."""
        segments = sum(prefix[b] - prefix[a] for a, b in policy.recompute)
        unchecked = 0.0
        if policy.recompute and policy.recompute[-1][1] == hi:
            a, b = policy.recompute[-1]
            unchecked = prefix[b] - prefix[a]
        return holder.waiting * segments + (holder.handled - holder.waiting) * (segments - unchecked)

