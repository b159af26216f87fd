"""Training and evaluation data for one rank: its group's shard of every global batch, resumable mid-epoch.

Who loads what
    The global batch of B images (one optimizer step) is cut into D group shards: group d gets rows
    [d*B/D, (d+1)*B/D); the engine cuts its shard further into replicas and micro-batches. Only ranks
    holding the first stage need images and only ranks holding the last stage need targets, so
    ``need_images`` / ``need_labels`` say what this rank reads. A classification label-only rank takes
    labels from the listing (class folders, CSV) or from the synthetic label draw and never opens, decodes
    or generates an image; a segmentation label-only rank decodes masks only (synthetic: renders them
    without pixels); a rank needing neither yields ``(None, None)`` per step and loads nothing.

Sources and tasks (listing and checks: gems.train.samples; decoding: gems.train.images)
    ``"synthetic"`` (either task), a folder of images/ + masks/ pairs (segmentation), a folder of class
    folders or a CSV of ``path,label`` rows (classification). Targets: classification int64 [N],
    segmentation int64 [N, S, S]; ``IGNORE`` (gems.train.targets) marks what losses and metrics skip. In
    mask files, ``ignore_index`` becomes IGNORE and, with ``binary_masks``, any other nonzero value 1
    (masks saved 0/255); any other value >= ``num_classes`` stops the run with a GemsError naming the
    mask file and the value (found where the mask is decoded, raised in the main process).

Views (gems.train.augment)
    Training: segmentation takes a random S x S window (a side shorter than S is padded: image zeros,
    mask IGNORE) and, with ``augment``, random flips, quarter turns and mild colour jitter, the same for
    image and mask; classification resizes the shorter side to ``resize`` and takes a random crop (with
    ``augment``, a random horizontal flip too). ``augment=False`` keeps the random window: on images
    larger than S it is how a run sees all of them. Evaluation: segmentation centre crop / centred
    padding, classification resize + centre crop; nothing random.

Determinism (exact resume, independent of D and of the number of workers)
    Nothing reads the global torch RNG. Epoch e's order is a permutation drawn from a generator seeded
    with (seed, e), the same on every rank; global batch k is ``permutation[k*B:(k+1)*B]``. Each random
    choice for one sample (window, flips, turns, jitter; synthetic label and pixels) comes from its own
    generator seeded with (seed, e, i). So ``batches(e, start_step=k)`` yields exactly the tail of an
    uninterrupted epoch::

        permutation(seed, e):  [ 7 2 9 | 4 0 5 | 1 8 3 | ... ]     B = 3 images per global batch
                                 step 0   step 1  step 2
        step 1 over D = 3 groups:  group 0 -> [4], group 1 -> [0], group 2 -> [5]

    The last partial global batch of a training epoch is dropped, so every step has exactly B/D rows per
    group. Evaluation (``EvalData``) reads every sample once in listing order and pads the last global
    batch to B rows with zero images whose targets are all IGNORE.

Bad files never stop a run
    A file that cannot be decoded, or whose header claims more than ``max_image_pixels`` pixels (a
    decompression bomb: rejected from the header, never decoded), is not fatal. The batch shape is fixed,
    so the sample stays in the batch with all-zero pixels (zero = the dataset mean after normalisation):
    classification keeps its label (label-only ranks cannot know a file is bad without decoding it);
    segmentation gives it an all-IGNORE target where the rank decoding the image also reads the mask (a
    mask-only rank cannot know the image is bad: it keeps the mask), and an unusable mask always gives an
    all-IGNORE target. The rank that found it warns once per file (``RuntimeWarning``) and counts every
    replaced sample in ``skipped``. Workers hand a per-sample error string back with the batch, so the
    count is kept in the main process.

Workers under MPI
    MPI is initialised before loaders start, and forking an MPI process is unsafe, so workers (``workers
    > 0``) start through ``forkserver`` (``spawn`` where it is missing; gems.train.workers: they also end
    as soon as their rank does, however it ends), persist across epochs (one loader
    per TrainData / EvalData, its batch list swapped per epoch: iterate one epoch at a time), prefetch
    two batches each and pin memory when CUDA is available. Datasets are plain picklable objects. As
    with any spawned worker, a script that makes loaders needs the ``if __name__ == "__main__":`` guard.

Synthetic data (``source="synthetic"``)
    New samples every epoch, ``synthetic_size`` per epoch, keyed by (seed, epoch, index). Classification:
    label = first draw, image = N(0, 1) noise + a class pattern (offset + low-frequency wave drawn from
    (seed, class)). Segmentation: the coloured shapes of ``gems-data synth`` (gems.train.synth) at S x S.
"""
from __future__ import annotations

import math
import warnings
from typing import Iterator

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from gems.errors import GemsError
from gems.train import synth
from gems.train.datasets import (EVAL, BatchKeys, ClassifiedImages, LabelMap, SegmentationPairs,
                                 SyntheticClasses, SyntheticShapes, collate)
from gems.train.images import IMAGENET_MEAN, IMAGENET_STD, read_image  # noqa: F401 - the public API
from gems.train.samples import TASKS, PredictImages, list_source  # noqa: F401
from gems.train.seeds import generator
from gems.train.targets import IGNORE
from gems.train.workers import context as worker_context, start_server, watch_rank

__all__ = ["TrainData", "EvalData", "PredictImages", "read_image", "IMAGENET_MEAN", "IMAGENET_STD"]

Batch = tuple[Tensor | None, Tensor | None]


class _Source:
    """What TrainData and EvalData share: argument checks, the opened source, the loader, bad-file reports."""

    def _open(self, source, image_size, batch_size, groups, group, *, task, num_classes, ignore_index,
              binary_masks, augment, seed, workers, need_images, need_labels, channels, max_image_pixels,
              resize, synthetic_size, train: bool) -> None:
        for name, value, low in (("image_size", image_size, 1), ("batch_size", batch_size, 1),
                                 ("groups", groups, 1), ("channels", channels, 1), ("workers", workers, 0)):
            if not isinstance(value, int) or value < low:
                raise GemsError(f"{name} must be an integer >= {low}, got {value!r}: pass a valid {name}")
        if batch_size % groups:
            raise GemsError(f"batch size {batch_size} cannot be split evenly over {groups} data-parallel "
                            f"groups: choose a batch size that is a multiple of {groups}")
        if not 0 <= group < groups:
            raise GemsError(f"group {group} does not exist among {groups} groups: pass 0 <= group < {groups}")
        if task not in TASKS:
            raise GemsError(f"task {task!r} is not one of {', '.join(TASKS)}: pass one of them")
        if max_image_pixels is not None and max_image_pixels < 1:
            raise GemsError(f"max_image_pixels must be positive, got {max_image_pixels}: pass a pixel count "
                            "or leave it unset")
        if resize is not None and resize < image_size:
            raise GemsError(f"resize {resize} is smaller than image_size {image_size}: pass resize >= "
                            "image_size or leave it unset")
        if num_classes is not None and (not isinstance(num_classes, int) or num_classes < 1):
            raise GemsError(f"num_classes must be an integer >= 1, got {num_classes!r}: pass a class count "
                            "or leave it unset")
        if ignore_index is not None and not isinstance(ignore_index, int):
            raise GemsError(f"ignore_index must be an integer, got {ignore_index!r}: pass the mask value to "
                            "ignore")
        if binary_masks and task != "segmentation":
            raise GemsError("binary_masks applies to segmentation masks: drop it or pass task segmentation")
        if binary_masks and num_classes not in (None, 1, 2):
            raise GemsError(f"binary masks have 2 classes (or 1 for a single-logit head), not num_classes="
                            f"{num_classes}: pass num_classes 2 (--num-classes 2) or 1, or leave it unset")
        self.image_size, self.batch_size, self.groups, self.group = image_size, batch_size, groups, group
        self.shard = batch_size // groups
        self.task, self.seed, self.workers, self.channels = task, seed, workers, channels
        self.need_images, self.need_labels = need_images, need_labels
        self.skipped, self._warned, self._loader = 0, set(), None
        self.classes: list[str] = []
        self._targets: Tensor | None = None      # classification labels of a listing (label-only ranks)
        segmentation = task == "segmentation"
        want_target = need_labels and segmentation  # classification labels come from the listing
        if source == "synthetic":
            self.num_classes = num_classes if num_classes is not None else (3 if segmentation else 10)
            if self.num_classes < 1 or synthetic_size < 1:
                raise GemsError("synthetic data needs num_classes >= 1 and synthetic_size >= 1: pass "
                                "positive values")
            self.num_samples = synthetic_size
            if segmentation:
                synth.check("segmentation", synth.MIN_SIZE, self.num_classes)
                self._check_channels(channels)
                self._dataset = SyntheticShapes(seed, self.num_classes, image_size, channels, need_images,
                                                want_target)
            else:
                self._dataset = SyntheticClasses(seed, self.num_classes, image_size, channels)
            return
        listing = list_source(source, task, num_classes, ignore_index)
        self._check_channels(channels)
        from PIL import Image  # noqa: PLC0415

        limit = max_image_pixels or max(16 * image_size ** 2, Image.MAX_IMAGE_PIXELS or 0)
        self.num_samples, self.classes = len(listing.samples), listing.classes
        if segmentation:
            if num_classes is None and not binary_masks:
                raise GemsError(f"segmentation masks in {source!r} need num_classes (the classes of the mask "
                                "values, background included): pass num_classes (--num-classes)")
            self.num_classes = num_classes if num_classes is not None else 2
            labels = LabelMap(self.num_classes, ignore_index, binary_masks)
            self._dataset = SegmentationPairs(listing.samples, seed, image_size, channels, limit, labels,
                                              train, augment, need_images, want_target)
        else:
            self.num_classes = listing.num_classes
            self._targets = torch.tensor([label for _, label in listing.samples], dtype=torch.int64)
            self._dataset = ClassifiedImages(listing.samples, seed, image_size, resize or image_size, channels,
                                             limit, train, augment)

    @staticmethod
    def _check_channels(channels: int) -> None:
        if channels not in (1, 3):
            raise GemsError(f"image files are read as RGB (3 channels) or grayscale (1), not {channels} "
                            "channels: pass channels=3 or channels=1")

    @property
    def _loads(self) -> bool:
        """Whether this rank reads items through the loader (else labels come from the listing or draw)."""
        return self.need_images or (self.need_labels and self.task == "segmentation")

    def _labels(self, keys: list[tuple]) -> Tensor:
        """Classification labels without loading an image: from the listing, or the synthetic draw."""
        if self._targets is not None:
            return self._targets[[i for _, i in keys]]
        return torch.tensor([self._dataset.label(generator(self.seed, *k)) for k in keys], dtype=torch.int64)

    def _load(self, batches: list[list[tuple]]) -> Iterator[tuple]:
        """(images, targets, problems, fatals) of each key list, through one persistent loader."""
        if not batches:
            return
        if self._loader is None:
            extra = {}
            if self.workers:
                start_server()   # if no one has: its processes must not die of the rank's stop signals
                extra = dict(multiprocessing_context=worker_context(), worker_init_fn=watch_rank(),
                             persistent_workers=True, prefetch_factor=2)
            # Its own generator: each pass draws a base seed for the workers (unused: samples carry their
            # own), which would otherwise advance the global torch RNG that dropout and the like use.
            self._loader = DataLoader(self._dataset, batch_sampler=BatchKeys(), num_workers=self.workers,
                                      collate_fn=collate, pin_memory=torch.cuda.is_available(),
                                      generator=torch.Generator(), **extra)
        self._loader.batch_sampler.batches = batches
        yield from self._loader

    def _report(self, problems: list[tuple], fatals: list[str]) -> None:
        """Raise the first user error found while decoding; count and warn (once per file) the rest."""
        fatal = next((f for f in fatals if f), None)
        if fatal:
            raise GemsError(fatal)
        for found in problems:
            if not found:
                continue
            self.skipped += 1
            for path, message in found:
                if path not in self._warned:
                    self._warned.add(path)
                    warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _pick(self, images: Tensor | None, targets: Tensor | None) -> Batch:
        return (images if self.need_images else None), (targets if self.need_labels else None)


class TrainData(_Source):
    """The group shard of each global batch of an epoch, for one rank.

    source: ``"synthetic"``, a folder of images/ + masks/ (segmentation), a folder of class folders or a
        CSV file (classification); see the module docstring.
    image_size: side S of the square images yielded. batch_size: global batch B (all groups together).
    groups, group: D and this rank's group d; B must be divisible by D.
    task: "classification" or "segmentation".
    num_classes: synthetic (default 10 classification, 3 segmentation), a CSV of integer labels (default
        largest label + 1) and segmentation folders (required, default 2 with ``binary_masks``); for
        class folders and named CSV labels it must match the listing.
    ignore_index: the mask (or CSV label) value that means "ignore"; it becomes IGNORE.
    binary_masks: masks hold 0 and nonzero (e.g. 255): nonzero becomes class 1.
    augment: training flips, quarter turns and colour jitter (segmentation) / horizontal flips
        (classification); the random window or crop is always on.
    need_images / need_labels: what this rank consumes (first stage / last stage).
    workers: DataLoader processes decoding images (0 = in this process).
    max_image_pixels: files whose header has more pixels are skipped (default: the larger of 16 S^2 and
        PIL's own limit, about 89 million).
    resize: classification: the shorter side is resized to this before the random S x S crop (default S;
        e.g. 8/7 S for ImageNet-style translation augmentation).
    synthetic_size: samples per epoch of the synthetic dataset.

    Resuming: ``epoch`` and ``step`` always hold the next batch to yield (saved by ``state_dict``), so a
    training loop reads ``for e in range(data.epoch, E): for x, y in data.batches(e, data.step if e ==
    data.epoch else 0): ...`` both on a fresh start and after ``load_state_dict``.
    """

    def __init__(self, source: str, image_size: int, batch_size: int, groups: int, group: int, *,
                 task: str = "classification", num_classes: int | None = None, ignore_index: int | None = None,
                 binary_masks: bool = False, augment: bool = True, seed: int = 0, workers: int = 2,
                 need_images: bool = True, need_labels: bool = True, channels: int = 3,
                 max_image_pixels: int | None = None, resize: int | None = None, synthetic_size: int = 10_000):
        self._open(source, image_size, batch_size, groups, group, task=task, num_classes=num_classes,
                   ignore_index=ignore_index, binary_masks=binary_masks, augment=augment, seed=seed,
                   workers=workers, need_images=need_images, need_labels=need_labels, channels=channels,
                   max_image_pixels=max_image_pixels, resize=resize, synthetic_size=synthetic_size, train=True)
        self.epoch, self.step = 0, 0
        self.steps_per_epoch = self.num_samples // batch_size
        if self.steps_per_epoch == 0:
            raise GemsError(f"{source!r} has {self.num_samples} samples, fewer than one global batch of "
                            f"{batch_size}: add images or lower the batch size")

    def _order(self, epoch: int) -> Tensor | None:
        """Dataset index of each position of the epoch (None for synthetic: position i is sample i)."""
        if isinstance(self._dataset, (SyntheticClasses, SyntheticShapes)):
            return None
        return torch.randperm(self.num_samples, generator=generator(self.seed, epoch))

    def _keys(self, epoch: int, order: Tensor | None, step: int) -> list[tuple[int, int]]:
        """The (epoch, sample) keys of this group's rows of global batch ``step``."""
        start = step * self.batch_size + self.group * self.shard
        rows = range(start, start + self.shard)
        return [(epoch, i) for i in rows] if order is None else [(epoch, int(order[i])) for i in rows]

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        """This group's shard ``(images N x C x S x S float32 or None, targets int64 N or N x S x S or
        None)``, N = B / D, of global batches ``start_step .. steps_per_epoch - 1`` of ``epoch``."""
        if not isinstance(epoch, int) or epoch < 0 or not 0 <= start_step <= self.steps_per_epoch:
            raise GemsError(f"cannot start epoch {epoch!r} at step {start_step!r}: pass epoch >= 0 and "
                            f"0 <= start_step <= {self.steps_per_epoch}")
        self.epoch, self.step = (epoch + 1, 0) if start_step == self.steps_per_epoch else (epoch, start_step)
        order = self._order(epoch) if (self.need_images or self.need_labels) else None
        steps = range(start_step, self.steps_per_epoch)
        if self._loads:
            keys = [self._keys(epoch, order, k) for k in steps]
            for k, (images, targets, problems, fatals) in zip(steps, self._load(keys)):
                self._report(problems, fatals)
                self._advance(k)
                yield self._pick(images, targets)
        else:
            for k in steps:
                labels = self._labels(self._keys(epoch, order, k)) if self.need_labels else None
                self._advance(k)
                yield None, labels

    def _advance(self, step: int) -> None:
        # Set before the yield: a checkpoint taken after training on batch `step` resumes at the next one.
        self.epoch, self.step = ((self.epoch + 1, 0) if step + 1 == self.steps_per_epoch
                                 else (self.epoch, step + 1))

    def state_dict(self) -> dict:
        """Plain data to resume from: next (epoch, step), the skip count, and what the order depends on."""
        return {"epoch": self.epoch, "step": self.step, "skipped": self.skipped, "seed": self.seed,
                "batch_size": self.batch_size, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "batch_size", "num_samples"):
            if state[key] != getattr(self, key):
                raise GemsError(f"the checkpoint's data {key} is {state[key]} but this run's is "
                                f"{getattr(self, key)}: resume with the same data, batch size and seed")
        self.epoch, self.step, self.skipped = state["epoch"], state["step"], state["skipped"]


class EvalData(_Source):
    """Every sample once, in listing order, as this group's shard of ``steps`` global batches.

    Global batch k holds samples [kB, (k+1)B); group d takes its rows [d*B/D, (d+1)*B/D). The last batch
    is padded to B rows with zero images whose targets are all IGNORE, so losses and metrics skip them.
    Arguments as TrainData's (no augmentation: centre crops / centred padding); a synthetic source is a
    fixed set of ``synthetic_size`` samples (default 256), keyed apart from every training epoch.
    """

    def __init__(self, source: str, image_size: int, batch_size: int, groups: int, group: int, *,
                 task: str = "classification", num_classes: int | None = None, ignore_index: int | None = None,
                 binary_masks: bool = False, workers: int = 2, need_images: bool = True,
                 need_labels: bool = True, channels: int = 3, seed: int = 0, max_image_pixels: int | None = None,
                 resize: int | None = None, synthetic_size: int = 256):
        self._open(source, image_size, batch_size, groups, group, task=task, num_classes=num_classes,
                   ignore_index=ignore_index, binary_masks=binary_masks, augment=False, seed=seed,
                   workers=workers, need_images=need_images, need_labels=need_labels, channels=channels,
                   max_image_pixels=max_image_pixels, resize=resize, synthetic_size=synthetic_size, train=False)
        self.steps = math.ceil(self.num_samples / batch_size)

    def _rows(self, step: int) -> list[tuple]:
        """The (EVAL, sample) keys of this group's real (not padding) rows of global batch ``step``."""
        start = step * self.batch_size + self.group * self.shard
        return [(EVAL, i) for i in range(start, min(start + self.shard, self.num_samples))]

    def _padded(self, images: Tensor | None, targets: Tensor | None, real: int) -> Batch:
        pad = self.shard - real
        if images is not None and pad:
            images = torch.cat([images, images.new_zeros(pad, *images.shape[1:])])
        if targets is not None and pad:
            shape = (pad, self.image_size, self.image_size) if self.task == "segmentation" else (pad,)
            targets = torch.cat([targets, torch.full(shape, IGNORE, dtype=torch.int64)])
        return self._pick(images, targets)

    def _empty(self) -> Batch:
        """A shard that is all padding."""
        images = torch.zeros(0, self.channels, self.image_size, self.image_size) if self.need_images else None
        shape = (0, self.image_size, self.image_size) if self.task == "segmentation" else (0,)
        targets = torch.zeros(shape, dtype=torch.int64) if self.need_labels else None
        return self._padded(images, targets, 0)

    def batches(self) -> Iterator[Batch]:
        """This group's shard ``(images | None, targets | None)`` of each of the ``steps`` global batches."""
        rows = [self._rows(k) for k in range(self.steps)]
        if not (self.need_images or self.need_labels):
            yield from [(None, None)] * self.steps
        elif not self._loads:
            for keys in rows:
                yield self._padded(None, self._labels(keys), len(keys)) if keys else self._empty()
        else:
            loaded = self._load([keys for keys in rows if keys])
            for keys in rows:
                if not keys:
                    yield self._empty()
                    continue
                images, targets, problems, fatals = next(loaded)
                self._report(problems, fatals)
                yield self._padded(images, targets, len(keys))
