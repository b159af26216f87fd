"""Pricing a spatial part (``gems.spatial``): units [0, end) of stage 0 on a tile group of P = rows x
cols ranks at every position holding stage 0, the boundary at ``end`` gathered on the group's
leader, which runs the rest of the stage and its position's other stages. With a suffix
(``start``) units [start, n) are tiled as well, their inputs scattered from the leader of a tile group
holding the last stage (K = 1 or mast: stage 0's; a one-replica pipeline's last position otherwise)
and the model's output gathered on it.

The planner prices the leader, the most loaded rank of the group (the other members hold stage
0's parameters and their tiles only), by rewriting the profile (``tiled_profile``) and pricing it
as usual::

    tiled units       activations, working memory, FLOPs / P (a tile's share, rounded up), but
                      for the working memory the size of a parameter, whole on every tile
                      (``Tiling.weights``: the unit's largest parameter gradient before it is
                      accumulated, and the kernels' copies of its weight, ``partition.tracking``)
                      + per sliding window the halo rows and columns its tile fetches
                        (``Window.fetched``: kept for backward, and its gradient in backward)
                      + in working memory the copies of the tile a window makes beyond what
                        PyTorch's own layer would (``Window.copies``: the tile joined with its
                        halo in forward; in backward that region rebuilt and its gradient, the
                        tile's a view of it); the most of any window of the unit
    the image         a tile / P: the engine moves only this rank's tile of the batch to the device
    the gathered boundary at ``end``, and all after it up to a suffix: full; while gathering (or
                      scattering) a boundary, the other tiles' share of it in receive buffers
    a skip from the prefix to a suffix on another stage that no unit between reads: a tile, never
                      gathered or scattered (``gems.spatial.stage.tile_skips``: it goes tile to tile)
    parameters, gradients, optimizer state, buffers: full on every member

Time: compute of tiled units / P (from the FLOPs above), plus per micro-batch the halo fetches
of one rank, the gather at ``end`` (the leader receives all but its own tile) and a suffix's
scatter and output gather, each once in forward and once back in backward, over the intra-node
link of ``gems.schedule.simulate``'s V100 cluster (a tile group exchanges at every layer, so it
belongs on one node); group sums of normalisation statistics (a few bytes) are not counted.
``Tiling.seconds``.

The grid with the least halo traffic (``Window.traffic``) is chosen among ``geometry.grids(P)``
that the tiled activations allow (``choose_grid``).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from gems.errors import GemsError
from gems.plan import Plan
from gems.schedule.network import V100_CLUSTER
from gems.spatial.geometry import grids
from gems.spatial.limit import Reach, sizes_of, spatial_limit, suffix_limit
from gems.spatial.stage import check_grid
from .costs import CostModel, highest
from .policy import PolicyModel
from .records import ModelProfile, Storage

AUTO_TILES = (2, 4, 8, 16)    # P tried by spatial="auto", fewest ranks first
LINK = (V100_CLUSTER.intra_latency, V100_CLUSTER.intra_bandwidth)   # seconds per message, bytes/s


def parse_spatial(value: object) -> int | tuple[int, int] | str | None:
    """None, "auto", a tile count P (int or "4") or a grid ((2, 2) or "2x2"); GemsError otherwise."""
    if value is None or value == "auto":
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2:
        value = f"{value[0]}x{value[1]}"
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    match = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?", value) if isinstance(value, str) else None
    if not match or int(match.group(1)) < 1 or (match.group(2) is not None and int(match.group(2)) < 1):
        raise GemsError(f"--spatial must be a tile count P, a grid RxC of positive integers or auto, got {value!r}: "
                        "e.g. --spatial 4 or --spatial 2x2")
    if match.group(2) is None:
        return int(match.group(1))
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class Tiling:
    """A spatial part to price: the grid, its end (and a suffix's start, 0: none), and per
    micro-batch bytes a rank fetches per unit (halo) and the leader gathers at ``end`` (and
    scatters at ``start``, gathers at the output); ``skipped``: bytes per micro-batch of the skips
    that go tile to tile, neither gathered nor scattered (0: none)."""

    grid: tuple[int, int]
    end: int
    halo: list[int]        # per unit (0 for an untiled one)
    copies: list[tuple[int, int]]   # per unit, the most bytes its windows' copies of a tile hold,
                                    # (forward, backward) (``Window.copies``)
    gather: int
    messages: int          # halo, gather and scatter messages of one rank per forward
    start: int = 0
    skipped: int = 0
    weights: tuple[int, ...] = ()   # per unit, bytes of its largest trainable parameter (``Reach.weights``)

    @property
    def tiles(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def barriers(self) -> tuple[int, ...]:
        """Where a tiled range begins or ends inside the model: no recompute segment crosses one."""
        return (self.end, self.start) if self.start else (self.end,)

    def tiled(self, unit: int) -> bool:
        return unit < self.end or 0 < self.start <= unit

    def skips(self, s: Storage) -> bool:
        """Whether storage ``s`` is a skip that goes tile to tile (counted in ``skipped``)."""
        return bool(self.skipped) and _skip(s, self.end, self.start)

    @property
    def seconds(self) -> float:
        """Per micro-batch: the halo fetches, gathers and scatter, forward and backward (module docstring)."""
        latency, bandwidth = LINK
        return 2 * ((sum(self.halo) + self.gather) / bandwidth + self.messages * latency)


def choose_grid(reach: Reach, tiles: int, end: int) -> tuple[int, int] | None:
    """The grid of ``tiles`` ranks with the least halo traffic over the windows of units [0, end)
    among those every tiled activation there allows; None when none does."""
    fitting = [g for g in grids(tiles) if reach.end_for(g, end) == end]
    return min(fitting, key=lambda g: sum(w.traffic(g) for w in reach.windows if w.unit < end), default=None)


def tiling(reach: Reach, grid: tuple[int, int], end: int, prof: ModelProfile, suffix: Reach | None = None,
           stages: int = 1) -> Tiling:
    """The Tiling of units [0, end) (and a ``suffix`` reach's units) on ``grid`` of a plan of
    ``stages`` stages, bytes at the profile's dtype."""
    itemsize = _itemsize(prof.dtype)
    halo, copies = [0] * len(prof), [(0, 0)] * len(prof)
    messages = 0
    for w in [w for w in reach.windows if w.unit < end] + (suffix.windows if suffix else []):
        halo[w.unit] += w.fetched(grid) * itemsize
        copies[w.unit] = tuple(max(a, b * itemsize) for a, b in zip(copies[w.unit], w.copies(grid)))
        messages += 2 * sum(1 for count, extra in zip(grid, w.halos(grid)) if count > 1 and extra)
    P = grid[0] * grid[1]
    boundary = prof.boundary_bytes()
    skipped = sum(s.nbytes for s in prof.storages if _skip(s, end, suffix.first)) if suffix and stages > 1 else 0
    # gathered at the end, and with a suffix scattered at its start and the model's output gathered
    moved = [int(boundary[end]) - skipped] + ([int(boundary[suffix.first]) - skipped, prof.units[-1].output_bytes]
                                              if suffix else [])
    gather = sum((P - 1) * _share(b, P) for b in moved)
    return Tiling(tuple(grid), end, halo, copies, gather, messages + (P - 1) * len(moved),
                  suffix.first if suffix else 0, skipped, tuple(n * itemsize for n in reach.weights))


def _skip(s: Storage, end: int, start: int) -> bool:
    """Whether storage ``s`` crosses from the prefix's end to the suffix's start untouched between."""
    return end - 1 in s.boundaries and start - 1 in s.boundaries and not any(end <= u < start for u in s.touchers())


def tiled_profile(prof: ModelProfile, t: Tiling, member: bool = False) -> ModelProfile:
    """``prof`` as the leader of ``t``'s tile group holds and computes it (module docstring); with
    ``member``, as one of the other ranks of the group: its tiled units alike but for the leader's
    gather and scatter buffers, nothing of the others, and as a tile every activation a tiled
    unit makes, reads or saves (``PositionEstimate.member_peak_bytes``)."""
    P, end, start = t.tiles, t.end, t.start

    def tiled(s: Storage) -> bool:   # held as tiles: made (or the image), read and saved inside a tiled range
        prefix = all(b < end - 1 for b in s.boundaries) and max(s.touchers()) < end
        return prefix or (start > 0 and all(b >= start for b in s.boundaries) and min(s.touchers()) >= start) \
            or t.skips(s)
    # the leader's receive (and send) buffers of the other tiles while it gathers (scatters) a boundary,
    # forward and backward
    boundary, moving = prof.boundary_bytes(), [0] * len(prof)
    if not member:
        moving[end - 1] = (P - 1) * _share(int(boundary[end]) - t.skipped, P)
        if start:
            moving[start] += (P - 1) * _share(int(boundary[start]) - t.skipped, P)
            moving[-1] += (P - 1) * _share(prof.units[-1].output_bytes, P)
    untiled = (lambda u: replace(u, **dict.fromkeys(_HELD, 0))) if member else (lambda u: u)
    weights = t.weights or (0,) * len(prof)

    def part(working: int, copies: int, unit: int) -> int:
        """A tile's share of ``working`` but for up to ``copies`` copies of the unit's largest
        parameter, which every tile holds whole."""
        whole = min(working, copies * weights[unit])
        return _share(working - whole, P) + whole
    units = [replace(u, saved_bytes=_share(u.saved_bytes, P) + t.halo[i],
                     forward_working=part(u.forward_working, WEIGHT_COPIES[0], i) + t.halo[i] + t.copies[i][0]
                     + moving[i],
                     backward_working=part(u.backward_working, WEIGHT_COPIES[1], i) + 2 * t.halo[i] + t.copies[i][1]
                     + moving[i],
                     eval_working=part(u.eval_working, WEIGHT_COPIES[0], i) + t.halo[i] + t.copies[i][0] + moving[i],
                     forward_flops=_share(u.forward_flops, P), backward_flops=_share(u.backward_flops, P),
                     captured_bytes=_share(u.captured_bytes, P))
             if t.tiled(i) else untiled(u) for i, u in enumerate(prof.units)]
    if member:
        storages = [replace(s, nbytes=_share(s.nbytes, P)) for s in prof.storages if any(map(t.tiled, s.touchers()))]
    else:
        storages = [replace(s, nbytes=_share(s.nbytes, P)) if tiled(s) else s for s in prof.storages]
    storages += [Storage(nbytes=b, savers=(u,), boundaries=()) for u, b in enumerate(t.halo) if b]
    return replace(prof, units=units, storages=storages, _matrix=None, _working=None)


# Copies of a tiled unit's largest parameter in its working memory (forward, backward), whole on every
# tile: ``partition.profile`` allows its gradient, computed before it is accumulated (backward), and
# kernel scratch of the largest operand a convolution touches (``tracking.scratch_bytes``), which
# where activations are tiles may be its weight -- once in NCHW; twice in NHWC, in backward only.
# The most of either layout, so that a tile's estimate stays above what it holds (in NCHW by up to
# one parameter's (P - 1) / P).
WEIGHT_COPIES = (1, 3)

# what a member holds of a unit it does not run: nothing
_HELD = ("param_bytes", "grad_bytes", "optimizer_bytes", "buffer_bytes", "saved_bytes", "forward_working",
         "backward_working", "eval_working", "forward_flops", "backward_flops", "captured_bytes")


def member_peaks(member: PolicyModel, leader: CostModel, cuts: Sequence[int], policies: Sequence,
                 t: Tiling) -> list[int]:
    """Per position, the peak of a tile group's member there (0 where none is): ``member`` the
    prices of its profile (``tiled_profile(..., member=True)``), ``leader`` the plan's costs; a
    member runs the forwards and backwards of the stages with tiled units in its leader's order."""
    stages = [0, leader.K - 1] if t.start else [0]
    costs = CostModel(member.profile, leader.schedule, leader.K, leader.m, None, member, leader.kind, leader.split,
                      leader.spatial_end, leader.spatial_start, leader.order)
    peaks = []
    for p in range(costs.K):
        held = [s for s in costs.holds(p) if s in stages]
        on = {s: costs.stage(list(cuts), s, policies[s])[p] for s in held}
        kept, transient, back = ({s: getattr(on[s], f) if s in on else 0 for s in costs.holds(p)}
                                 for f in ("kept", "transient", "back"))
        _, activations, working, _ = highest(costs.moments[p], kept, transient, back,
                                          {s: costs.between(cuts, s, policies[s]) for s in held})
        static = sum(int(costs.static[cuts[s], cuts[s + 1]]) for s in held)
        peaks.append(static + activations + working if held else 0)
    return peaks


def tiled_times(times: Sequence[float] | None, t: Tiling) -> list[float] | None:
    """Measured seconds per unit, the tiled units' shared by the group."""
    return None if times is None else [x / t.tiles if t.tiled(u) else x for u, x in enumerate(times)]


class Suffixes:
    """The suffixes worth pricing behind a prefix (``after``): the one starting at ``start`` when
    given, else, for a model whose output is an image (a U-Net's), those among a few starts spread
    over what follows the prefix and the starts with the smallest boundaries (a cheap scatter)
    whose units can all be tiled (``suffix_limit`` on the sizes of one fake pass, each start's Reach kept)."""

    def __init__(self, units: Sequence, names: Sequence[str], image: Sequence[int], stages: int,
                 start: int | None, prof: ModelProfile, count: int = 4) -> None:
        self.units, self.names, self.image, self.K, self.start, self.count = units, names, image, stages, start, count
        self.boundary = prof.boundary_bytes()
        shapes = prof.units[-1].output_shapes
        self.dense = len(shapes) == 1 and len(shapes[0]) == 3 and min(shapes[0][1:]) > 1
        self._reach: dict[int, Reach | None] = {}
        self._shapes: list[dict] | None = None   # every unit's sizes, from one fake pass for all starts

    def reach(self, start: int) -> Reach | None:
        if start not in self._reach:
            if self._shapes is None:
                self._shapes = sizes_of(self.units, self.image)
            self._reach[start] = suffix_limit(self.units, self.names, self.image, start, self._shapes)
        return self._reach[start]

    def after(self, end: int, cuts: list[int] | None = None) -> list[Reach]:
        """The suffixes after a prefix ending at ``end``, inside the last stage of ``cuts`` if given."""
        n, lo = len(self.units), end + max(1, self.K - 1)   # stages between the prefix and the last hold a unit
        lo = max(lo, cuts[-2]) if cuts else lo
        if self.start is not None:
            if not lo <= self.start < n:
                return []
            found = self.reach(self.start)
            if found is None:
                raise GemsError(f"the spatial suffix cannot start at unit {self.start}: a unit from there on cannot "
                                "run on tiles, or its inputs are not images; start it later, or give no start")
            return [found]
        if not self.dense or lo >= n:
            return []
        spaced = {round(lo + i * (n - 1 - lo) / (self.count - 1)) for i in range(self.count)}
        cheap = sorted(range(lo, n), key=lambda b: (self.boundary[b], b))[:self.count // 2]
        return [r for r in (self.reach(b) for b in sorted(spaced | set(cheap))) if r is not None]


def reaches(found: dict, units: Sequence, prof: ModelProfile, image: Sequence[int], stages: int,
            start: int | None, suffixes: bool) -> tuple[Reach, Suffixes | None]:
    """The Reach of ``units`` from an image batch of ``image`` and, with ``suffixes``, the ``Suffixes``
    worth pricing behind it (from ``start`` when given) on ``stages`` stages. Kept in ``found`` (a
    planner's profiles dict, so for one model): a sweep makes their fake passes once per micro-batch
    size, not once per plan."""
    image, names = tuple(image), [u.name for u in prof.units]
    if ("reach", image) not in found:
        found["reach", image] = spatial_limit(units, names, image)
    key = ("suffixes", id(prof), stages, start)   # prof: one of ``found``'s own profiles, kept alive there
    if suffixes and key not in found:
        found[key] = Suffixes(units, names, image, stages, start, prof)
    return found["reach", image], found[key] if suffixes else None


def search(solve: Callable[[Tiling], Plan], reach: Reach, request: int | tuple[int, int] | str, end: int | None,
           prof: ModelProfile, stages: int, cuts: list[int] | None, suffixes: Suffixes | None = None) -> Plan | None:
    """The best plan ``solve`` makes with a spatial part as requested: a grid, P tiles (the grid
    with the least halo traffic for each end tried) or "auto" (``AUTO_TILES`` in turn, the first P
    with a plan that fits); ``end`` given, or among ``candidate_ends`` the plan that fits
    fastest, else the one with the least peak (longer spatial parts win ties); with ``suffixes``,
    each end also with each suffix after it (only with one when a start is given). None when
    "auto" finds nothing that fits. GemsError with the fix for a part that cannot be."""
    if reach.end == 0 and request == "auto":
        return None
    if reach.end == 0 or (end is not None and end > reach.end):
        raise GemsError(reach.reason or f"the model has {reach.end} units: give the spatial part an end of at most "
                                         f"{reach.end}")
    most = min(reach.end, len(prof) - stages + 1, cuts[1] if cuts else len(prof))
    if end is not None and end > most:
        raise GemsError(f"the spatial part must end inside stage 0, which here ends at unit {most} at the latest: "
                        f"give an end of at most {most}")
    for count in (AUTO_TILES if request == "auto" else [request]):
        if not any(_holds(reach, g) for g in ([count] if isinstance(count, tuple) else grids(count))):
            if request == "auto":
                continue
            reach.end_for(count if isinstance(count, tuple) else grids(count)[0], 1)   # check_grid's sentence
        options = []
        for e in ([end] if end is not None else candidate_ends(prof, most)):
            grid = _grid(reach, count, e, forced=end is not None)
            if grid is None:
                continue
            if suffixes is None or suffixes.start is None:
                options.append(solve(tiling(reach, grid, e, prof)))
            for tail in (suffixes.after(e, cuts) if suffixes else []):
                if _covers(tail, grid):
                    options.append(solve(tiling(reach, grid, e, prof, tail, stages)))
        if not options and suffixes is not None and suffixes.start is not None:
            raise GemsError(f"the spatial suffix cannot start at unit {suffixes.start}: it must start after the "
                            f"prefix's end, inside the last stage and before unit {len(prof)}; give another start")
        best = min(options, key=_rank, default=None)
        if request != "auto" or (best is not None and best.fits):
            return best
    return None


def _grid(reach: Reach, count: int | tuple[int, int], end: int, forced: bool) -> tuple[int, int] | None:
    """The grid for units [0, end): ``count`` itself if a grid, else the least halo traffic of its
    grids; None where no grid fits, GemsError when the end is ``forced``."""
    if isinstance(count, tuple):
        last = reach.end_for(count, end)
        if last < end and forced:
            check_grid(reach.sizes[last], reach.names[last], count)
        return count if last == end else None
    grid = choose_grid(reach, count, end)
    if grid is None and forced:
        raise GemsError(f"no grid of {count} tiles fits every tiled activation of units [0, {end}): use fewer "
                        "tiles (--spatial) or end the spatial part sooner")
    return grid


def candidate_ends(prof: ModelProfile, most: int, count: int = 8) -> list[int]:
    """Ends of the spatial part worth pricing, in [1, most]: ``count`` evenly spaced, ``most``,
    and the ends whose gathered boundary is smallest (a late, small gather keeps the leader lean)."""
    boundary = prof.boundary_bytes()
    smallest = sorted(range(1, most + 1), key=lambda e: (boundary[e], -e))[:count // 2]
    spaced = {round(1 + i * (most - 1) / (count - 1)) for i in range(count)} if most > 1 else {1}
    return sorted(spaced | set(smallest) | {most})


def _covers(tail: Reach, grid: tuple[int, int]) -> bool:
    """Whether every tiled activation of a suffix holds a tile of ``grid``."""
    try:
        return tail.end_for(grid) == tail.end
    except GemsError:
        return False


def _holds(reach: Reach, grid: tuple[int, int]) -> bool:
    """Whether unit 0's tiled activations hold a tile of ``grid``."""
    try:
        return reach.end_for(grid, 1) == 1
    except GemsError:
        return False


def _rank(plan: Plan) -> tuple:
    """Plans that fit first, the fastest of them; else the least peak; longer spatial parts on ties."""
    tiled = plan.spatial_end + (len(plan.unit_names) - plan.spatial_start if plan.spatial_start else 0)
    if plan.fits:
        return 0, max(p.seconds for p in plan.positions), -tiled
    return 1, plan.peak_bytes, -tiled


def _share(n: int, P: int) -> int:
    return -(-int(n) // P)


def _itemsize(dtype: str) -> int:
    import torch  # noqa: PLC0415 - as gems.plan's dtype checks

    return getattr(torch, dtype).itemsize
