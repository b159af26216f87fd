"""Training data for one rank: its group's shard of every global batch, resumable mid-epoch.

Who loads what
    The global batch of B images (one optimizer step) is cut into D group shards: group d gets rows
    [d*B/D, (d+1)*B/D); the engine cuts its shard further into replicas and micro-batches. Only ranks
    holding the first stage need images and only ranks holding the last stage need labels, so
    ``need_images`` / ``need_labels`` say what this rank reads. A label-only rank takes labels from the
    folder listing (``ImageFolder.targets``) or from the synthetic label draw and never opens, decodes or
    generates an image; a rank needing neither yields ``(None, None)`` per step and loads nothing.

Determinism (exact resume, independent of D and of the number of workers)
    Nothing reads the global torch RNG. Epoch e's order is a permutation drawn from a generator seeded
    with (seed, e), the same on every rank; global batch k is ``permutation[k*B:(k+1)*B]``. Each random
    choice for one sample (crop, flip; synthetic label and pixels) comes from its own generator seeded
    with (seed, e, i). So ``batches(e, start_step=k)`` yields exactly the tail of an uninterrupted epoch::

        permutation(seed, e):  [ 7 2 9 | 4 0 5 | 1 8 3 | ... ]     B = 3 images per global batch
                                 step 0   step 1  step 2
        step 1 over D = 3 groups:  group 0 -> [4], group 1 -> [0], group 2 -> [5]

    The last partial global batch of an epoch is dropped, so every step has exactly B/D rows per group.

Bad files never stop a run
    A file that cannot be decoded, or whose header claims more than ``max_image_pixels`` pixels (a
    decompression bomb: rejected from the header, never decoded), is not fatal. The batch shape is fixed
    and label-only ranks cannot know a file is bad without decoding it, so the sample stays in the batch
    with its label and all-zero pixels (zero = the dataset mean after normalisation). The image rank warns
    once per file (``RuntimeWarning``, printed to stderr) and counts every replaced sample in ``skipped``.
    Workers hand a per-sample error string back with the batch, so the count is kept in the main process.

Synthetic data (``source="synthetic"``)
    A virtual dataset of ``synthetic_size`` samples per epoch (default 10,000), new samples every epoch.
    Sample i of epoch e: label = first draw of its generator, image = N(0, 1) noise + a class pattern (a
    per-channel offset plus a low-frequency cosine wave, both drawn from (seed, class)). A small CNN learns
    it in a few dozen steps, so a falling loss shows the pipeline trains.
"""
from __future__ import annotations

import hashlib
import math
import os
import warnings
from typing import Iterator

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from gems.errors import GemsError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers: well spread, identical on every rank and Python run."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(*parts))


class _SyntheticImages(Dataset):
    """Item (epoch, i) -> (image C x S x S, label, ""): noise plus the pattern of the sample's class."""

    def __init__(self, seed: int, num_classes: int, image_size: int, channels: int):
        self.seed, self.num_classes, self.size, self.channels = seed, num_classes, image_size, channels

    def label(self, g: torch.Generator) -> int:
        # Always the first draw, so label-only ranks get the same label without touching the pixels.
        return int(torch.randint(self.num_classes, (1,), generator=g))

    def pattern(self, label: int) -> Tensor:
        g = _generator(self.seed, -1, label)  # -1: class patterns never collide with a sample's seed
        offset = torch.randn(self.channels, 1, 1, generator=g) * 0.5
        fy, fx = (torch.randint(1, 4, (2,), generator=g) * 2 * math.pi / self.size).tolist()
        phase = float(torch.rand(1, generator=g)) * 2 * math.pi
        sign = torch.randint(0, 2, (self.channels, 1, 1), generator=g) * 2.0 - 1.0
        pos = torch.arange(self.size, dtype=torch.float32)
        # cos(a + b) = cos a cos b - sin a sin b: an S x S wave from two length-S vectors.
        a, b = pos[:, None] * fy + phase, pos[None, :] * fx
        wave = torch.cos(a) * torch.cos(b) - torch.sin(a) * torch.sin(b)
        return offset + 0.5 * sign * wave

    def __getitem__(self, key: tuple[int, int]) -> tuple[Tensor, int, str]:
        g = _generator(self.seed, *key)
        label = self.label(g)
        image = torch.randn(self.channels, self.size, self.size, generator=g)
        return image.add_(self.pattern(label)), label, ""


class _TooLarge(Exception):
    """The header of an image claims more pixels than allowed."""


class _FolderImages(Dataset):
    """Item (epoch, index) -> (normalised image, label, error or ""): decode, resize, random crop, flip."""

    def __init__(self, samples: list[tuple[str, int]], seed: int, image_size: int, resize: int,
                 channels: int, max_pixels: int):
        self.samples, self.seed, self.size, self.resize = samples, seed, image_size, resize
        self.channels, self.max_pixels = channels, max_pixels
        mean, std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ((0.449,), (0.226,))
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def decode(self, path: str):
        """The image at path in the wanted mode, checked against max_pixels before any pixel is decoded."""
        from PIL import Image

        # PIL's own bomb limit must not be stricter than ours; our check below is the one that rejects.
        if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < self.max_pixels:
            Image.MAX_IMAGE_PIXELS = self.max_pixels
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(path)  # reads the header only
        with img:
            w, h = img.size
            if w * h > self.max_pixels:
                raise _TooLarge(f"has {w}x{h} = {w * h} pixels, more than max_image_pixels={self.max_pixels}")
            mode = "RGB" if self.channels == 3 else "L"
            img.draft(mode, (self.resize, self.resize))  # JPEG: decode at a reduced scale when much larger
            return img.convert(mode)

    def __getitem__(self, key: tuple[int, int]) -> tuple[Tensor, int, str]:
        import torchvision.transforms.functional as TF

        epoch, index = key
        path, label = self.samples[index]
        try:
            img = self.decode(path)
        except _TooLarge as e:
            return torch.zeros(self.channels, self.size, self.size), label, str(e)
        except Exception as e:  # any failure to decode one file is that file's fault: skip it, keep running
            return (torch.zeros(self.channels, self.size, self.size), label,
                    f"cannot be decoded ({type(e).__name__}: {e})")
        img = TF.resize(img, self.resize)  # shorter side -> resize
        u = torch.rand(3, generator=_generator(self.seed, epoch, index)).tolist()
        top = int(u[0] * (img.height - self.size + 1))
        left = int(u[1] * (img.width - self.size + 1))
        img = TF.crop(img, top, left, self.size, self.size)
        if u[2] < 0.5:
            img = TF.hflip(img)
        x = TF.pil_to_tensor(img).float().div_(255)
        return x.sub_(self.mean).div_(self.std), label, ""


class TrainData:
    """The group shard of each global batch of an epoch, for one rank.

    source: ``"synthetic"`` or the root of an ImageFolder tree (root/class_name/image.ext).
    image_size: side S of the square images yielded. batch_size: global batch B (all groups together).
    groups, group: D and this rank's group d; B must be divisible by D.
    num_classes: synthetic only (default 10); for a folder it is the number of class folders.
    need_images / need_labels: what this rank consumes (first stage / last stage).
    workers: DataLoader processes decoding images (0 = in this process).
    max_image_pixels: files whose header has more pixels are skipped (default: the larger of 16 S^2 and
        PIL's own limit, about 89 million).
    resize: the shorter side is resized to this before the random S x S crop (default S; e.g. 8/7 S for
        ImageNet-style translation augmentation).
    synthetic_size: samples per epoch of the synthetic dataset.

    Resuming: ``epoch`` and ``step`` always hold the next batch to yield (saved by ``state_dict``), so a
    training loop reads ``for e in range(data.epoch, E): for x, y in data.batches(e, data.step if e ==
    data.epoch else 0): ...`` both on a fresh start and after ``load_state_dict``.
    """

    def __init__(self, source: str, image_size: int, batch_size: int, groups: int, group: int, *,
                 num_classes: int | None = None, seed: int = 0, workers: int = 2,
                 need_images: bool = True, need_labels: bool = True, channels: int = 3,
                 max_image_pixels: int | None = None, resize: int | None = None,
                 synthetic_size: int = 10_000):
        for name, value, low in (("image_size", image_size, 1), ("batch_size", batch_size, 1),
                                 ("groups", groups, 1), ("channels", channels, 1), ("workers", workers, 0)):
            if not isinstance(value, int) or value < low:
                raise GemsError(f"{name} must be an integer >= {low}, got {value!r}: pass a valid {name}")
        if batch_size % groups:
            raise GemsError(f"batch size {batch_size} cannot be split evenly over {groups} data-parallel "
                            f"groups: choose a batch size that is a multiple of {groups}")
        if not 0 <= group < groups:
            raise GemsError(f"group {group} does not exist among {groups} groups: pass 0 <= group < {groups}")
        if max_image_pixels is not None and max_image_pixels < 1:
            raise GemsError(f"max_image_pixels must be positive, got {max_image_pixels}: pass a pixel count "
                            "or leave it unset")
        if resize is not None and resize < image_size:
            raise GemsError(f"resize {resize} is smaller than image_size {image_size}: pass resize >= "
                            "image_size or leave it unset")
        self.image_size, self.batch_size, self.groups, self.group = image_size, batch_size, groups, group
        self.shard = batch_size // groups
        self.seed, self.workers, self.channels = seed, workers, channels
        self.need_images, self.need_labels = need_images, need_labels
        self.skipped = 0
        self.epoch, self.step = 0, 0
        self._warned: set[str] = set()

        if source == "synthetic":
            self.num_classes = 10 if num_classes is None else num_classes
            if self.num_classes < 1 or synthetic_size < 1:
                raise GemsError("synthetic data needs num_classes >= 1 and synthetic_size >= 1: pass "
                                "positive values")
            self._dataset: Dataset = _SyntheticImages(seed, self.num_classes, image_size, channels)
            self.num_samples, self._targets, self._paths = synthetic_size, None, None
        else:
            self._open_folder(source, num_classes, channels, image_size, resize, max_image_pixels)
        self.steps_per_epoch = self.num_samples // batch_size
        if self.steps_per_epoch == 0:
            raise GemsError(f"{source!r} has {self.num_samples} samples, fewer than one global batch of "
                            f"{batch_size}: add images or lower the batch size")

    def _open_folder(self, source: str, num_classes: int | None, channels: int, image_size: int,
                     resize: int | None, max_image_pixels: int | None) -> None:
        from PIL import Image
        from torchvision.datasets import ImageFolder

        if not os.path.exists(source):
            raise GemsError(f"data source {source!r} is neither 'synthetic' nor an existing folder: pass "
                            "'synthetic' or the path of an ImageFolder tree (root/class_name/image.jpg)")
        if not os.path.isdir(source):
            raise GemsError(f"data source {source!r} is a file, not a folder: pass the root folder of an "
                            "ImageFolder tree (root/class_name/image.jpg)")
        if channels not in (1, 3):
            raise GemsError(f"image folders are read as RGB (3 channels) or grayscale (1), not {channels} "
                            "channels: pass channels=3 or channels=1")
        try:  # lists files only; no image is opened here
            folder = ImageFolder(source, loader=lambda path: path)
        except FileNotFoundError:
            raise GemsError(f"{source!r} has no class subfolders with images: arrange it as "
                            "root/class_name/image.jpg (one subfolder per class)") from None
        if num_classes is not None and num_classes != len(folder.classes):
            raise GemsError(f"{source!r} has {len(folder.classes)} class folders but num_classes is "
                            f"{num_classes}: leave num_classes unset or make them agree")
        self.num_classes = len(folder.classes)
        self.classes = folder.classes
        self.num_samples = len(folder.samples)
        self._targets = torch.tensor(folder.targets, dtype=torch.int64)
        self._paths = [path for path, _ in folder.samples]
        limit = max_image_pixels or max(16 * image_size ** 2, Image.MAX_IMAGE_PIXELS or 0)
        self._dataset = _FolderImages(folder.samples, self.seed, image_size, resize or image_size,
                                      channels, limit)

    def _order(self, epoch: int) -> Tensor | None:
        """Dataset index of each position of the epoch (None for synthetic: position i is sample i)."""
        if self._targets is None:
            return None
        return torch.randperm(self.num_samples, generator=_generator(self.seed, epoch))

    def _keys(self, epoch: int, order: Tensor | None, step: int) -> list[tuple[int, int]]:
        """The (epoch, sample) keys of this group's rows of global batch ``step``."""
        start = step * self.batch_size + self.group * self.shard
        rows = range(start, start + self.shard)
        return [(epoch, i) for i in rows] if order is None else [(epoch, int(order[i])) for i in rows]

    def _labels(self, keys: list[tuple[int, int]]) -> Tensor:
        if self._targets is not None:
            return self._targets[[i for _, i in keys]]
        return torch.tensor([self._dataset.label(_generator(self.seed, *k)) for k in keys], dtype=torch.int64)

    def _count_bad(self, keys: list[tuple[int, int]], errors: list[str]) -> None:
        for (_, index), error in zip(keys, errors):
            if not error:
                continue
            self.skipped += 1
            path = self._paths[index]
            if path not in self._warned:
                self._warned.add(path)
                warnings.warn(f"skipping image {path}: it {error}; its pixels are replaced by zeros and its "
                              "label kept", RuntimeWarning, stacklevel=3)

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[tuple[Tensor | None, Tensor | None]]:
        """This group's shard ``(images N x C x S x S float32 or None, labels N int64 or None)``,
        N = B / D, of global batches ``start_step .. steps_per_epoch - 1`` of ``epoch``."""
        if not isinstance(epoch, int) or epoch < 0 or not 0 <= start_step <= self.steps_per_epoch:
            raise GemsError(f"cannot start epoch {epoch!r} at step {start_step!r}: pass epoch >= 0 and "
                            f"0 <= start_step <= {self.steps_per_epoch}")
        self.epoch, self.step = (epoch + 1, 0) if start_step == self.steps_per_epoch else (epoch, start_step)
        order = self._order(epoch) if (self.need_images or self.need_labels) else None
        steps = range(start_step, self.steps_per_epoch)
        if self.need_images:
            loader = DataLoader(self._dataset, batch_sampler=[self._keys(epoch, order, k) for k in steps],
                                num_workers=self.workers, pin_memory=torch.cuda.is_available())
            for k, (images, labels, errors) in zip(steps, loader):
                keys = self._keys(epoch, order, k)
                if self._paths is not None:
                    self._count_bad(keys, errors)
                self._advance(k)
                yield images, (labels if self.need_labels else None)
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
