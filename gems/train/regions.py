"""Reading a rectangle of an image without decoding the whole image.

    src = open_image("slide.tif")           # reads the header only
    src.height, src.width, src.channels, src.dtype
    x = src.read(top, left, h, w)           # numpy [h, w, C] in the file's dtype
    t = to_unit_float(x)                    # float32 tensor [C, h, w] in [0, 1]

TIFF (whole slides, satellite scenes), through tifffile, is read lazily from its first page (the
full-resolution level of a pyramid):

* tiled or stripped, any codec tifffile can decode: only the tiles (or strips) that overlap the
  rectangle are read from the file and decoded (``page.decode`` on the bytes at ``dataoffsets``).
  Decoded tiles are kept in a small LRU cache (``cache_bytes``, default 256 MiB), because
  overlapping sliding windows read most tiles more than once; ``decoded`` counts decodes.
* uncompressed contiguous data: a read-only numpy memmap, no decoding at all.

A TIFF stored as one compressed strip can only be decoded whole (it then sits in the cache if it
fits); convert such a file to a tiled TIFF (e.g. ``vips tiffsave in.tif out.tif --tile``).
Palette TIFFs yield their indices, not colours. Without the ``imagecodecs`` package tifffile
decodes only uncompressed, deflate (zlib) and LZMA data; other codecs fail with a GemsError.

PNG, JPEG and everything else PIL opens are decoded whole on open (those formats have no random
access), then sliced; palette, bilevel and CMYK images become RGB(A) or L; 16-bit grayscale stays
uint16. Files with more pixels than ``max_pixels`` (default PIL's decompression-bomb limit, about
89 million) are refused from the header: convert them to a tiled TIFF.

Sources are not thread-safe: open one per thread or DataLoader worker.
"""
from __future__ import annotations

import math
import os
import warnings
from collections import OrderedDict

import numpy as np

from gems.errors import GemsError
from gems.train.images import to_unit_float  # noqa: F401 - regions' pixels, scaled as decoded images'

CACHE_BYTES = 256 << 20  # one band of 2048-pixel windows across a 40000-pixel RGB slide, with room to spare
TIFF_MAGIC = (b"II*\0", b"MM\0*", b"II+\0", b"MM\0+")  # classic and BigTIFF, either byte order


def open_image(path: str | os.PathLike, *, max_pixels: int | None = None,
               cache_bytes: int = CACHE_BYTES) -> TiffImage | ArrayImage:
    """A region source for the image at ``path``: TIFF read lazily, other formats through PIL."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GemsError(f"{path} is not a file; check the input path.")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic in TIFF_MAGIC:  # by content, not by name: .svs, .btf and misnamed files too
        return TiffImage(path, cache_bytes=cache_bytes)
    return ArrayImage.from_pil(path, max_pixels)


class ArrayImage:
    """A region source over an array [H, W, C] in memory (PNG, JPEG, ...: decoded whole)."""

    def __init__(self, array: np.ndarray):
        self.array = array if array.ndim == 3 else array[:, :, None]
        self.height, self.width, self.channels = self.array.shape
        self.dtype = self.array.dtype

    @classmethod
    def from_pil(cls, path: str, max_pixels: int | None) -> ArrayImage:
        from PIL import Image

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                if max_pixels is not None and (Image.MAX_IMAGE_PIXELS or 0) < max_pixels:
                    Image.MAX_IMAGE_PIXELS = max_pixels  # ours is the check that rejects, as in data.py
                img = Image.open(path)  # the header only
            with img:
                w, h = img.size
                limit = max_pixels or Image.MAX_IMAGE_PIXELS
                if limit and w * h > limit:
                    raise GemsError(f"{path} has {w}x{h} pixels, too many to decode whole from {img.format}; "
                                    "convert it to a tiled TIFF, which is read window by window.")
                return cls(_pil_array(img))
        except GemsError:
            raise
        except Exception as e:  # any PIL failure is the file's fault
            raise GemsError(f"{path} cannot be read as an image ({type(e).__name__}: {e}); "
                            "check that it is a PNG, JPEG or TIFF file.") from None

    def read(self, top: int, left: int, h: int, w: int) -> np.ndarray:
        return np.array(self.array[top:top + h, left:left + w])

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pil_array(img) -> np.ndarray:
    mode = img.mode
    if mode in ("1", "P", "PA", "CMYK", "YCbCr", "LAB", "HSV", "La", "RGBa", "RGBX"):
        has_alpha = mode in ("PA", "La", "RGBa") or "transparency" in img.info
        img = img.convert("L" if mode == "1" else "RGBA" if has_alpha else "RGB")
    array = np.asarray(img)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("="))
    if mode == "I" and array.size and 0 <= array.min() and array.max() <= 65535:
        array = array.astype(np.uint16)  # a 16-bit PNG opened by an older PIL
    return array


class TiffImage:
    """A region source over the first page of a TIFF: decodes only the tiles a read touches."""

    def __init__(self, path: str, *, cache_bytes: int = CACHE_BYTES):
        import tifffile

        self.path, self.cache_bytes = path, cache_bytes
        self.tif = None
        try:
            self.tif = tifffile.TiffFile(path)
            page = self.tif.pages.first
            dtype = page.dtype
        except Exception as e:
            if self.tif is not None:
                self.tif.close()
            raise GemsError(f"{path} cannot be read as a TIFF ({type(e).__name__}: {e}); "
                            "check the file, or convert it with another tool.") from None
        if dtype is None or page.imagedepth > 1 or page.is_subsampled:
            self.tif.close()
            raise GemsError(f"{path} is a TIFF whose pixel layout gems does not read (volumetric, "
                            "subsampled or unusual bit depth); convert it to an 8- or 16-bit RGB or grayscale TIFF.")
        self.page = page
        self.height, self.width = page.imagelength, page.imagewidth
        self.channels = page.samplesperpixel
        self.dtype = np.dtype(dtype)
        self.planes = self.channels if page.planarconfig == 2 else 1  # separate planes
        if page.is_tiled:
            self.chunk = (page.tilelength, page.tilewidth)
        else:
            self.chunk = (min(page.rowsperstrip or self.height, self.height), self.width)
        self.across = math.ceil(self.width / self.chunk[1])
        self.down = math.ceil(self.height / self.chunk[0])
        self.decoded = 0  # tiles or strips decoded so far (cache hits not counted)
        self._cache: OrderedDict[int, np.ndarray | None] = OrderedDict()
        self._cached_bytes = 0
        self._map = self._memmap() if page.is_memmappable and page.compression == 1 else None

    def _memmap(self) -> np.ndarray:
        # shaped: (separate planes, depth, length, width, contiguous samples)
        dtype = np.dtype(self.tif.byteorder + self.dtype.char)
        return np.memmap(self.path, dtype, "r", offset=self.page.dataoffsets[0], shape=self.page.shaped)

    def read(self, top: int, left: int, h: int, w: int) -> np.ndarray:
        """Pixels [top, top+h) x [left, left+w) as [h, w, C] in the file's dtype (a fresh array)."""
        if self._map is not None:
            block = self._map[:, 0, top:top + h, left:left + w, :]  # [P, h, w, S]
            out = np.moveaxis(block, 0, 2).astype(self.dtype.newbyteorder("="))
            return out.reshape(h, w, self.channels)
        out = np.zeros((h, w, self.planes, self.channels // self.planes), self.dtype.newbyteorder("="))
        (th, tw), bottom, right = self.chunk, top + h, left + w
        for plane in range(self.planes):
            for row in range(top // th, (bottom - 1) // th + 1):
                for col in range(left // tw, (right - 1) // tw + 1):
                    tile = self._tile(plane * self.down * self.across + row * self.across + col)
                    if tile is None:  # an empty segment: no data, zeros
                        continue
                    y, x = row * th, col * tw
                    y0, y1 = max(top, y), min(bottom, y + tile.shape[1])
                    x0, x1 = max(left, x), min(right, x + tile.shape[2])
                    out[y0 - top:y1 - top, x0 - left:x1 - left, plane] = tile[0, y0 - y:y1 - y, x0 - x:x1 - x]
        return out.reshape(h, w, self.channels)

    def _tile(self, index: int) -> np.ndarray | None:
        if index in self._cache:
            self._cache.move_to_end(index)
            return self._cache[index]
        page = self.page
        offset, count = page.dataoffsets[index], page.databytecounts[index]
        data = None
        if offset and count:
            fh = self.tif.filehandle
            fh.seek(offset)
            data = fh.read(count)
        try:
            tile = page.decode(data, index, jpegtables=page.jpegtables, jpegheader=page.jpegheader)[0]
        except Exception as e:
            raise GemsError(f"{self.path}: tile {index} cannot be decoded ({type(e).__name__}: {e}); "
                            "the file is damaged or needs the imagecodecs package (pip install imagecodecs).") from None
        self.decoded += 1
        size = 0 if tile is None else tile.nbytes
        self._cache[index] = tile
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= 0 if old is None else old.nbytes
        return tile

    def close(self) -> None:
        self._map = None
        self._cache.clear()
        self.tif.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
