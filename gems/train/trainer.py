"""The training loop behind ``gems-train``: data, engine, checkpoints, signals, metrics.

Exit statuses: 0 done, 1 failure (e.g. a non-finite loss), 2 bad input, 3 stopped by
SIGTERM/SIGUSR1 after saving a checkpoint (Slurm preemption: requeue and ``--resume``).
"""
from __future__ import annotations

import resource
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from gems import models, partition
from gems.errors import GemsError
from gems.obs import memory
from gems.obs.plan_picture import write_plan_png
from gems.obs.trace import Recorder
from gems.partition.placement import host_overflow
from gems.schedule import generators as sch
from gems.schedule.topology import Topology
from gems.train import checkpoint, configfile, environment, workers
from gems.train.board import Board
from gems.train.config import TrainConfig, model_kwargs
from gems.train.data import TrainData
from gems.train.losses import make_loss
from gems.train.optim import learning_rate, make_optimizer
from gems.train.planning import auto_tiles, check_task, make_plan, workspace_room
from gems.train.progress import Progress
from gems.train.validation import Validation
from gems.units import format_size, parse_size

if TYPE_CHECKING:
    from gems.pipeline.engine import Engine

PREEMPTED = 3


def split_line(cfg: TrainConfig, topo: Topology) -> str:
    R = sch.replicas(cfg.schedule)
    per_group = cfg.batch_size // topo.groups
    return (f"batch {cfg.batch_size} = {topo.groups} group(s) x {per_group} images; per group "
            f"{R} replica(s) x {per_group // R} images; per replica {cfg.micro_batches} micro-batch(es) x "
            f"{per_group // R // cfg.micro_batches} images  [K={cfg.stages}, D={topo.groups}, "
            f"world={topo.world}, schedule {cfg.schedule}]")


def check_split(cfg: TrainConfig, topo: Topology) -> None:
    parts = topo.groups * sch.replicas(cfg.schedule) * cfg.micro_batches
    if cfg.batch_size % parts:
        raise GemsError(f"--batch-size {cfg.batch_size} does not split into {topo.groups} group(s) x "
                        f"{sch.replicas(cfg.schedule)} replica(s) x {cfg.micro_batches} micro-batch(es): "
                        f"use a multiple of {parts}")


def check_validation_split(cfg: TrainConfig, topo: Topology) -> None:
    """--val-batch-size must split like a training batch (forward-only steps run the same layout)."""
    parts = topo.groups * sch.replicas(cfg.schedule) * cfg.micro_batches
    if cfg.val_batch_size and cfg.val_batch_size % parts:
        raise GemsError(f"--val-batch-size {cfg.val_batch_size} does not split into {topo.groups} group(s) x "
                        f"{sch.replicas(cfg.schedule)} replica(s) x {cfg.micro_batches} micro-batch(es): "
                        f"use a multiple of {parts}")


def check_validation_memory(plan, batch_size: int) -> None:
    """Validation's forward-only steps must fit the plan's budget too (``Plan.forward_peak_bytes``):
    otherwise one sentence naming the largest --val-batch-size that fits."""
    if plan.memory_budget is None or not plan.forward_bytes:
        return
    room = plan.memory_budget - plan.overhead_bytes
    need, position = plan.forward_worst(batch_size)
    if need <= room:
        return
    parts = plan.batch_size // plan.micro_batch_size      # groups x replicas x micro-batches
    fitting = [size for size in range(parts, batch_size, parts) if plan.forward_worst(size)[0] <= room]
    fix = (f"pass --val-batch-size {fitting[-1]}" if fitting else
           f"even --val-batch-size {parts} does not fit: use more --stages or a larger budget")
    raise GemsError(f"validation batches of {batch_size} images need {format_size(need)} on position {position} "
                    f"(forward-only step), over the --memory-budget of {format_size(room)} for tensors: {fix}")


def enforce_memory_budget(engine: Engine, budget: int) -> None:
    """Make ``budget`` a hard limit on this rank's memory (``--enforce-memory-budget``): an
    allocation beyond it fails, and the engine reports the failure as ``OutOfMemory``.

    CUDA: the caching allocator may reserve at most ``budget`` of the GPU, the tensors the plan
    estimates. CPU: the soft RLIMIT_DATA becomes the process's data size now, less the tensors the
    engine already holds (the plan's estimate counts them), plus ``budget``. RLIMIT_DATA counts
    private writable memory (heap and anonymous mappings, where tensors live) and not shared
    libraries, MPI's shared-memory segments or merely reserved address space, which RLIMIT_AS
    would count; so the interpreter, torch and MPI are the baseline and the budget is left for
    training. Set once the engine is built, so MPI and torch start unhindered (Linux only).
    Data-loading workers start from a fork server (gems.train.workers), which the first stage's
    ranks start before this, so their workers are not under it (a worker's memory is not the
    rank's tensors). A thread started later counts its stack (8 MiB, mostly untouched), and
    below some tens of MiB of budget oneDNN's first kernels may fail, or crash, before any
    tensor does: the limit is meant for budgets of GiBs.
    """
    if engine.device.type == "cuda":
        # The fraction bounds what the caching allocator reserves anew; blocks it already caches
        # would serve a step beyond the budget without asking, so they go back first.
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(engine.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), engine.device)
        return
    try:
        with open("/proc/self/status") as f:
            data = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
    except (OSError, StopIteration):
        raise GemsError("--enforce-memory-budget on CPU needs Linux (/proc/self/status): "
                        "drop the flag on this system") from None
    # the host tier (--state-placement host-optimizer) is this memory too: the plan's bytes for it beside
    # the budget, its copies already allocated counted there
    planned = engine.plan.state_host_bytes
    host = planned[engine.position] - engine.grads.host.nbytes if planned else 0
    limit = data - memory.storage_bytes(memory.engine_tensors(engine)) + budget + host
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


class _Signals:
    """Remembers SIGTERM/SIGUSR1 so the loop can stop after the current step."""

    def __init__(self) -> None:
        self.caught = 0
        for sig in workers.STOP_SIGNALS:
            signal.signal(sig, self._catch)

    def _catch(self, signum, frame) -> None:
        self.caught = signum


@dataclass
class Job:
    """Everything ``prepare`` checked and built; ``run`` trains it."""
    cfg: TrainConfig
    comm: object
    topo: Topology
    data: TrainData
    model: nn.Module | None
    plan: object
    resume_from: Path | None
    resume_state: tuple | None
    loss: nn.Module
    validation: Validation | None


def prepare(cfg: TrainConfig, comm) -> Job | None:
    """Check the configuration and build the pieces, with no collective communication, so
    a user error surfaces on every rank before any rank waits on another. Returns None
    for ``--dry-run``."""
    cfg.validate()
    # --plan read first: a tiled suffix under a one-replica pipeline makes its last position a tile group
    loaded = partition.Plan.from_json(cfg.plan) if cfg.plan else None
    chosen = None   # --spatial auto's plan
    if cfg.spatial == "auto":
        if loaded is not None:   # the plan's own spatial part
            cfg.spatial = "x".join(map(str, loaded.spatial_grid)) or None
        else:   # the class count first: it sizes the model's head
            classes = _data(cfg, 1, 0, False, False).num_classes
            cfg.spatial, chosen = auto_tiles(cfg, comm.size, _model(cfg, classes), comm.device.type)
            if comm.rank == 0:
                said = f"tile groups of {chosen.tiles} ranks" if cfg.spatial else "no spatial part"
                print(f"gems-train: --spatial auto: {said} ({chosen.groups} group(s) on {comm.size} ranks)", flush=True)
    topo = Topology(comm.size, cfg.stages, cfg.schedule, cfg.tiles(), bool(loaded and loaded.spatial_start))
    check_split(cfg, topo)
    check_validation_split(cfg, topo)
    group, position, tile = topo.place(comm.rank)
    held = topo.stages_of(comm.rank)   # a tile group's member: stage 0 (it reads images, never labels)
    labels = cfg.stages - 1 in held and not tile
    data = _data(cfg, topo.groups, group, 0 in held, labels)
    if cfg.workers and 0 in held:
        workers.start_server()
    loss = make_loss(cfg.task, cfg.loss or "cross-entropy", data.num_classes, class_weights=cfg.weights(),
                     label_smoothing=cfg.label_smoothing)
    validation = (Validation(cfg, topo.groups, group, data.num_classes, 0 in held, labels,
                             comm.rank == 0) if cfg.val_data else None)
    model = _model(cfg, data.num_classes)
    if cfg.init_from:   # every rank reads the same file, so all start from the same weights
        models.load_initial_state(model, cfg.init_from, cfg.init_exclude)
    plan = chosen or make_plan(cfg, model, topo.groups, comm.device.type, loaded)
    # the planner may tile a suffix (one stage or mast: the same ranks, whose members then hold the last stage)
    topo = Topology.of(plan, comm.size)
    cfg.apply(comm.device.type, workspace_room(plan, *topo.place(comm.rank)[1:]))   # cuDNN, process-wide
    check_task(cfg.task, plan.stage_output_shapes[-1][0], cfg.model)
    over = host_overflow(plan, parse_size(cfg.host_memory_budget)) if cfg.host_memory_budget else None
    if over:
        raise GemsError(f"the plan does not fit the host: {over}; try a larger host budget, --state-placement auto, "
                        "--shard-optimizer or more stages")
    if plan.fits is False:
        worst = max(plan.positions, key=lambda p: p.peak_bytes)
        fixes = [f"--stages {plan.smallest_fitting_stages}"] if plan.smallest_fitting_stages else []
        useful = ("recompute", "offload") if comm.device.type == "cuda" else ("recompute",)  # host = CPU device
        fixes += [f"--{flag} auto" for flag in useful if getattr(cfg, flag) == "none"]
        fixes += ["--state-placement auto"] if cfg.state_placement == "device" else []
        raise GemsError(f"the plan does not fit --memory-budget {format_size(plan.memory_budget)}: position "
                        f"{worst.position} needs {format_size(worst.peak_bytes)}"
                        + (f" plus {format_size(plan.overhead_bytes)} besides tensors" if plan.overhead_bytes else "")
                        + "; try "
                        + (" or ".join(fixes) if fixes else "a larger budget") + ", or a smaller batch or image")
    if validation is not None:
        check_validation_memory(plan, validation.batch_size)
    if cfg.enforce_memory_budget and plan.memory_budget is None:
        raise GemsError("--enforce-memory-budget needs --memory-budget (or a --plan made with one)")
    if comm.rank == 0:
        print(f"gems-train: {split_line(cfg, topo)}", flush=True)
        if cfg.channels_last and plan.memory_format != "channels_last":
            print(f"gems-train: note: {cfg.model} has no 4-D parameters for --channels-last to change: it trains in "
                  "the default (contiguous) format", flush=True)
        if validation is not None and plan.forward_bytes:
            need, position = plan.forward_worst(validation.batch_size)
            print(f"gems-train: validation in batches of {validation.batch_size}, forward-only steps estimated at "
                  f"{format_size(need)} at most (position {position})", flush=True)
    if cfg.plan_png and comm.rank == 0:
        write_plan_png(cfg.plan_png, plan)
        print(f"gems-train: plan drawn in {cfg.plan_png}", flush=True)
    if cfg.dry_run:
        if comm.rank == 0:
            print(plan.table(), flush=True)
        return None
    resume_from, resume_state = None, None
    if cfg.checkpoint_dir:
        checkpoint.check_writable(cfg.checkpoint_dir)
        if cfg.resume:
            resume_from, damaged = checkpoint.newest_intact(cfg.checkpoint_dir)  # the same on every rank
            if comm.rank == 0:
                for warning in damaged:
                    print(f"gems-train: warning: {warning}", file=sys.stderr, flush=True)
            meta = checkpoint.read_manifest(resume_from)
            # every option that differs from the checkpoint's run is named; another K, D or world is fine
            changed = configfile.differences(meta["config"], configfile.as_dict(cfg), ignore=("resume",)) \
                if isinstance(meta.get("config"), dict) else []
            if (meta.get("model"), meta.get("num_classes"), meta.get("task", "classification")) != (
                    cfg.model, data.num_classes, cfg.task):
                raise GemsError(f"{resume_from} holds {meta.get('model')} for {meta.get('task', 'classification')} "
                                f"with {meta.get('num_classes')} classes, not {cfg.model} for {cfg.task} with "
                                f"{data.num_classes}" + (f" (changed: {', '.join(changed)})" if changed else "")
                                + ": use another --checkpoint-dir or drop --resume")
            if changed and comm.rank == 0:
                print(f"gems-train: resuming {resume_from} with a changed configuration: {', '.join(changed)}",
                      flush=True)
            mine = topo.stages_of(comm.rank)   # with a spatial suffix a member holds the last stage too
            units = range(min(plan.cuts[s] for s in mine), max(plan.cuts[s + 1] for s in mine))
            resume_state = checkpoint.load_stages(resume_from, units)
    # --compile: the backend checked here, its caches kept beside the checkpoints (a resumed job reuses them)
    cfg.compiler(comm.device.type, str(Path(cfg.checkpoint_dir) / "compile-cache") if cfg.checkpoint_dir else None)
    return Job(cfg, comm, topo, data, model, plan, resume_from, resume_state, loss, validation)


def _data(cfg: TrainConfig, groups: int, group: int, images: bool, labels: bool) -> TrainData:
    return TrainData(cfg.data, cfg.image_size, cfg.batch_size, groups, group, task=cfg.task,
                     num_classes=cfg.num_classes, ignore_index=cfg.ignore_index, binary_masks=cfg.binary_masks,
                     augment=cfg.augment, seed=cfg.seed, workers=cfg.workers, need_images=images, need_labels=labels)


def _model(cfg: TrainConfig, num_classes: int) -> nn.Module:
    """The model as every rank builds it: the same seed, so the same weights."""
    torch.manual_seed(cfg.seed)
    return models.build(cfg.model, num_classes=output_channels(cfg, num_classes), **model_kwargs(cfg.model_arg))


def output_channels(cfg: TrainConfig, num_classes: int) -> int:
    """Channels of the model's output: one logit for a binary task under --loss bce, else one per class."""
    return 1 if cfg.loss == "bce" and num_classes <= 2 else num_classes


def checkpoint_meta(cfg: TrainConfig, data: TrainData) -> dict:
    """What a checkpoint's manifest says about the model, so gems-predict can rebuild it."""
    return {"model": cfg.model, "num_classes": data.num_classes, "image_size": cfg.image_size,
            "outputs": output_channels(cfg, data.num_classes), "task": cfg.task, "model_arg": list(cfg.model_arg),
            "leaf_module": list(cfg.leaf_module),
            "classes": list(getattr(data, "classes", None) or []), "amp": cfg.amp}


def run(job: Job) -> int:
    """Train; every rank calls it. Returns the exit status."""
    cfg, comm, data, plan = job.cfg, job.comm, job.data, job.plan
    rank0 = comm.rank == 0
    from gems.pipeline.engine import Engine  # noqa: PLC0415 - keeps `gems-train --help` fast
    engine = Engine(job.model, plan, optimizer=make_optimizer(cfg), loss_fn=job.loss, comm=comm,
                    timeout=cfg.timeout, clip_grad_norm=cfg.clip_grad_norm,
                    autocast=cfg.autocast(), batch_norm=cfg.batch_norm,
                    compile=cfg.compile)
    job.model = None  # the engine keeps only this rank's stages
    start = 0
    if job.resume_state is not None:
        manifest, model_state, optimizer_state, param_groups = job.resume_state
        engine.load_state(model_state, optimizer_state, param_groups)
        checkpoint.restore_rng(job.resume_from, manifest, engine)
        start = manifest["step"]
        if job.validation is not None:
            job.validation.best = manifest.get("best_value")
        if rank0:
            print(f"gems-train: resumed from {job.resume_from} at step {start}", flush=True)
    job.resume_state = None  # loaded into the engine: free it before memory is measured or limited
    total = cfg.steps if cfg.steps is not None else (cfg.epochs or 1) * data.steps_per_epoch
    # the manifests record the run's whole configuration and what it ran on (gathered once: collective)
    meta = {**checkpoint_meta(cfg, data), "config": configfile.as_dict(cfg), "environment": environment.record(comm)}
    if rank0 and cfg.checkpoint_dir:
        try:
            checkpoint.write_config(cfg.checkpoint_dir, configfile.dumps(cfg))
        except OSError as error:   # the manifests hold it too: a note, not a reason to stop
            print(f"gems-train: warning: config.toml not written in {cfg.checkpoint_dir} ({error})", file=sys.stderr,
                  flush=True)
    validation = job.validation
    board = Board(cfg.tensorboard, rank0, purge_step=start + 1 if start else None)
    metrics = Progress(cfg, comm, engine, plan, start, total, board)
    tracer = Recorder(engine, keep=3) if cfg.trace or cfg.trace_png else None
    signals = _Signals()
    if cfg.enforce_memory_budget:  # last, so the progress bar's thread is part of the baseline
        enforce_memory_budget(engine, plan.memory_budget - plan.overhead_bytes)   # the tensors' share
    stream, stream_epoch = None, None
    step = start
    try:
        while step < total:
            epoch, k = divmod(step, data.steps_per_epoch)
            if stream_epoch != epoch:
                stream, stream_epoch = data.batches(epoch, k), epoch
            images, labels = next(stream)
            for g in engine.optimizer.param_groups:
                g["lr"] = learning_rate(cfg, step, total)
            began = time.perf_counter()
            loss = engine.step(images, labels)
            step += 1
            if tracer is not None:
                tracer.record(step)
            stop = metrics.record(step, loss, time.perf_counter() - began, data.skipped, signals.caught, epoch)
            if not engine.last_step_applied and not cfg.skip_nonfinite:
                if rank0:
                    print(f"gems-train: error: the loss is not finite at step {step} ({loss}); the update "
                          "was not applied: lower --lr, set --clip-grad-norm, or pass --skip-nonfinite",
                          file=sys.stderr, flush=True)
                return 1
            best = False
            if validation is not None and validation.due(step, total) and engine.last_step_applied:
                if step == total:     # the summary sets the last validation's peak beside the plan's
                    metrics.meter.start(memory.engine_tensors(engine))
                scores = validation.run(engine, job.loss)
                if step == total:
                    metrics.validation_memory(metrics.meter.stop(), validation.batch_size)
                metrics.validation(step, scores)
                board.validation(step, scores, _overlays(validation, engine, data.num_classes))
                best = validation.improved(scores)
                meta["best_value"] = validation.best
            if best:
                try:
                    path = validation.save_best(engine, step, meta)
                except checkpoint.CheckpointError as error:
                    if rank0:
                        print(f"gems-train: error: {error}", file=sys.stderr, flush=True)
                    return 1
                metrics.note(f"best {cfg.keep_best} {validation.best:.4f}: checkpoint {path}")
            if cfg.checkpoint_dir and (stop or step == total or
                                       (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
                try:
                    path = checkpoint.save(engine, cfg.checkpoint_dir, step, meta, cfg.keep_checkpoints)
                except checkpoint.CheckpointError as error:  # raised alike on every rank
                    if rank0:
                        print(f"gems-train: error: {error}", file=sys.stderr, flush=True)
                    return 1
                metrics.note(f"checkpoint {path}")
            if stop:
                metrics.note(f"stopped by signal after step {step}"
                             + ("" if cfg.checkpoint_dir else " (no --checkpoint-dir: nothing saved)"))
                return PREEMPTED
    finally:
        metrics.close()
        board.close()
    if tracer is not None:
        tracer.write(comm, cfg.trace, cfg.trace_png, {"model": cfg.model, "schedule": cfg.schedule,
                                                      "K": cfg.stages, "m": cfg.micro_batches,
                                                      "batch": cfg.batch_size, "image": cfg.image_size})
        if rank0:
            print(f"gems-train: timeline of the last {len(tracer.timeline.steps)} step(s) written to "
                  f"{' and '.join(p for p in (cfg.trace, cfg.trace_png) if p)}", flush=True)
    metrics.summary()
    return 0


def _overlays(validation: Validation, engine, num_classes: int):
    """TensorBoard's overlay images of this validation (rank 0), or None."""
    from gems.train.board import overlays  # noqa: PLC0415
    from gems.train.data import IMAGENET_MEAN, IMAGENET_STD  # noqa: PLC0415

    sample = validation.overlays(engine)
    if sample is None:
        return None
    return overlays(*sample, num_classes, IMAGENET_MEAN, IMAGENET_STD)
