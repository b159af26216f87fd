"""The map-style datasets the loaders read: item ``(epoch, index)`` -> ``(image, target, problems, fatal)``.

    image     float32 C x S x S, normalised; None when the rank does not need images
    target    class index (int) or int64 S x S label map; None when the rank does not need targets
    problems  ((path, warning), ...) for a file that could not be used: the sample was replaced (zero
              pixels; for segmentation an all-IGNORE target) and is counted as skipped by the caller
    fatal     "" or a user error found while decoding (a mask label out of range): the caller raises it

Items are computed wherever the DataLoader runs them (this process or a worker): problems and errors
travel back as plain strings with the batch, so counting, warning and raising stay in the main process.
Every random choice is drawn from the sample's own generator, seeded with (seed, epoch, index); the
evaluation key ``EVAL`` replaces the epoch for evaluation sets, which are never random. The datasets are
plain picklable objects (paths, numbers), as forkserver/spawn workers need.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler

from gems.train import augment as views
from gems.train import synth
from gems.train.images import NotAMask, TooLarge, decode, normalise, read_mask, to_channels
from gems.train.seeds import generator
from gems.train.targets import IGNORE

EVAL = "eval"   # epoch key of evaluation samples: never equal to a training epoch


def _reason(error: Exception) -> str:
    return str(error) if isinstance(error, TooLarge) else f"cannot be decoded ({type(error).__name__}: {error})"


class SyntheticClasses(Dataset):
    """Classification: noise plus the pattern of the sample's class (see gems.train.data)."""

    def __init__(self, seed: int, num_classes: int, image_size: int, channels: int):
        self.seed, self.num_classes, self.size, self.channels = seed, num_classes, image_size, channels

    def label(self, g: torch.Generator) -> int:
        # Always the first draw, so label-only ranks get the same label without touching the pixels.
        return int(torch.randint(self.num_classes, (1,), generator=g))

    def pattern(self, label: int) -> Tensor:
        g = generator(self.seed, -1, label)  # -1: class patterns never collide with a sample's seed
        offset = torch.randn(self.channels, 1, 1, generator=g) * 0.5
        fy, fx = (torch.randint(1, 4, (2,), generator=g) * 2 * math.pi / self.size).tolist()
        phase = float(torch.rand(1, generator=g)) * 2 * math.pi
        sign = torch.randint(0, 2, (self.channels, 1, 1), generator=g) * 2.0 - 1.0
        pos = torch.arange(self.size, dtype=torch.float32)
        # cos(a + b) = cos a cos b - sin a sin b: an S x S wave from two length-S vectors.
        a, b = pos[:, None] * fy + phase, pos[None, :] * fx
        wave = torch.cos(a) * torch.cos(b) - torch.sin(a) * torch.sin(b)
        return offset + 0.5 * sign * wave

    def __getitem__(self, key: tuple) -> tuple:
        g = generator(self.seed, *key)
        label = self.label(g)
        image = torch.randn(self.channels, self.size, self.size, generator=g)
        return image.add_(self.pattern(label)), label, (), ""


class SyntheticShapes(Dataset):
    """Segmentation: the shapes of gems.train.synth drawn at S x S (new ones every epoch, no augmentation);
    a mask-only rank renders the mask and never generates pixels."""

    def __init__(self, seed: int, num_classes: int, image_size: int, channels: int, want_image: bool,
                 want_target: bool):
        self.seed, self.num_classes, self.size, self.channels = seed, num_classes, image_size, channels
        self.want_image, self.want_target = want_image, want_target

    def __getitem__(self, key: tuple) -> tuple:
        g = generator(self.seed, *key)
        found = synth.shapes(g, self.size, "segmentation", self.num_classes)
        target = synth.mask(found, self.size) if self.want_target else None
        image = None
        if self.want_image:
            image = normalise(to_channels(synth.image(found, g, self.size), self.channels))
        return image, target, (), ""


class ClassifiedImages(Dataset):
    """Classification files: decode, resize the shorter side, crop (random and flipped for training,
    centred for evaluation), normalise. An unusable file gives zero pixels and keeps its label."""

    def __init__(self, samples: list[tuple[str, int]], seed: int, image_size: int, resize: int,
                 channels: int, max_pixels: int | None, train: bool, augment: bool):
        self.samples, self.seed, self.size, self.resize = samples, seed, image_size, resize
        self.channels, self.max_pixels, self.train, self.augment = channels, max_pixels, train, augment

    def __getitem__(self, key: tuple) -> tuple:
        epoch, index = key
        path, label = self.samples[index]
        try:
            pixels = decode(path, self.channels, self.max_pixels, draft=self.resize)
        except Exception as e:  # any failure to decode one file is that file's fault: skip it, keep running
            warning = f"skipping image {path}: it {_reason(e)}; its pixels are replaced by zeros and its label kept"
            return torch.zeros(self.channels, self.size, self.size), label, ((path, warning),), ""
        g = generator(self.seed, epoch, index) if self.train else None
        return views.classify(pixels, self.size, self.resize, g, flip=self.augment), label, (), ""


@dataclass(frozen=True)
class LabelMap:
    """How mask files become targets: ``ignore_index`` -> IGNORE; then with ``binary`` nonzero -> 1,
    else every other value must be a class index below ``num_classes``."""
    num_classes: int
    ignore_index: int | None = None
    binary: bool = False

    def __call__(self, raw: Tensor, path: str) -> tuple[Tensor, str]:
        ignored = raw == self.ignore_index if self.ignore_index is not None else None
        if self.binary:   # 0 / 1 by construction, also for a single-logit head (num_classes 1)
            target = (raw != 0).long()
            return (target if ignored is None else target.masked_fill(ignored, IGNORE)), ""
        target, bad = raw, (raw >= self.num_classes) | (raw < 0)
        if ignored is not None:
            bad &= ~ignored
        if bad.any():
            value = int(raw[bad].max())
            return target, (f"mask {path} has the value {value}, which is not a class index below num_classes="
                            f"{self.num_classes}" + ("" if self.ignore_index is None else
                                                     f" nor the ignore index {self.ignore_index}")
                            + ": fix the mask, raise num_classes, or pass that value as the ignore index")
        if ignored is not None:
            target = target.masked_fill(ignored, IGNORE)
        return target, ""


class SegmentationPairs(Dataset):
    """Image + mask files: the same window, flips and turns for both (gems.train.augment); an unusable
    image gives zero pixels and an all-IGNORE target, an unusable mask an all-IGNORE target."""

    def __init__(self, pairs: list[tuple[str, str]], seed: int, image_size: int, channels: int,
                 max_pixels: int | None, labels: LabelMap, train: bool, augment: bool, want_image: bool,
                 want_target: bool):
        self.pairs, self.seed, self.size, self.channels = pairs, seed, image_size, channels
        self.max_pixels, self.labels, self.train, self.augment = max_pixels, labels, train, augment
        self.want_image, self.want_target = want_image, want_target

    def _read(self, index: int) -> tuple[Tensor | None, Tensor | None, list, str]:
        """Decoded pixels and the mapped label map (None where not wanted or unusable), problems, fatal."""
        image_path, mask_path = self.pairs[index]
        problems, pixels, raw = [], None, None
        if self.want_image:
            try:
                pixels = decode(image_path, self.channels, self.max_pixels)
            except Exception as e:
                problems.append((image_path, f"skipping image {image_path}: it {_reason(e)}; its pixels are "
                                             "replaced by zeros" + (" and its mask ignored" if self.want_target
                                                                    else "")))
        if self.want_target and not problems:
            try:
                raw = read_mask(mask_path, self.max_pixels)
            except NotAMask as e:
                return None, None, [], f"mask {mask_path} {e}"
            except Exception as e:
                problems.append((mask_path, f"skipping mask {mask_path}: it {_reason(e)}; all its pixels are "
                                            "ignored"))
        if pixels is not None and raw is not None and pixels.shape[-2:] != raw.shape:
            problems.append((mask_path, f"skipping mask {mask_path}: it has {raw.shape[1]}x{raw.shape[0]} "
                                        f"pixels, its image {pixels.shape[2]}x{pixels.shape[1]}; the sample "
                                        "is ignored"))
            return None, None, problems, ""
        if raw is None:
            return pixels, None, problems, ""
        target, fatal = self.labels(raw, mask_path)
        return (None, None, [], fatal) if fatal else (pixels, target, problems, "")

    def __getitem__(self, key: tuple) -> tuple:
        epoch, index = key
        pixels, target, problems, fatal = self._read(index)
        shape = (pixels if pixels is not None else target if target is not None else torch.zeros(1, 1)).shape[-2:]
        g = generator(self.seed, epoch, index) if self.train else None
        p = views.draw(g, *shape, self.size, self.augment) if self.train else views.centred(*shape, self.size)
        image, target = views.view(p, self.size, pixels, target)
        if self.want_image and image is None:
            image = torch.zeros(self.channels, self.size, self.size)
        if self.want_target and target is None:
            target = torch.full((self.size, self.size), IGNORE, dtype=torch.int64)
        return image, target, tuple(problems), fatal


def collate(items: list[tuple]) -> tuple:
    """A batch: (images N x C x S x S or None, targets N or N x S x S int64 or None, problems, fatals)."""
    images = [item[0] for item in items]
    targets = [item[1] for item in items]
    x = torch.stack(images) if images[0] is not None else None
    if targets[0] is None:
        y = None
    elif isinstance(targets[0], Tensor):
        y = torch.stack(targets)
    else:
        y = torch.tensor(targets, dtype=torch.int64)
    return x, y, [item[2] for item in items], [item[3] for item in items]


class BatchKeys(Sampler):
    """The batch list of the next pass; swapped per epoch so one persistent loader serves every epoch."""

    def __init__(self):
        self.batches: list[list[tuple]] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)
