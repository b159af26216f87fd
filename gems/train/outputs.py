"""Writing predictions: label masks (PNG), class probabilities (tiled TIFF), per-image classes (CSV).

Every file is written atomically: into a hidden temporary file beside the target
(``.NAME.<pid>.<random>.part``), flushed to disk, then renamed over the target with ``os.replace``,
so an interrupted run leaves either the old file or the complete new one, never half a file (and no
temporary file when Python unwinds normally; a killed process may leave one ``.part`` file).

Nothing is held whole when it need not be:

* ``write_mask_png_rows`` streams a mask band by band through our own small PNG encoder (zlib and
  crc32 of the standard library: grayscale, 8 or 16 bits, filter 0). PIL can only save an image it
  holds whole, so it is not used for writing; the PNG written is a plain one any reader opens.
* ``write_probabilities_tiff`` writes tiles band by band from a ``Stitcher`` (or an array) with
  tifffile: one page [H, W, C] with C samples per pixel (contiguous, so one pass over the bands),
  float16 by default (probabilities need no more), deflate-compressed, tiled 256 x 256.
"""
from __future__ import annotations

import contextlib
import csv
import os
import struct
import zlib
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
from torch import Tensor

from gems.errors import GemsError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
IDAT_BYTES = 1 << 20  # PNG data chunk size: large enough to be cheap, small enough to stream


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path to write; on success it replaces ``path`` (parents created), on any
    exception it is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.part")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # the rename must not reach the disk before the data
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def output_name(input_path: str | os.PathLike, root: str | os.PathLike | None, suffix: str) -> Path:
    """The output's path relative to the output folder: the input's path relative to ``root`` (just
    its name when ``root`` is None or does not contain it) with its extension replaced by ``suffix``:
    ``images/sub/a.tif`` under ``images`` with ``".png"`` -> ``sub/a.png``; ``a.ome.tif`` -> ``a.png``.
    Inputs differing only in extension (a.tif, a.png) map to the same name: the caller checks."""
    path = os.path.abspath(input_path)
    rel = os.path.relpath(path, os.path.abspath(root)) if root is not None else ""
    if not rel or rel == "." or rel.startswith(".." + os.sep) or rel == "..":
        rel = os.path.basename(path)
    stem, _ = os.path.splitext(rel)
    if stem.lower().endswith(".ome"):
        stem = stem[:-4]
    return Path(stem + suffix)


def _numpy(x: Tensor | np.ndarray) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, Tensor) else np.asarray(x)


def _mask_dtype(num_classes: int) -> np.dtype:
    if num_classes > 65536:
        raise GemsError(f"a PNG mask holds at most 65536 classes, the model has {num_classes}; "
                        "write probabilities (TIFF) instead.")
    return np.dtype(np.uint8 if num_classes <= 256 else ">u2")  # PNG stores 16-bit big-endian


def write_mask_png(path: str | os.PathLike, labels: Tensor | np.ndarray, *, num_classes: int | None = None) -> None:
    """Writes labels [H, W] (integers) as a grayscale PNG: 8-bit when there are at most 256 classes,
    else 16-bit. ``num_classes`` fixes the depth for every image of a run (default: from the
    largest label in this one)."""
    labels = _numpy(labels)
    height, width = labels.shape
    if num_classes is None:
        num_classes = int(labels.max()) + 1 if labels.size else 1
    write_mask_png_rows(path, height, width, (labels[y:y + 1024] for y in range(0, height, 1024)),
                        num_classes=num_classes)


def write_mask_png_rows(path: str | os.PathLike, height: int, width: int,
                        bands: Iterable[Tensor | np.ndarray], *, num_classes: int, level: int = 6) -> None:
    """Writes a ``height`` x ``width`` mask given as consecutive bands of rows [h, W], holding one
    band at a time, e.g. ``(p.argmax(0) for _, p in stitcher.rows())`` for a whole slide."""
    dtype = _mask_dtype(num_classes)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(PNG_SIGNATURE)
        # IHDR: width, height, bit depth, colour type 0 (grayscale), deflate, filter set 0, no interlace
        _chunk(f, b"IHDR", struct.pack(">IIBBBBB", width, height, 8 * dtype.itemsize, 0, 0, 0, 0))
        deflate, pending, rows = zlib.compressobj(level), [], 0
        for band in bands:
            band = _numpy(band).astype(dtype)
            rows += band.shape[0]
            raw = np.zeros((band.shape[0], 1 + band.shape[1] * dtype.itemsize), np.uint8)  # filter byte 0
            raw[:, 1:] = band.view(np.uint8).reshape(band.shape[0], -1)
            pending.append(deflate.compress(raw.tobytes()))
            if sum(map(len, pending)) >= IDAT_BYTES:
                _chunk(f, b"IDAT", b"".join(pending))
                pending = []
        if rows != height:
            raise ValueError(f"the bands hold {rows} rows, the mask {height}")
        _chunk(f, b"IDAT", b"".join(pending) + deflate.flush())
        _chunk(f, b"IEND", b"")


def _chunk(f, kind: bytes, data: bytes) -> None:
    f.write(struct.pack(">I", len(data)) + kind)
    f.write(data)
    f.write(struct.pack(">I", zlib.crc32(data, zlib.crc32(kind))))


def write_probabilities_tiff(path: str | os.PathLike, probs, *, dtype: str = "float16", tile: int = 256,
                             compression: str | None = "zlib") -> None:
    """Writes class probabilities as a tiled TIFF page [H, W, C] (read back with
    ``tifffile.imread(path).transpose(2, 0, 1)``; tifffile gives [H, W] for a single class).

    probs: an array or tensor [C, H, W], or a ``Stitcher`` (anything with ``rows(band)``, ``channels``,
        ``height``, ``width``), which is read one band of ``tile`` rows at a time.
    dtype: "float16" (half the size; 3 significant digits, plenty for probabilities) or "float32".
    compression: "zlib" (deflate, readable everywhere) or None.
    """
    import tifffile

    if dtype not in ("float16", "float32"):
        raise GemsError(f"probabilities are written as float16 or float32, not {dtype!r}.")
    if hasattr(probs, "rows"):
        channels, height, width, bands = probs.channels, probs.height, probs.width, probs.rows(tile)
    else:
        array = _numpy(probs)
        channels, height, width = array.shape
        bands = ((y, array[:, y:y + tile]) for y in range(0, height, tile))

    def tiles() -> Iterator[np.ndarray]:
        for _, band in bands:
            band = np.ascontiguousarray(_numpy(band).transpose(1, 2, 0), dtype)  # [h, W, C]
            band = band if channels > 1 else band[:, :, 0]  # one class: a plain [H, W] page
            for x in range(0, width, tile):
                yield band[:, x:x + tile]  # tifffile pads the last row and column of tiles

    with atomic_path(path) as tmp:
        contig = dict(shape=(height, width, channels), planarconfig="contig") if channels > 1 else dict(shape=(height, width))
        tifffile.imwrite(tmp, data=tiles(), dtype=dtype, tile=(tile, tile), photometric="minisblack",
                         compression=compression, **contig,
                         metadata=None)


def write_class_csv(path: str | os.PathLike, rows: Iterable[tuple[str, Sequence[float]]],
                    class_names: Sequence[str]) -> None:
    """Writes one line per image: ``image,predicted,<class names>...``, the predicted class being
    the most probable (the first on a tie), probabilities with 6 significant digits."""
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["image", "predicted", *class_names])
        for name, probs in rows:
            probs = [float(p) for p in (probs.tolist() if hasattr(probs, "tolist") else probs)]
            best = max(range(len(probs)), key=probs.__getitem__)
            out.writerow([name, class_names[best], *(f"{p:.6g}" for p in probs)])
