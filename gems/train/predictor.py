"""Prediction with a trained checkpoint on the ranks of a launch (``gems-predict``).

Every rank rebuilds the model the checkpoint's manifest names, loads the entries of its own
stages (any partition loads any checkpoint) and runs forward-only steps (``Engine.predict``);
the model is never gathered on one device. Data-parallel groups split the images (image i to
group i mod D) and run independently; within a group, position 0 receives the outputs and
writes the files.

Segmentation: each image is covered by windows of the plan's side S (``gems.train.windows``:
overlap ``--overlap``, blended), read region by region (``gems.train.regions``: a large tiled
TIFF is never decoded whole), normalised as in training, and padded to S where the image is
smaller. The softmax (a single-channel model: the sigmoid) of every window is stitched at the
input's resolution; the mask is the most probable class (single channel: probability > 0.5),
written as OUT/NAME.png, and with ``--probabilities`` the probabilities as OUT/NAME.tif.
Classification: each image is resized (shorter side S) and centre-cropped as in validation;
OUT/predictions.csv gets one line per image with the class probabilities.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision.transforms.v2.functional as TF
from torch import nn

from gems import models, partition
from gems.errors import GemsError
from gems.schedule import generators as sch
from gems.schedule.topology import Topology
from gems.train import checkpoint, images, outputs, regions, windows
from gems.train.config import Recipe, model_kwargs, opt, tile_count
from gems.train.data import PredictImages
from gems.train.planning import layouts


@dataclass
class PredictConfig(Recipe):
    checkpoint_dir: str | None = opt(None, "the training run's --checkpoint-dir: its newest intact checkpoint is used")
    checkpoint: str | None = opt(None, "this checkpoint instead (e.g. CHECKPOINT_DIR/best/step-00001000)")
    data: str = opt(None, "a folder of images, or a folder with images/ (and masks/, ignored) to predict")
    out: str = opt(None, "folder for the outputs, named after the inputs")
    stages: int = opt(2, "K, stages per pipeline; data-parallel groups D = ranks / K")
    schedule: str = opt("mast", "pipeline schedule of the forward steps", choices=("mp", "gpipe", "1f1b", "mast"))
    micro_batches: int = opt(1, "micro-batches per replica per forward step")
    batch_size: int = opt(2, "images (or windows) per forward step over all ranks")
    spatial: str | None = opt(None, "split each image of stage 0's first units across P ranks (a number, or a "
                                    "RxC grid), as gems-train --spatial; auto: the fewest P (none first) with "
                                    "which the launched ranks split the batch")
    overlap: int | None = opt(None, "segmentation: pixels by which neighbouring windows of a large image overlap "
                              "(default: an eighth of the plan's image size)")
    probabilities: bool = opt(False, "segmentation: also write class probabilities as OUT/NAME.tif")
    probabilities_dtype: str = opt("float16", "number type of the probability TIFFs", choices=("float16", "float32"))
    comm: str = opt("mpi", "communication backend", choices=("mpi", "torch"))
    allow_shared_gpu: bool = opt(False, "let several ranks of a node share a GPU")
    timeout: float = opt(300.0, "seconds a rank waits for a peer before aborting the job")

    def validate(self) -> None:
        if not (self.checkpoint_dir or self.checkpoint):
            raise GemsError("give --checkpoint-dir (the training run's) or --checkpoint")
        if not self.data or not self.out:
            raise GemsError("give --data (the images to predict) and --out (where the outputs go)")
        if self.spatial != "auto":   # auto: resolved on the launched ranks (prepare)
            tile_count(self.spatial, "gems-predict")


@dataclass
class PredictJob:
    cfg: object
    comm: object
    topo: Topology
    meta: dict
    paths: list[str]
    root: str
    model: nn.Module | None
    plan: object
    state: dict | None


def resolve_checkpoint(cfg) -> Path:
    """The checkpoint to load: --checkpoint, else the newest intact one in --checkpoint-dir."""
    if cfg.checkpoint:
        path = Path(cfg.checkpoint)
        damage = checkpoint.damage(path)
        if damage:
            raise GemsError(f"--checkpoint {path} cannot be used: {damage}")
        return path
    path, _ = checkpoint.newest_intact(cfg.checkpoint_dir)
    return path


def prepare(cfg, comm) -> PredictJob:
    """Check everything and build the pieces, with no collective communication."""
    cfg.validate()
    for name in ("stages", "batch_size", "micro_batches"):
        if getattr(cfg, name) < 1:
            raise GemsError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(cfg, name)}")
    path = resolve_checkpoint(cfg)
    meta = checkpoint.read_manifest(path)
    size = int(meta.get("image_size", 0))
    if "model" not in meta or size < 1:
        raise GemsError(f"{path} does not say which model and image size it holds (saved by an older "
                        "gems-train): retrain, or export it with gems-export and predict in PyTorch")
    if cfg.overlap is None:
        cfg.overlap = size // 8
    if not 0 <= cfg.overlap < size:
        raise GemsError(f"--overlap must be at least 0 and less than the image size {size}, got {cfg.overlap}")
    if cfg.spatial == "auto":   # the fewest tile ranks with which the launched ranks split the batch
        P = next((P for P, _, parts in layouts(comm.size, cfg.stages, cfg.schedule, cfg.micro_batches)
                  if cfg.batch_size % parts == 0), 1)   # none: the split's own message below
        cfg.spatial = str(P) if P > 1 else None
    topo = Topology(comm.size, cfg.stages, cfg.schedule, tile_count(cfg.spatial, "gems-predict"))
    parts = topo.groups * sch.replicas(cfg.schedule) * cfg.micro_batches
    if cfg.batch_size % parts:
        raise GemsError(f"--batch-size {cfg.batch_size} does not split into {topo.groups} group(s) x "
                        f"{sch.replicas(cfg.schedule)} replica(s) x {cfg.micro_batches} micro-batch(es): use a "
                        f"multiple of {parts}")
    listing = PredictImages(cfg.data)
    paths = list(listing)
    root = getattr(listing, "root", cfg.data)
    names = [str(outputs.output_name(p, root, "")) for p in paths]
    if len(set(names)) < len(names):
        twin = next(n for n in names if names.count(n) > 1)
        raise GemsError(f"{cfg.data} has several images named {twin} (with different extensions): their "
                        "outputs would overwrite each other; rename one")
    try:
        os.makedirs(cfg.out, exist_ok=True)
    except OSError as e:
        raise GemsError(f"cannot create --out {cfg.out} ({e.strerror}): choose a writable folder") from None
    torch.manual_seed(0)
    model = models.build(meta["model"], num_classes=meta.get("outputs", meta["num_classes"]),
                         **model_kwargs(meta.get("model_arg", ())))
    plan = partition.plan(model, input_shape=(3, size, size), batch_size=cfg.batch_size, stages=cfg.stages,
                          schedule=cfg.schedule, micro_batches=cfg.micro_batches, groups=topo.groups,
                          model_name=meta["model"], device=comm.device.type, comm=cfg.comm,
                          leaf_modules=tuple(meta.get("leaf_module", ())), spatial=cfg.spatial, amp=cfg.amp,
                          memory_format=cfg.memory_format(comm.device.type), compile=cfg.compile)
    cfg.compiler(comm.device.type)   # --compile: the backend checked, the caches in --compile-cache
    topo = Topology.of(plan, comm.size)   # a tiled suffix: members hold the last stage too
    held = topo.stages_of(comm.rank)
    units = range(min(plan.cuts[s] for s in held), max(plan.cuts[s + 1] for s in held))
    _, state, _, _ = checkpoint.load_stages(path, units)
    return PredictJob(cfg, comm, topo, meta, paths, root, model, plan, state)


def _window(source, top: int, left: int, size: int) -> torch.Tensor:
    """The normalised S x S input at (top, left), zero-padded past the image's edge."""
    h, w = min(size, source.height - top), min(size, source.width - left)
    x = images.normalise(images.to_channels(images.to_unit_float(source.read(top, left, h, w)), 3))
    return F.pad(x, (0, size - w, 0, size - h)) if (h, w) != (size, size) else x


def _probabilities(logits: torch.Tensor) -> torch.Tensor:
    """Class probabilities of model outputs (a single channel: the sigmoid of a binary logit)."""
    logits = logits.float()
    return torch.sigmoid(logits) if logits.shape[1] == 1 else logits.softmax(1)


def run(job: PredictJob) -> int:
    cfg, comm, meta = job.cfg, job.comm, job.meta
    from gems.pipeline.engine import Engine  # noqa: PLC0415
    cfg.apply(comm.device.type)   # process-wide: cuDNN's autotuning
    engine = Engine(job.model, job.plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.0),
                    loss_fn=nn.CrossEntropyLoss(), comm=comm, timeout=cfg.timeout,
                    autocast=cfg.autocast(), compile=cfg.compile)
    job.model = None
    engine.load_state(job.state)
    job.state = None
    mine = job.paths[engine.group::job.topo.groups]
    rows = cfg.batch_size // job.topo.groups
    if meta.get("task", "classification") == "segmentation":
        written = _segment(job, engine, mine, rows)
    else:
        written = _classify(job, engine, mine, rows)
    done = torch.tensor([float(written)], dtype=torch.float64, device=engine.device)
    comm.allreduce(done, None, "the end of prediction")
    if comm.rank == 0:
        print(f"gems-predict: {len(job.paths)} image(s) predicted, {int(done)} file(s) written to {cfg.out}",
              flush=True)
    return 0


def _segment(job: PredictJob, engine, paths: list[str], rows: int) -> int:
    """Predict masks of ``paths`` window by window; returns the files written (position 0)."""
    cfg, size = job.cfg, int(job.meta["image_size"])
    writer = engine.position == 0 and not engine.tile   # a tile group's member gets no outputs
    # every rank of the group runs the same forward steps, so all list the same windows
    sizes = [images.header_size(p) for p in paths]   # (width, height), from the headers
    plan = [(i, top, left) for i, (width, height) in enumerate(sizes)
            for top, left in windows.window_origins(height, width, size, cfg.overlap)]
    sources: dict[int, object] = {}
    stitcher, written = None, 0
    for at in range(0, len(plan), rows):
        batch = plan[at:at + rows]
        x = None
        if engine.needs_images:
            x = torch.zeros(rows, 3, size, size)
            for k, (i, top, left) in enumerate(batch):
                if i not in sources:
                    for old in [j for j in sources if j != i]:
                        sources.pop(old).close()
                    sources[i] = regions.open_image(paths[i])
                x[k] = _window(sources[i], top, left, size)
        out = engine.predict(x, batch_size=cfg.batch_size)
        if not writer:
            continue
        probs = _probabilities(out)
        for k, (i, top, left) in enumerate(batch):
            if stitcher is None:
                width, height = sizes[i]
                stitcher = windows.Stitcher(height, width, probs.shape[1], size, cfg.overlap)
            stitcher.add(top, left, probs[k])
            last = at + k + 1 == len(plan) or plan[at + k + 1][0] != i
            if last:
                written += _write_mask(cfg, job, paths[i], stitcher)
                stitcher.close()
                stitcher = None
    for source in sources.values():
        source.close()
    return written


def _write_mask(cfg, job: PredictJob, path: str, stitcher: windows.Stitcher) -> int:
    classes = max(2, int(job.meta["num_classes"]))
    binary = stitcher.channels == 1
    bands = ((p[0] > 0.5).long() if binary else p.argmax(0) for _, p in stitcher.rows())
    outputs.write_mask_png_rows(Path(cfg.out) / outputs.output_name(path, job.root, ".png"),
                                stitcher.height, stitcher.width, bands, num_classes=classes)
    if not cfg.probabilities:
        return 1
    outputs.write_probabilities_tiff(Path(cfg.out) / outputs.output_name(path, job.root, ".tif"), stitcher,
                                     dtype=cfg.probabilities_dtype)
    return 2


def _classify(job: PredictJob, engine, paths: list[str], rows: int) -> int:
    """Class probabilities of ``paths``, one line each in OUT/predictions.csv (rank 0 writes)."""
    cfg, size = job.cfg, int(job.meta["image_size"])
    lines: list[tuple[str, list[float]]] = []
    for at in range(0, len(paths), rows):
        batch = paths[at:at + rows]
        x = None
        if engine.needs_images:
            x = torch.zeros(rows, 3, size, size)
            for k, p in enumerate(batch):
                x[k] = TF.center_crop(TF.resize(images.read_image(p), size, antialias=True), size)
        out = engine.predict(x, batch_size=cfg.batch_size)
        if engine.position == 0 and not engine.tile:
            probs = _probabilities(out)
            lines += [(str(outputs.output_name(p, job.root, Path(p).suffix)), probs[k].tolist())
                      for k, p in enumerate(batch)]
    every = job.comm.allgather_object(lines)
    if job.comm.rank != 0:
        return 0
    names = job.meta.get("classes") or [str(c) for c in range(int(job.meta["num_classes"]))]
    if len(names) == 1 and int(job.meta["num_classes"]) == 1:
        names = ["1"]
    outputs.write_class_csv(Path(cfg.out) / "predictions.csv", sorted(line for part in every for line in part),
                            names)
    return 1
