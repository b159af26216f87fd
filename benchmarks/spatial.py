"""Spatial parallelism against its ceiling: one image split across the ranks' tiles, against each
rank training on its own tile alone, the same model and image, in one launch.

    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/spatial.py --model resnet18 --image-size 512
    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/spatial.py --model unet --image-size 512

Runs of ``--steps`` training steps (after ``--warmup``), ``--batch-size`` images per step, every
rank in step:

* ``ceiling`` -- each rank trains the model on its own tile of the image with plain PyTorch, all at
  once: no halo, no statistics sums, no gather, no gradient allreduce. What the cores allow a
  spatial run at best, shared memory bandwidth included: the *no-communication ceiling*.
* ``spatial`` -- K = 1, the model's spatial part (``--end`` units; default as far as tiles reach,
  ``gems.spatial.limit``) on the ``--grid`` of the ranks, the rest on the leader, the gradients
  allreduced over the tile group (counted: it is part of the step).
* ``one rank`` (``--one-rank``): plain PyTorch on the whole image on rank 0 while the others wait;
  ``mp`` (``--mp``): K = ranks, the planner's cut.

The ceiling and spatial steps alternate, one of each per round, so that a machine whose speed drifts
during the launch (a shared host's cores do, by tens of percent over seconds) slows both alike.
A round's step of either is its slowest rank's: a tile group is done when its last tile is, and
the cores of one machine differ (two of this project's CPU machine by 3-7% in one launch), so a
rank's own ceiling is not what the group's step can reach when that rank's core is the faster.
Prints the median step of each, spatial's ratio to the ceiling -- the median over the rounds of
the ceiling's step over spatial's, with its range (issue 36 holds resnet18 at 512^2 on 2 CPU ranks
to at least 0.85) -- and where spatial's step goes on each rank, medians over the steps
(``gems.obs.trace`` kinds, from the engine's timeline): compute (forward and backward less the
waits inside them), the tile group's halo, statistics and gather waits, the gradient allreduce,
the optimizer, the rest; ``--layers N``: the N layers that wait longest; ``--ops N``: rank 0's N
operations whose self CPU time differs most between spatial's step and the ceiling's (torch.profiler,
a few rounds after the timed ones), which says what the tiles compute beyond the ceiling and where
their Python and waits go. Not part of the installed package.

``--instant tiles`` measures what the tiles' traffic costs: every message and sum of the tile group
completes at once (receive buffers zeroed, sums left as this tile's own), the gradient allreduce
still real; ``--instant all`` makes the gradient allreduce (and the loss's) instant too, so the step
is the tiles' compute alone -- halo rows, region assembly, two-pass normalisation, the bucket's
copies -- the floor of exact tiles on these cores. Either is a measurement, not training: the
losses are not the model's.

``--lockstep`` times, in the same rounds, a third step: the ceiling in lockstep -- the same plain
PyTorch on each rank's tile, every BatchNorm and GroupNorm layer a barrier of the ranks in forward
and again in backward (an empty sum, waited for as the tiles wait for theirs) -- what the whole images'
statistics impose at the least, every layer waiting for the slower rank, with nothing to send.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections import Counter, defaultdict

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import gems
from gems import comm as comm_lib
from gems import models, partition
from gems.errors import GemsError
from gems.graph import graph_units
from gems.obs import trace
from gems.spatial import TiledUnit
from gems.spatial.geometry import parts
from gems.spatial.limit import spatial_limit
from gems.spatial.tiles import tile_backoff
from gems.train.optim import sgd

PROFILED_ROUNDS = 3   # --ops: rounds profiled after the timed ones
LR = 0.01   # every run's SGD (gems-bench's: momentum 0.9, fused where torch can)
WAITS = sorted(set(trace.TILE_KINDS.values()))
CATEGORIES = ["compute", *WAITS, "gradient allreduce", "optimizer", "rest"]


def in_lockstep(net: nn.Module, comm) -> nn.Module:
    """``net`` with every BatchNorm and GroupNorm layer a barrier of ``comm``'s ranks in forward and in
    backward (``--lockstep``), waited for with the tile group's back-off."""
    empty = torch.zeros(1)
    backoff = tile_backoff(comm)

    def barrier(*_) -> None:
        comm.wait(comm.iallreduce(empty, None), "the lockstep barrier", backoff)

    def hook(module, inputs, output) -> None:
        barrier()
        if output.requires_grad:
            output.register_hook(barrier)
    for module in net.modules():
        if isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm)):
            module.register_forward_hook(hook)
    return net


def _steps(step, args, comm, after=None) -> float:
    """Median seconds of ``args.steps`` calls of ``step`` after ``args.warmup``, every rank in step;
    ``after(i)`` once each measured step is done."""
    return statistics.median(_times([step], args, comm, after)[0])


def _times(steps, args, comm, after=None, spin: bool = False) -> list[list[float]]:
    """Seconds of each of ``args.steps`` rounds after ``args.warmup``, per function of ``steps``: a
    round calls each in turn, every rank in step, so a machine whose speed drifts over a launch
    slows them alike; ``after(i)`` once the last of a measured round is done. ``spin``: the barrier
    before each step polls without sleeping -- where every rank computes in every step and has a core
    of its own -- so the ranks leave it together: with the communicator's back-off one left it up to
    2 ms after the other, which a spatial step's first collective then waited out on the other rank."""
    times: list[list[float]] = [[] for _ in steps]
    barrier = comm_lib.Backoff(0, 0) if spin else comm.backoff
    for i in range(args.warmup + args.steps):
        for k, step in enumerate(steps):
            comm.wait(comm.ibarrier(), "the benchmark's barrier", barrier)
            start = time.perf_counter()
            step()
            if i >= args.warmup:
                times[k].append(time.perf_counter() - start)
        if i >= args.warmup and after:
            after(i)
    return times


def operations(steps, comm, rounds: int = PROFILED_ROUNDS) -> list[Counter]:
    """Rank 0's self CPU milliseconds per step by operation (torch.profiler's names: aten operators,
    autograd Functions -- whose self time holds their Python and the waits inside them), for each of
    ``steps``, over ``rounds`` rounds of ``_times`` (the other ranks unprofiled). torch.profiler
    records the thread that profiles: on loopback ranks, rank 0's own operations."""
    totals = [Counter() for _ in steps]

    def profiled(step, total: Counter):
        def run() -> None:
            if comm.rank != 0:
                return step()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            for event in prof.key_averages():
                total[event.key] += event.self_cpu_time_total / 1e3 / rounds
        return run
    _times([profiled(s, t) for s, t in zip(steps, totals)], argparse.Namespace(steps=rounds, warmup=0), comm,
           spin=True)
    return totals


class Instant:
    """A communicator whose point-to-point messages and sums complete at once (``--instant``): a
    receive leaves zeros, a sum this rank's own part, a gather or exchange of runs the rank's own
    data; the rest (``wait``, ``group``, ...) is the real communicator's."""

    def __init__(self, comm) -> None:
        self._comm = comm

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    @staticmethod
    def _done() -> comm_lib.Request:
        return comm_lib.Request(lambda: True, "instant")

    def ibatch(self, ops) -> list:
        for op in ops:
            if op.op == "recv":
                for buffer in op.tensors:
                    buffer.zero_()
        return [self._done() for _ in ops]

    def iallreduce(self, tensor, group) -> comm_lib.Request:
        return self._done()

    def allreduce(self, tensor, group, what, backoff=None) -> None:
        pass

    def iallgather_runs(self, flat, bounds, group) -> comm_lib.Request:
        return self._done()

    def ireduce_scatter_runs(self, flat, bounds, group) -> comm_lib.Request:
        return self._done()


def categories(spans: list[trace.Span], wall: float) -> dict[str, float]:
    """Seconds of one step's timeline per category (module docstring)."""
    found: dict[str, float] = defaultdict(float)
    for label, a, b in spans:
        k = trace.kind(label)
        if k in ("forward", "backward"):
            found["compute"] += b - a
        elif k in WAITS:
            found[k] += b - a
            found["compute"] -= b - a   # inside a forward or backward
        elif k == "sync":
            found["gradient allreduce"] += b - a
        elif k == "optimizer":
            found["optimizer"] += b - a
        else:
            found["rest"] += b - a
    found["rest"] += wall - sum(found.values())
    return found


def layer_waits(spans: list[trace.Span]) -> dict[str, float]:
    """Seconds each labelled tile wait ("halo layer1_0.0.conv1") took in one step."""
    found: dict[str, float] = defaultdict(float)
    for label, a, b in spans:
        if trace.kind(label) in WAITS:
            found[label] += b - a
    return found


def _end(model: nn.Module, plan, grid: tuple[int, int], end: int | None) -> int:
    """The spatial part's end: ``end`` units, or as far as tiles of ``grid`` reach."""
    units = graph_units(copy.deepcopy(model), plan.input_shape, plan.batch_size)
    reach = spatial_limit(list(units), plan.unit_names, (plan.batch_size, *plan.input_shape))
    if end is not None and not 1 <= end <= reach.end:
        raise GemsError(f"--end must be between 1 and {reach.end} units (how far tiles reach in this model), got {end}")
    return reach.end_for(grid, end)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--grid", default=None, help="the tile grid of the ranks, RxC (default: the ranks in rows)")
    p.add_argument("--end", type=int, default=None, help="units in the spatial part (default: as far as tiles reach)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=0, help="print the N layers whose tile waits are longest")
    p.add_argument("--one-rank", action="store_true", help="also time plain PyTorch on the whole image on one rank")
    p.add_argument("--mp", action="store_true", help="also time model parallelism (K = ranks, the planner's cut)")
    p.add_argument("--spin", action="store_true", help="waits poll without sleeping (a core per rank)")
    p.add_argument("--instant", choices=("tiles", "all"), default=None,
                   help="make the tile group's traffic (tiles), or all communication of the step (all), complete at "
                        "once: what it costs (module docstring)")
    p.add_argument("--ops", type=int, default=0,
                   help="profile rank 0 and print the N operations whose time differs most between spatial's step "
                        "and the ceiling's")
    p.add_argument("--lockstep", action="store_true",
                   help="also time the ceiling with every normalisation layer a barrier of the ranks "
                        "(module docstring)")
    p.add_argument("--shard-optimizer", action="store_true",
                   help="the spatial run's tiles share the optimizer step (reduce-scatter, a share of the update each)")
    args = p.parse_args()
    comm = comm_lib.create("mpi", backoff=comm_lib.Backoff(0, 0) if args.spin else comm_lib.Backoff())
    try:
        run(args, comm)
    except GemsError as error:
        if comm.rank == 0:
            print(f"benchmarks/spatial.py: {error}", file=sys.stderr)
        sys.exit(2)


def run(args, comm) -> None:
    torch.set_num_threads(1)
    S, B, P = args.image_size, args.batch_size, comm.size
    rows, cols = (P, 1) if args.grid is None else _grid(args.grid)
    if rows * cols != P:
        raise GemsError(f"a {rows}x{cols} grid needs {rows * cols} ranks, but {P} were launched")
    torch.manual_seed(0)
    model = models.build(args.model, num_classes=10 if args.model.startswith("resnet") else 2)
    plan = partition.plan(copy.deepcopy(model), (3, S, S), B, stages=1, schedule="mp", device="cpu")
    out = plan.stage_output_shapes[-1][0]   # per image: (classes,) or (classes, H, W)
    x = torch.randn(B, 3, S, S)
    y = torch.randint(0, out[0], (B, *out[1:]))
    loss_fn = nn.CrossEntropyLoss()

    def plain(net, images, targets):
        opt = sgd(net.parameters(), LR)

        def step() -> None:
            opt.zero_grad()
            loss_fn(net(images), targets).backward()
            opt.step()
        return step

    i, j = divmod(comm.rank, cols)
    (r0, r1), (c0, c1) = parts(S, rows)[i], parts(S, cols)[j]
    # the ceiling's targets: a per-pixel target is cut with its image, a label stays whole
    tile_y = y[:, r0 * out[1] // S:r1 * out[1] // S, c0 * out[2] // S:c1 * out[2] // S] if len(out) == 3 else y
    ceiling = plain(copy.deepcopy(model), x[:, :, r0:r1, c0:c1].clone(), tile_y)
    lockstep = [plain(in_lockstep(copy.deepcopy(model), comm), x[:, :, r0:r1, c0:c1].clone(), tile_y)] \
        if args.lockstep else []

    plan.spatial_grid = [rows, cols]
    plan.spatial_end = _end(model, plan, (rows, cols), args.end)
    plan.shard_optimizer = args.shard_optimizer
    plan.check()
    engine = gems.Engine(copy.deepcopy(model), plan, optimizer=lambda p: sgd(p, LR), loss_fn=loss_fn, comm=comm)
    if args.instant:
        instant = Instant(comm)
        for unit in (u for stage in engine.stages.values() for u in stage.modules() if isinstance(u, TiledUnit)):
            unit.tiles.comm = instant   # the tile group its layers talk through
        if args.instant == "all":
            engine.grads.comm = instant
    timelines, walls, wall = [], [], [0.0]

    def spatial() -> None:
        start = time.perf_counter()
        engine.step(x, y)
        wall[0] = time.perf_counter() - start

    def keep(_: int) -> None:
        walls.append(wall[0])
        timelines.append(list(engine.timeline()))
    # one ceiling step, one spatial step (and one in lockstep), in turn: the ratio is of steps run side by side
    ceilings, spatials, *lock_times = _times([ceiling, spatial, *lockstep], args, comm, keep, spin=True)
    # a round's step of either is its slowest rank's: the tiles are all done when the last one is (the
    # cores of one machine differ by several percent, and spatial's step ends together on every rank)
    every = comm.allgather_object(ceilings)
    own = [statistics.median(c) for c in every]   # each rank's own ceiling
    ceilings = [max(c) for c in zip(*every)]
    spatials = [max(s) for s in zip(*comm.allgather_object(spatials))]
    locked = [max(t) for t in zip(*comm.allgather_object(lock_times[0]))] if lock_times else None
    t_ceiling, t_spatial = statistics.median(ceilings), statistics.median(spatials)
    ratios = sorted(c / s for c, s in zip(ceilings, spatials))
    mine = {c: statistics.median(categories(s, w).get(c, 0.0) for s, w in zip(timelines, walls)) for c in CATEGORIES}
    waits: dict[str, list[float]] = defaultdict(list)
    for s in timelines:
        for label, seconds in layer_waits(s).items():
            waits[label].append(seconds)
    per_rank = comm.allgather_object((mine, {k: statistics.median(v) for k, v in waits.items()}))
    ops = operations([ceiling, spatial], comm) if args.ops else None
    engine = None   # its memory free for the runs below (the closures above are done with it)

    t_one = t_mp = None
    if args.one_rank:
        t_one = _steps(plain(copy.deepcopy(model), x, y) if comm.rank == 0 else lambda: None, args, comm)
    if args.mp and P > 1:
        mp_plan = partition.plan(copy.deepcopy(model), (3, S, S), B, stages=P, schedule="mp", device="cpu")
        mp = gems.Engine(copy.deepcopy(model), mp_plan, optimizer=lambda p: sgd(p, LR), loss_fn=loss_fn, comm=comm)
        t_mp = _steps(lambda: mp.step(x, y), args, comm)
    if comm.rank == 0:
        report(args, plan, (rows, cols), t_ceiling, own, t_spatial, ratios, t_one, t_mp, per_rank,
               None if locked is None else (locked, ceilings, spatials))
        if ops is not None:
            report_operations(args.ops, *ops)


def _grid(text: str) -> tuple[int, int]:
    try:
        rows, cols = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise GemsError(f"--grid takes RxC (rows x columns of tiles, such as 2x1), got {text!r}") from None
    return rows, cols


def report(args, plan, grid, t_ceiling, own, t_spatial, ratios, t_one, t_mp, per_rank, lockstep=None) -> None:
    S, P = args.image_size, grid[0] * grid[1]
    ms = lambda t: f"{t * 1e3:9.1f} ms"   # noqa: E731
    print(f"{args.model} {S}x{S}, batch {args.batch_size}, {P} ranks, median of {args.steps} steps "
          f"(after {args.warmup}):")
    print(f"  ceiling: each rank its own tile, plain PyTorch, all at once {ms(t_ceiling)}   (the slowest rank's; "
          f"each rank's own: {min(own) * 1e3:.1f}-{max(own) * 1e3:.1f} ms)")
    sharded = ", optimizer sharded" if args.shard_optimizer else ""
    counted = {None: "gradient allreduce counted", "tiles": "tile traffic instant, gradient allreduce counted",
               "all": "all communication instant: the tiles' compute alone"}[args.instant]
    print(f"  spatial {grid[0]}x{grid[1]}, units [0,{plan.spatial_end}) of {len(plan.unit_names)} tiled{sharded} "
          f"{ms(t_spatial)}   {statistics.median(ratios):5.3f} of the ceiling ({counted}; "
          f"{ratios[0]:.3f}-{ratios[-1]:.3f} over the pairs of steps)")
    if lockstep is not None:   # (its rounds' steps, the ceiling's, spatial's)
        locked, ceilings, spatials = lockstep
        print(f"  ceiling in lockstep: every normalisation a barrier {ms(statistics.median(locked))}   "
              f"{statistics.median(c / t for c, t in zip(ceilings, locked)):5.3f} of the ceiling; spatial "
              f"{statistics.median(t / s for t, s in zip(locked, spatials)):5.3f} of it")
    if t_one is not None:
        print(f"  one rank, the whole image {ms(t_one)}   spatial {t_one / t_spatial:5.2f}x one rank, "
              f"the ceiling {t_one / t_ceiling:5.2f}x")
    if t_mp is not None:
        print(f"  mp K={P} {ms(t_mp)}   spatial {t_mp / t_spatial:5.2f}x mp")
    print("  where spatial's step goes, ms (median over the steps):")
    print("    " + "rank".ljust(6) + "".join(c.rjust(max(10, len(c) + 2)) for c in CATEGORIES))
    for rank, (mine, _) in enumerate(per_rank):
        print("    " + str(rank).ljust(6) + "".join(f"{mine[c] * 1e3:.1f}".rjust(max(10, len(c) + 2))
                                                   for c in CATEGORIES))
    if args.layers:
        total: dict[str, float] = defaultdict(float)
        for _, waits in per_rank:
            for label, seconds in waits.items():
                total[label] += seconds / P
        print(f"  the {args.layers} longest tile waits, ms (mean over the ranks of the median step):")
        for label, seconds in sorted(total.items(), key=lambda kv: -kv[1])[:args.layers]:
            print(f"    {label:48s} {seconds * 1e3:7.2f}")


def report_operations(n: int, ceiling: Counter, spatial: Counter) -> None:
    """The ``n`` operations whose self CPU time per step differs most between spatial's step and the
    ceiling's (``operations``), largest difference first, and the totals."""
    print(f"  rank 0's operations, self CPU ms per step (torch.profiler, {PROFILED_ROUNDS} rounds after the timed "
          "ones; an autograd Function's self time holds its Python and its waits):")
    print(f"    {'spatial':>9} {'ceiling':>9} {'difference':>11}  operation")
    for key in sorted(ceiling.keys() | spatial.keys(), key=lambda k: -abs(spatial[k] - ceiling[k]))[:n]:
        print(f"    {spatial[key]:9.2f} {ceiling[key]:9.2f} {spatial[key] - ceiling[key]:+11.2f}  {key}")
    total_s, total_c = sum(spatial.values()), sum(ceiling.values())
    print(f"    {total_s:9.2f} {total_c:9.2f} {total_s - total_c:+11.2f}  all operations")


if __name__ == "__main__":
    main()
