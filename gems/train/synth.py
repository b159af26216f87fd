"""A synthetic but learnable dataset of coloured shapes on textured backgrounds (``gems-data synth``).

Every sample is drawn from its own generator, so a dataset is a pure function of (seed, split, index):

    shapes      kind = class: disc, square, triangle, diamond, ring, cross (in this order); each with a
                side of 1/8 to 1/3 of the image side, fully inside the image, and a colour from its
                kind's family (a saturated base colour, jittered a little per shape)
    background  a smooth low-frequency grey pattern (a coarse random grid, bilinearly upsampled), lightly
                tinted, far from every shape colour in saturation
    noise       Gaussian pixel noise (sigma 0.05) over everything

Segmentation: class 0 is the background, class c >= 1 the (c-1)-th kind; 1 to 3 shapes per image (later
ones on top); the mask pixel is the class index. Classification: one shape whose kind is the class;
written datasets cycle the classes (sample i has class i mod C), so they are balanced.

Colour alone almost separates the classes and the shapes are large, so a small U-Net at 512 x 512
reaches a validation mIoU above 0.9, and a small CNN 95% top-1, within a few hundred CPU steps. Drawing
is vectorised (torch): a 2048 x 2048 sample takes a fraction of a second, most of it the noise.

``TrainData("synthetic", task="segmentation")`` draws the same samples in memory, keyed by (seed,
epoch, index); a mask-only rank draws the shapes and renders the mask without generating pixels.
"""
from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from gems.errors import GemsError
from gems.train.seeds import generator

KINDS = ("disc", "square", "triangle", "diamond", "ring", "cross")
PALETTE = ((0.90, 0.15, 0.10), (0.10, 0.75, 0.20), (0.15, 0.30, 0.95),
           (0.95, 0.80, 0.10), (0.80, 0.15, 0.85), (0.10, 0.85, 0.85))
DEFAULT_CLASSES = {"segmentation": 3, "classification": 3}
MIN_SIZE, MAX_SIZE = 16, 16384
NOISE = 0.05


def class_names(task: str, classes: int) -> list[str]:
    """Names of the classes in index order: ``background`` then kinds (segmentation), or kinds."""
    return ["background", *KINDS[:classes - 1]] if task == "segmentation" else list(KINDS[:classes])


def check(task: str, size: int, classes: int) -> None:
    """GemsError unless the task, image size and class count can be drawn."""
    if task not in DEFAULT_CLASSES:
        raise GemsError(f"task {task!r} is not 'segmentation' or 'classification': pass one of them")
    if not MIN_SIZE <= size <= MAX_SIZE:
        raise GemsError(f"image size (--size) {size} is outside {MIN_SIZE}..{MAX_SIZE}: pass a size in that "
                        "range")
    low, high = 2, len(KINDS) + (task == "segmentation")
    if not low <= classes <= high:
        raise GemsError(f"{task} with synthetic shapes has {low} to {high} classes, not {classes}: pass a "
                        f"class count (--classes / num_classes) in that range")


@dataclass(frozen=True)
class Shape:
    cls: int        # class index (its kind is KINDS[cls - 1] for segmentation, KINDS[cls] for classification)
    kind: int
    cy: float
    cx: float
    r: float        # half the side


def shapes(g: torch.Generator, size: int, task: str, classes: int, label: int | None = None) -> list[Shape]:
    """The shapes of one sample: always drawn first, from the few first numbers of ``g``."""
    if task == "classification":
        count = 1
        label = int(torch.randint(classes, (1,), generator=g)) if label is None else label
    else:
        count = int(torch.randint(1, 4, (1,), generator=g))
    found = []
    for _ in range(count):
        u = torch.rand(4, generator=g).tolist()
        kind = label if task == "classification" else min(int(u[0] * (classes - 1)), classes - 2)
        r = size * (1 / 8 + u[1] * (1 / 3 - 1 / 8)) / 2
        cy, cx = r + u[2] * (size - 2 * r), r + u[3] * (size - 2 * r)
        found.append(Shape(kind if task == "classification" else kind + 1, kind, cy, cx, r))
    return found


def _inside(s: Shape, size: int) -> tuple[slice, slice, Tensor]:
    """The shape's bounding box and which of its pixels (centres) the shape covers."""
    y0, y1 = max(int(s.cy - s.r), 0), min(int(s.cy + s.r) + 1, size)
    x0, x1 = max(int(s.cx - s.r), 0), min(int(s.cx + s.r) + 1, size)
    y = (torch.arange(y0, y1, dtype=torch.float32) + 0.5 - s.cy)[:, None] / s.r   # -1..1 over the shape
    x = (torch.arange(x0, x1, dtype=torch.float32) + 0.5 - s.cx)[None, :] / s.r
    name = KINDS[s.kind]
    if name == "disc":
        inside = x * x + y * y <= 1
    elif name == "square":
        inside = (x.abs() <= 1) & (y.abs() <= 1)
    elif name == "triangle":   # apex up, base at the bottom
        inside = (y <= 1) & (x.abs() <= (y + 1) / 2)
    elif name == "diamond":
        inside = x.abs() + y.abs() <= 1
    elif name == "ring":
        d = x * x + y * y
        inside = (d <= 1) & (d >= 0.3)
    else:                      # cross
        inside = ((x.abs() <= 0.35) & (y.abs() <= 1)) | ((x.abs() <= 1) & (y.abs() <= 0.35))
    return slice(y0, y1), slice(x0, x1), inside


def mask(found: list[Shape], size: int) -> Tensor:
    """The int64 S x S label map of a segmentation sample (0 = background)."""
    out = torch.zeros(size, size, dtype=torch.int64)
    for s in found:
        rows, cols, inside = _inside(s, size)
        out[rows, cols][inside] = s.cls
    return out


def image(found: list[Shape], g: torch.Generator, size: int) -> Tensor:
    """The float32 3 x S x S pixels (in [0, 1]) of a sample whose shapes were drawn from ``g``."""
    coarse = 6
    grey = 0.25 + 0.5 * torch.rand(1, 1, coarse, coarse, generator=g)
    tint = (torch.rand(1, 3, 1, 1, generator=g) - 0.5) * 0.1
    out = torch.nn.functional.interpolate(grey + tint, size=(size, size), mode="bilinear",
                                          align_corners=False)[0]
    for s in found:
        colour = torch.tensor(PALETTE[s.kind]) + (torch.rand(3, generator=g) - 0.5) * 0.16
        rows, cols, inside = _inside(s, size)
        region = out[:, rows, cols]
        out[:, rows, cols] = torch.where(inside, colour.view(3, 1, 1), region)
    out += torch.randn(3, size, size, generator=g) * NOISE
    return out.clamp_(0.0, 1.0)


def sample(g: torch.Generator, size: int, task: str, classes: int,
           label: int | None = None) -> tuple[Tensor, Tensor | int]:
    """(pixels 3 x S x S in [0, 1], mask S x S int64 or class index) of one sample."""
    found = shapes(g, size, task, classes, label)
    target = mask(found, size) if task == "segmentation" else found[0].cls
    return image(found, g, size), target


# --- writing a dataset to disk -------------------------------------------------------------------------

def _write_one(job: tuple[str, str, str, int, int, int, int]) -> None:
    from PIL import Image  # noqa: PLC0415

    root, split, task, size, classes, seed, index = job
    name = f"{index:06d}.png"
    label = index % classes if task == "classification" else None
    pixels, target = sample(generator(seed, split, index), size, task, classes, label)
    rgb = pixels.mul(255).round_().to(torch.uint8).permute(1, 2, 0).numpy()
    if task == "segmentation":
        Image.fromarray(rgb).save(os.path.join(root, split, "images", name), compress_level=1)
        Image.fromarray(target.to(torch.uint8).numpy(), "L").save(os.path.join(root, split, "masks", name),
                                                                  compress_level=1)
    else:
        folder = f"{target}_{KINDS[target]}"   # index-prefixed: sorted class folders keep class order
        Image.fromarray(rgb).save(os.path.join(root, split, folder, name), compress_level=1)


def _prepare(root: str, split: str, task: str, classes: int) -> None:
    path = os.path.join(root, split)
    if os.path.isdir(path) and os.listdir(path):
        raise GemsError(f"{path} is not empty: pass a new or empty DIR (gems-data never overwrites data)")
    if os.path.exists(path) and not os.path.isdir(path):
        raise GemsError(f"{path} is a file: pass a DIR without one")
    subfolders = (["images", "masks"] if task == "segmentation"
                  else [f"{c}_{KINDS[c]}" for c in range(classes)])
    for sub in subfolders:
        os.makedirs(os.path.join(path, sub), exist_ok=True)


def write(root: str, task: str, size: int, count: int, val_count: int = 0, classes: int | None = None,
          seed: int = 0, workers: int = 0) -> str:
    """Write ``count`` training (and ``val_count`` validation) samples under root/train (root/val);
    return one line saying what was written. Refuses (GemsError) a non-empty root/train or root/val."""
    classes = DEFAULT_CLASSES.get(task, 0) if classes is None else classes
    check(task, size, classes)
    for flag, value, low in (("--count", count, 1), ("--val-count", val_count, 0), ("--workers", workers, 0)):
        if value < low:
            raise GemsError(f"{flag} {value} is below {low}: pass {flag} >= {low}")
    if os.path.exists(root) and not os.path.isdir(root):
        raise GemsError(f"{root} is a file, not a folder: pass a folder path as DIR")
    splits = [("train", count)] + ([("val", val_count)] if val_count else [])
    for split, _ in splits:
        _prepare(root, split, task, classes)
    jobs = [(root, split, task, size, classes, seed, i) for split, n in splits for i in range(n)]
    if workers:
        import multiprocessing  # noqa: PLC0415

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver")) as pool:
            for _ in pool.map(_write_one, jobs, chunksize=max(1, len(jobs) // (4 * workers))):
                pass
    else:
        for job in jobs:
            _write_one(job)
    layout = "images/ + masks/" if task == "segmentation" else "one folder per class"
    what = f"{count} training" + (f" and {val_count} validation" if val_count else "")
    return (f"wrote {what} {size}x{size} {task} samples ({layout}; classes: "
            f"{', '.join(class_names(task, classes))}) to {root}")
