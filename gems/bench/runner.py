"""gems-bench: every schedule on the same model, data and ranks, against one unpartitioned rank.

For each schedule the benchmark builds one Engine (a fresh copy of the same initial model,
the schedule's own plan), runs ``warmup + steps`` steps on one synthetic batch generated
once, and reports medians over the measured steps:

    images/s      global batch / step time (a step's time is the slowest rank's engine.step)
    vs mp         images/s over those of schedule mp
    efficiency    images/s over the physical limit: world x the reference's images/s, the
                  reference being plain PyTorch forward/backward/SGD of the whole model on the
                  same batch, on rank 0, with the threads one rank uses (the others wait)
    vs ceiling    with --spatial at K = 1: images/s over the no-communication ceiling -- every
                  rank trains the whole model on its own tile of its group's images with plain
                  PyTorch, all ranks at once (no halo, no statistics sums, no gather, no gradient
                  allreduce; the cores' shared memory bandwidth included): what tiles on these
                  ranks allow at best, where the physical limit counts what whole images would
    bubble        1 - busy / (ranks x step time); busy = forward + backward + optimizer
                  time from the engine timelines. In brackets the part of it that the ranks'
                  unequal busy time alone forces, since every step ends in a sync: sum over ranks
                  of (the busiest rank's busy - its own) / (ranks x step time). No order of work
                  removes that part: it is the plan's imbalance where ranks hold unequal work,
                  and on CPU ranks the cores' own noise (mast's ranks do equal work, yet on two
                  vCPUs one rank's step took 2-8% longer than the other's).
    memory        peak tensor bytes per rank over one more, untimed step (``gems.obs.memory.PeakMeter``:
                  CUDA max allocated; CPU what the rank holds at the step's start -- its
                  stages, gradient bucket, optimizer state and, on a first stage, its
                  images -- plus the CPU allocator's high-water mark during the step),
                  beside the plan's estimate for its position and the estimate's error;
                  the reference's beside the estimate of a one-stage plan
    simulator     ``gems.schedule.simulate`` replaying the schedule with per-stage forward/backward
                  times measured from the same timelines (medians per stage), a network
                  measured by ping-pong between ranks 0 and 1, and the measured optimizer
                  time -- the update (the timeline's ``step``) and the zeroing of the gradient
                  bucket after it (``zero_grad``), the update shown apart: predicted step time
                  and its error against the measured one.

Targets and loss follow the model's output, read from the plan's shapes (a fake forward, nothing
run at full size): C logits per image get class labels, C x H x W (any spatial dims) get
per-pixel class masks of the output's size -- a segmentation model; either way the loss is
gems-train's cross-entropy for that task (``gems.train.losses``), the reference's too.

Spatial parallelism (``--spatial P|RxC``): every schedule's plan gets a spatial part (grid and end
picked per schedule, as for gems-train), so its group is K + (P-1) x (positions holding stage 0)
ranks and D the world over that; without ``--stages``, K = 1. The world counts every rank, a tile
group's members too: efficiency is images/s over world x the unpartitioned rank's, since each
member could have run the reference; halos, gathers and members idle past the tiled units show
as lower efficiency and a larger bubble. Stage times come from the leaders (a member's stage-0
spans cover its tiles only); a member's memory is set beside its leader's estimate.
"""
from __future__ import annotations

import copy
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from gems import models, partition
from gems.bench.config import BenchConfig, micro_batches_for
from gems.errors import GemsError
from gems.obs import memory, trace
from gems.obs.network import measure_network
from gems.pipeline.loss import SumLoss, batch_mean
from gems.plan import formats
from gems.schedule import generators as sch
from gems.schedule import simulate
from gems.schedule.network import Network
from gems.spatial.geometry import parts
from gems.train.config import model_kwargs
from gems.train.losses import make_loss
from gems.train.optim import sgd


@dataclass(frozen=True)
class Task:
    """What the model's output asks of the data and the loss."""
    name: str                      # "classification" or "segmentation" (gems.train.losses' tasks)
    classes: int                   # output channels: targets are class indices below it
    target_shape: tuple[int, ...]  # per image: () for a label, the output's spatial dims for a mask


def task_of(output_shapes: list, model: str) -> Task:
    """The task of a model whose output is ``output_shapes`` (per image, a plan's
    ``stage_output_shapes[-1]``): C logits -> classification, C x H x W... -> segmentation."""
    if len(output_shapes) != 1 or len(output_shapes[0]) < 1:
        got = " and ".join("x".join(map(str, s)) or "a scalar" for s in output_shapes)
        raise GemsError(f"gems-bench trains on class logits per image (N x C) or per pixel (N x C x H x W), but "
                        f"{model} returns {got} per image: give it a model with one such output")
    channels, *spatial = (int(d) for d in output_shapes[0])
    return Task("segmentation" if spatial else "classification", channels, tuple(spatial))


def synthetic_batch(cfg: BenchConfig, task: Task) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of random images and targets (labels or masks), identical on every rank (same seed)."""
    g = torch.Generator().manual_seed(cfg.seed)
    images = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, generator=g)
    return images, torch.randint(0, task.classes, (cfg.batch_size, *task.target_shape), generator=g)


def plain_loop(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, loss_fn: SumLoss, cfg: BenchConfig,
               device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, Callable[[], None]]:
    """A user's loop under the schedules' recipe: a copy of ``model`` and the images on ``device`` in
    the memory format, SGD, the model compiled whole (compiling at its first step), forward and loss
    under bf16 autocast. Returns (the copy, its optimizer, the images there, one training step)."""
    fmt = formats.of_name(cfg.memory_format(device.type))
    model = copy.deepcopy(model).to(device, memory_format=fmt)
    optimizer = sgd(model.parameters(), cfg.lr)
    x, y = images.to(device, memory_format=fmt), labels.to(device)
    run = torch.compile(model) if cfg.compile else model
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=cfg.amp == "bf16")

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=False)
        with autocast:
            loss = batch_mean(loss_fn, run(x), y)
        loss.backward()
        optimizer.step()
    return model, optimizer, x, train_step


def reference(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, loss_fn: SumLoss, cfg: BenchConfig,
              device: torch.device) -> dict:
    """Plain PyTorch on one rank: forward, backward (the engine's loss, the batch's mean) and SGD
    of the whole model on the batch, under the schedules' recipe (``plain_loop``; a compile happens
    in the warm-up steps)."""
    model, optimizer, x, train_step = plain_loop(model, images, labels, loss_fn, cfg, device)
    times = []
    for _ in range(cfg.warmup + cfg.steps):
        start = time.perf_counter()
        train_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    meter = memory.PeakMeter(device)
    meter.start(memory.training_tensors([model], optimizer, x))
    train_step()
    peak = meter.stop()
    step = statistics.median(times[cfg.warmup:])
    estimate = partition.plan(model, tuple(x.shape[1:]), cfg.batch_size, 1, "mp", balance_by=cfg.balance_by,
                              model_name=cfg.model, amp=cfg.amp, device=device.type,
                              memory_format=cfg.memory_format(device.type)).positions[0].peak_bytes
    return {"step_time": step, "images_per_s": cfg.batch_size / step, "peak_memory": peak,
            "plan_memory": estimate, "threads": torch.get_num_threads()}


def ceiling(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, loss_fn: SumLoss, cfg: BenchConfig,
            device: torch.device, comm, grid: list[int]) -> dict:
    """COLLECTIVE: the no-communication ceiling of a K = 1 spatial run (module docstring): rank r
    trains a copy of the model on tile r % P of group r // P's images (a per-pixel target cut
    with its image), plain PyTorch as ``reference`` runs it, every rank at once; the step's time
    is the slowest rank's, the median over the measured steps."""
    P = grid[0] * grid[1]
    group, tile = divmod(comm.rank, P)
    groups = comm.size // P
    x, y = images.chunk(groups)[group], labels.chunk(groups)[group]
    (r0, r1), (c0, c1) = (parts(x.shape[2], grid[0])[tile // grid[1]], parts(x.shape[3], grid[1])[tile % grid[1]])
    x = x[:, :, r0:r1, c0:c1].contiguous()
    if y.dim() == 3:
        y = y[:, r0 * y.shape[1] // images.shape[2]:r1 * y.shape[1] // images.shape[2],
              c0 * y.shape[2] // images.shape[3]:c1 * y.shape[2] // images.shape[3]].contiguous()
    *_, train_step = plain_loop(model, x, y, loss_fn, cfg, device)
    times = []
    for _ in range(cfg.warmup + cfg.steps):
        comm.barrier()
        start = time.perf_counter()
        train_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    slowest = [max(t) for t in zip(*comm.allgather_object(times[cfg.warmup:]))]
    step = statistics.median(slowest)
    return {"step_time": step, "images_per_s": cfg.batch_size / step, "grid": list(grid)}


def recipe(cfg: BenchConfig, device_type: str) -> str:
    """The speed switches both the schedules and the reference ran with, in words."""
    parts = [cfg.memory_format(device_type), "bf16 autocast" if cfg.amp == "bf16" else "fp32",
             "compiled" if cfg.compile else "eager"]
    if device_type == "cuda":
        parts.append("cuDNN benchmark" if cfg.cudnn_benchmark else "no cuDNN benchmark")
        parts.append("TF32 convolutions" if cfg.tf32 else "float32 convolutions")
    return ", ".join(parts)


@dataclass
class ScheduleResult:
    schedule: str
    groups: int                       # D: the world over this schedule's ranks per group
    micro_batches: int
    micro_batch_size: int
    cuts: list[int]
    spatial_grid: list[int]           # rows, cols of the tile grid; empty without a spatial part
    spatial_end: int                  # the spatial part is stage 0's units [0, spatial_end)
    split_backward: bool              # the plan's (--split-backward auto: the planner's choice)
    placement: list[list[int]]        # per rank: group, position, tile (0: not a tile group's member)
    step_time: float                  # median seconds over measured steps (slowest rank)
    images_per_s: float
    bubble: float                     # median over steps
    unequal_busy: float               # the part of the bubble the ranks' unequal busy time forces (median)
    peak_memory: list[int]            # per rank, measured
    plan_memory: list[int]            # per rank, the plan's estimate for its position
    stage_forward: list[float]        # median seconds per micro-batch, per stage
    stage_backward: list[float]
    optimizer_time: float             # the step's update and the zeroing of the gradient bucket (slowest rank)
    predicted_step_time: float
    update_time: float = 0.0          # the update alone (the timeline's step span; slowest rank)
    order: str = ""                   # the plan's order of compute (Plan.order: the schedule search's variant)
    ratio_to_mp: float | None = None
    efficiency: float | None = None
    vs_ceiling: float | None = None

    @property
    def simulator_error(self) -> float:
        return self.predicted_step_time / self.step_time - 1.0


def _stage_medians(ranks: list[trace.RankTimeline], op: str, K: int) -> list[float]:
    found: dict[int, list[float]] = {s: [] for s in range(K)}
    for r in ranks:
        for step in r.steps:
            for label, a, b in step.spans:
                parts = trace.parse(label)
                if parts["op"] == op:
                    found[parts["stage"]].append(b - a)
    return [statistics.median(v) if v else 0.0 for v in found.values()]


def run_schedule(name: str, model: nn.Module, images: torch.Tensor, labels: torch.Tensor, loss_fn: SumLoss,
                 cfg: BenchConfig, comm, K: int, network: Network) -> ScheduleResult:
    """COLLECTIVE: train ``name`` for warmup + steps steps; every rank returns the result."""
    from gems.pipeline.engine import Engine  # noqa: PLC0415

    groups = cfg.group_count(comm.size, name)
    m = micro_batches_for(cfg, name, groups)
    plan = partition.plan(model, (3, cfg.image_size, cfg.image_size), cfg.batch_size, K, name, m,
                          balance_by=cfg.balance_by, groups=groups, model_name=cfg.model,
                          split_backward=cfg.split_backward, shard_optimizer=cfg.shard_optimizer,
                          state_placement=cfg.state_placement, spatial=cfg.spatial, amp=cfg.amp, device=comm.device.type,
                          memory_format=cfg.memory_format(comm.device.type), compile=cfg.compile)
    engine = Engine(copy.deepcopy(model), plan, optimizer=lambda p: sgd(p, cfg.lr),
                    loss_fn=loss_fn, comm=comm, timeout=cfg.timeout,
                    autocast=cfg.autocast(), compile=cfg.compile)
    recorder = trace.Recorder(engine, keep=None)
    mine = images.chunk(groups)[engine.group].clone() if groups > 1 else images   # the group's shard
    if engine.device.type == "cuda":   # where the reference holds its batch: both time the step, not the copy
        mine, labels = mine.to(engine.device), labels.to(engine.device)
    comm.barrier()
    times = []
    for step in range(cfg.warmup + cfg.steps):
        start = time.perf_counter()
        engine.step(mine, labels)
        times.append(time.perf_counter() - start)
        if step >= cfg.warmup:
            recorder.record(step - cfg.warmup + 1)
    meter = memory.PeakMeter(engine.device)   # on one more step: its overhead stays out of the timings
    meter.start(memory.engine_tensors(engine) + ([mine] if engine.needs_images else []))
    engine.step(mine, labels)
    peak = meter.stop()
    gathered = comm.allgather_object((recorder.timeline, times[cfg.warmup:], peak))
    ranks = [g[0] for g in gathered]
    if cfg.trace_dir and comm.rank == 0:
        meta = {"schedule": name, "model": cfg.model, "image": cfg.image_size, "batch": cfg.batch_size,
                "K": K, "m": m, "tiles": plan.tiles}
        trace.write_json(Path(cfg.trace_dir) / f"{name}.json", ranks, meta)
        if trace.have_matplotlib():
            last = [trace.RankTimeline(r.rank, r.group, r.position, r.steps[-1:]) for r in ranks]
            trace.write_png(Path(cfg.trace_dir) / f"{name}.png", last, trace.title(meta))
    placement = [list(engine.topology.place(rank)) for rank in range(comm.size)]
    # a sharded step updates 1/n of its stages' parameters; the simulator takes the unsharded step's time
    sharers = [max(len(engine.topology.holders(s)) for s in engine.topology.stages_of(rank))
               if plan.shard_optimizer else 1 for rank in range(comm.size)]
    del engine, recorder
    gc.collect()

    step_times = [max(per_rank) for per_rank in zip(*(g[1] for g in gathered))]
    bubbles, unequal = [], []
    for i, wall in enumerate(step_times):
        busy = [trace.busy_seconds(r.steps[i].spans) for r in ranks]
        bubbles.append(1.0 - sum(busy) / (comm.size * wall))
        unequal.append(sum(max(busy) - b for b in busy) / (comm.size * wall))
    leaders = [r for r in ranks if placement[r.rank][2] == 0]   # a member's stage-0 spans are its tiles only
    forward = _stage_medians(leaders, sch.FORWARD, K)
    backward = _stage_medians(leaders, sch.BACKWARD, K)
    share = None
    if plan.split_backward:   # the halves' medians, and the input half's share of their sum
        halves = _stage_medians(leaders, sch.BACKWARD_INPUT, K), _stage_medians(leaders, sch.BACKWARD_WEIGHT, K)
        backward = [i + w for i, w in zip(*halves)]
        share = [i / b if b > 0 else 0.5 for i, b in zip(halves[0], backward)]
    # the update (step) and the zeroing of the gradient bucket after it: the simulator's step is both
    steps = {r.rank: statistics.median([sum(b - a for label, a, b in s.spans if label in (sch.STEP, sch.ZERO))
                                        for s in r.steps]) for r in ranks}
    optimizer = max(steps.values())
    update = max(statistics.median([b - a for s in r.steps for label, a, b in s.spans if label == sch.STEP])
                 for r in ranks)
    stages = plan.stage_estimates
    costs = simulate.Costs(forward=forward, backward=backward, boundary_bytes=[s.output_bytes for s in stages],
                           param_bytes=[s.param_bytes for s in stages], edge_bytes=simulate.edge_bytes(plan),
                           input_share=share)
    unsharded = max(sharers[rank] * t for rank, t in steps.items())
    predicted = simulate.simulate(name, K, m, costs, network, groups, unsharded, plan.split_backward,
                                  plan.shard_optimizer, plan.order).step_time
    step = statistics.median(step_times)
    return ScheduleResult(
        schedule=name, groups=groups, micro_batches=m, micro_batch_size=plan.micro_batch_size, cuts=list(plan.cuts),
        spatial_grid=list(plan.spatial_grid), spatial_end=plan.spatial_end, split_backward=plan.split_backward,
        placement=placement,
        step_time=step, images_per_s=cfg.batch_size / step, bubble=statistics.median(bubbles),
        unequal_busy=statistics.median(unequal),
        peak_memory=[g[2] for g in gathered],
        plan_memory=[memory.rank_estimate(plan.positions[p], t) for _, p, t in placement],
        stage_forward=forward, stage_backward=backward, optimizer_time=optimizer, predicted_step_time=predicted,
        update_time=update, order=plan.order)


def run(cfg: BenchConfig, comm) -> dict | None:
    """COLLECTIVE: the whole benchmark; rank 0 returns the results (others None)."""
    cfg.validate(comm.size)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None   # other work skews timings
    names = cfg.schedule_list()
    K = cfg.stage_count(comm.size)
    if cfg.trace_dir and comm.rank == 0:
        Path(cfg.trace_dir).mkdir(parents=True, exist_ok=True)
    device = comm.device   # placed by gems.comm (CUDA_VISIBLE_DEVICES and per-task GPUs respected)
    cfg.apply(device.type)   # process-wide: cuDNN's autotuning
    torch.manual_seed(cfg.seed)
    model = models.build(cfg.model, num_classes=cfg.num_classes, **model_kwargs(cfg.model_arg))
    first = partition.plan(model, (3, cfg.image_size, cfg.image_size), cfg.batch_size, K, "mp",
                           balance_by=cfg.balance_by, model_name=cfg.model)
    task = task_of(first.stage_output_shapes[-1], cfg.model)
    loss_fn = make_loss(task.name, "cross-entropy", task.classes)
    images, labels = synthetic_batch(cfg, task)
    network = measure_network(comm, first.stage_estimates[0].output_bytes,
                              sum(p.numel() * p.element_size() for p in model.parameters()))
    ref = None
    if cfg.reference:
        comm.barrier()
        if comm.rank == 0:
            ref = reference(model, images, labels, loss_fn, cfg, device)
        comm.barrier()   # polls with back-off: the waiting ranks leave rank 0's core alone
    results = [run_schedule(name, model, images, labels, loss_fn, cfg, comm, K, network) for name in names]
    top = None
    if cfg.reference and cfg.spatial and K == 1:
        top = ceiling(model, images, labels, loss_fn, cfg, device, comm, results[0].spatial_grid)
    if comm.rank != 0:
        return None
    mp = next((r for r in results if r.schedule == "mp"), None)
    for r in results:
        r.ratio_to_mp = r.images_per_s / mp.images_per_s if mp else None
        r.efficiency = r.images_per_s / (comm.size * ref["images_per_s"]) if ref else None
        r.vs_ceiling = r.images_per_s / top["images_per_s"] if top else None
    report = {
        "config": asdict(cfg), "task": asdict(task), "world": comm.size, "load_average": load, "stages": K,
        "recipe": recipe(cfg, device.type),
        "tiles": cfg.tiles(),
        "threads": torch.get_num_threads(), "device": str(device), "memory_kind": memory.kind(device),
        "network": {"latency": network.latency, "bandwidth": network.bandwidth,
                    "reduce_bandwidth": network.reduce_bandwidth, "collective_bandwidth": network.collective_bandwidth},
        "reference": ref,
        "ceiling": top,
        "schedules": {r.schedule: {**asdict(r), "simulator_error": r.simulator_error} for r in results},
    }
    if cfg.json:
        Path(cfg.json).write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report
