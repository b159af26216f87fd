"""Sliding windows: predicting an image of any size with a model that takes S x S inputs.

The image is covered by windows of side S (``size``) whose origins step by ``size - overlap``; the
last window in each direction is moved back to end flush with the image edge, so no window ever
reads past the image unless the image itself is smaller than S in that direction (then there is one
window at 0 and the caller pads the input; ``Stitcher.add`` crops the prediction back)::

    width 100, size 32, overlap 8  ->  lefts 0, 24, 48, 68   (stride 24; 68 = 100 - 32, flush)
    |--------------------------------|                       window 0
                            |--------------------------------|          window 1
                                                    ...  |--------------------------------|  window 3

Every window's prediction is weighted by ``blend_weights`` (a linear cross-fade over the overlap
margin, never zero) and the weighted sum is divided by the summed weights, so seams between windows
disappear and every covered pixel gets a proper average.

Determinism: ``Stitcher`` does float32 arithmetic with numpy in a fixed order, in RAM or in a memmap
alike, so the same windows added in the same order give bit-identical results in one process, in
``gems-predict`` on many ranks (which must add gathered windows in ``window_origins`` order), and
whether or not the accumulators spilled to disk. A different order of additions may change the last
bit of a pixel where windows overlap (float addition is not associative).
"""
from __future__ import annotations

import tempfile
from typing import Iterator

import numpy as np
import torch
from torch import Tensor

from gems.errors import GemsError

SPILL_BYTES = 2 << 30  # accumulators larger than 2 GiB go to a memmap: a whole slide needs no RAM


def _check(size: int, overlap: int) -> None:
    if size < 1:
        raise GemsError(f"the window size must be at least 1 pixel, got {size}; check the plan's image size.")
    if not 0 <= overlap < size:
        raise GemsError(f"--overlap must be at least 0 and less than the window size {size}, got {overlap}; "
                        f"e.g. --overlap {size // 8}.")


def _starts(length: int, size: int, stride: int) -> list[int]:
    if length <= size:
        return [0]  # one window, padded by the caller
    starts = list(range(0, length - size, stride))
    return starts + [length - size]  # the last one flush with the edge


def window_origins(height: int, width: int, size: int, overlap: int) -> list[tuple[int, int]]:
    """The (top, left) of every window of side ``size`` covering a ``height`` x ``width`` image, row
    by row (top outer, left inner); this order is the canonical order of ``Stitcher.add``."""
    _check(size, overlap)
    stride = size - overlap
    return [(top, left) for top in _starts(height, size, stride) for left in _starts(width, size, stride)]


def blend_weights(size: int, overlap: int) -> Tensor:
    """The weight [size, size] (float32) of each pixel of a window's prediction.

    Separable: w(y, x) = r(y) r(x) with r(i) = min(1, (min(i, size-1-i) + 1) / (overlap + 1)), a
    linear ramp over the ``overlap`` pixels at each side and 1 inside. Where two windows overlap by
    exactly ``overlap`` pixels their ramps sum to 1 (a linear cross-fade); the smallest weight is
    1 / (overlap + 1) > 0, so a pixel covered by a single window's margin (the image border) still
    gets that window's prediction after normalisation. overlap 0 gives all ones.
    """
    _check(size, overlap)
    return torch.from_numpy(_weights(size, overlap))


def _weights(size: int, overlap: int) -> np.ndarray:
    i = np.arange(size)
    ramp = np.minimum(1.0, (np.minimum(i, size - 1 - i) + 1) / (overlap + 1)).astype(np.float32)
    return np.outer(ramp, ramp)


def _array(shape: tuple[int, ...], spill: bool, folder: str | None) -> np.ndarray:
    if not spill:
        return np.zeros(shape, np.float32)
    # An anonymous temporary file (unlinked at once on POSIX): the mapping keeps it alive, and the
    # space comes back when the array is dropped, even if the process is killed.
    with tempfile.TemporaryFile(dir=folder, prefix="gems-stitch-") as f:
        return np.memmap(f, np.float32, "w+", shape=shape)  # zero-filled; the map outlives the file object


class Stitcher:
    """Blends window predictions into class probabilities for a whole ``height`` x ``width`` image.

    ``add(top, left, probs)`` for each window (probabilities [C, h, w] at input resolution, a torch
    tensor on any device or a numpy array), then ``result()`` for the blended [C, H, W] tensor, or
    ``rows(band)`` to take it band by band without materialising it (what the output writers do for
    a whole slide).

    The accumulators (C + 1 float32 planes of H x W) live in RAM up to ``spill_bytes`` and in a
    numpy memmap on a temporary file above it (in ``spill_dir``, default the system's temp folder);
    results are bit-identical either way. ``spill_bytes=0`` always spills.
    """

    def __init__(self, height: int, width: int, channels: int, size: int, overlap: int, *,
                 spill_bytes: int = SPILL_BYTES, spill_dir: str | None = None):
        _check(size, overlap)
        self.height, self.width, self.channels = height, width, channels
        self.size, self.overlap = size, overlap
        self.weights = _weights(size, overlap)
        self.spilled = 4 * (channels + 1) * height * width > spill_bytes
        self._sum = _array((channels, height, width), self.spilled, spill_dir)
        self._weight = _array((height, width), self.spilled, spill_dir)

    def add(self, top: int, left: int, probs: Tensor | np.ndarray) -> None:
        """Adds one window's prediction at (top, left); parts past the image edge are cropped."""
        if isinstance(probs, Tensor):
            probs = probs.detach().to("cpu", torch.float32).numpy()
        probs = np.asarray(probs, np.float32)
        h = min(probs.shape[-2], self.height - top)
        w = min(probs.shape[-1], self.width - left)
        weight = self.weights[:h, :w]
        self._sum[:, top:top + h, left:left + w] += probs[:, :h, :w] * weight
        self._weight[top:top + h, left:left + w] += weight

    def rows(self, band: int = 256) -> Iterator[tuple[int, Tensor]]:
        """(top, probabilities [C, h, W]) for consecutive bands of ``band`` rows (the last may be
        shorter); only one band is in RAM at a time."""
        for top in range(0, self.height, band):
            weight = self._weight[top:top + band]
            if not weight.all():
                y, x = np.argwhere(weight == 0)[0]
                raise RuntimeError(f"pixel ({top + y}, {x}) is covered by no window; "
                                   "add every window of window_origins before reading the result")
            yield top, torch.from_numpy(self._sum[:, top:top + band] / weight)

    def result(self) -> Tensor:
        """The blended probabilities [C, H, W] float32, whole in RAM (use ``rows`` for a whole slide)."""
        out = torch.empty(self.channels, self.height, self.width)
        for top, band in self.rows():
            out[:, top:top + band.shape[1]] = band
        return out

    def close(self) -> None:
        """Drops the accumulators (and with them a spilled temporary file); the object is then unusable."""
        self._sum = self._weight = None

    def __enter__(self) -> Stitcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
