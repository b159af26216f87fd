"""Reading image and mask files: header sizes without decoding, pixels as float tensors, masks as labels.

Formats
    PNG, JPEG and the other formats PIL reads (through PIL; JPEG decodes at a reduced scale when a
    ``draft`` size allows; 16-bit colour PNG, which PIL reduces to 8 bits, through torchvision), and
    TIFF (8-, 16-bit and float, through tifffile when it is installed -- it reads large and BigTIFF files
    PIL cannot -- else through PIL). Unsigned integer pixels are scaled by the largest value of their
    type (1/255, 1/65535), float pixels are taken as they are. Grayscale is replicated to 3 channels when
    3 are wanted; colour is converted to luminance when 1 is wanted; an alpha channel is dropped.

Pixel limit
    ``decode`` reads the header first and raises ``TooLarge`` when it claims more than ``max_pixels``
    pixels, before any pixel is decoded (a decompression bomb costs a header read, not memory).

Normalisation
    Images are normalised with the ImageNet mean and standard deviation (their mean for 1 channel), so
    zero is the dataset mean. ``read_image`` is decode + normalise: prediction sees what training saw.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import torch
from torch import Tensor

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
GRAY_MEAN, GRAY_STD = (0.449,), (0.226,)
LUMA = (0.299, 0.587, 0.114)   # ITU-R 601, what PIL's "L" conversion uses

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".webp", ".ppm", ".pgm")
MASK_EXTENSIONS = (".png", ".tif", ".tiff")


class TooLarge(Exception):
    """The header of an image claims more pixels than allowed."""


class NotAMask(Exception):
    """A readable file that cannot be a label map (colour channels that differ): the user's mistake."""


def _is_tiff(path: str) -> bool:
    return path.lower().endswith((".tif", ".tiff"))


def _pil_open(path: str):
    """PIL image, header read only. PIL's own bomb check is off while opening: every caller checks
    the header's size against its own limit, and prediction reads images of any size."""
    from PIL import Image  # noqa: PLC0415

    limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
    try:
        return Image.open(path)
    finally:
        Image.MAX_IMAGE_PIXELS = limit


def header_size(path: str) -> tuple[int, int]:
    """(width, height) from the file's header, without decoding pixels."""
    if _is_tiff(path):
        try:
            import tifffile  # noqa: PLC0415

            with tifffile.TiffFile(path) as tif:
                page = tif.pages[0]
                return int(page.imagewidth), int(page.imagelength)
        except Exception:  # no tifffile, or a TIFF it does not understand: let PIL try
            pass
    with _pil_open(path) as img:
        return img.size


def _check_size(path: str, max_pixels: int | None) -> None:
    width, height = header_size(path)
    if max_pixels is not None and width * height > max_pixels:
        raise TooLarge(f"has {width}x{height} = {width * height} pixels, more than "
                       f"max_image_pixels={max_pixels}")


def _scaled(array: np.ndarray) -> Tensor:
    """Pixels as float32 in [0, 1] for unsigned integers (divided by the type's maximum)."""
    if array.dtype == np.bool_:
        return torch.from_numpy(array.astype(np.float32))
    if np.issubdtype(array.dtype, np.unsignedinteger):
        scale = float(np.iinfo(array.dtype).max)
        return torch.from_numpy(array.astype(np.float32)).div_(scale)
    if np.issubdtype(array.dtype, np.signedinteger):  # PIL's "I" mode holds 16-bit files as int32
        scale = 65535.0 if array.size == 0 or array.max() <= 65535 else float(np.iinfo(array.dtype).max)
        return torch.from_numpy(array.astype(np.float32)).div_(scale)
    return torch.from_numpy(np.asarray(array, dtype=np.float32))


def to_channels(x: Tensor, channels: int) -> Tensor:
    """C x H x W float pixels with exactly ``channels`` channels (1 or 3)."""
    if x.shape[0] in (2, 4):          # gray + alpha, RGB + alpha: drop alpha
        x = x[:x.shape[0] - 1]
    if x.shape[0] == channels:
        return x
    if channels == 3 and x.shape[0] == 1:
        return x.expand(3, -1, -1).contiguous()
    if channels == 1 and x.shape[0] == 3:
        luma = torch.tensor(LUMA, dtype=x.dtype).view(3, 1, 1)
        return (x * luma).sum(0, keepdim=True)
    raise ValueError(f"has {x.shape[0]} channels, not {channels}")


def _tiff_array(path: str) -> np.ndarray | None:
    """The first image of a TIFF as H x W or H x W x C (planar files are transposed), or None when
    tifffile is missing or cannot read it (e.g. a compression it needs imagecodecs for): PIL tries then."""
    try:
        import tifffile  # noqa: PLC0415

        with tifffile.TiffFile(path) as tif:
            series = tif.series[0]
            array, axes = series.asarray(), series.axes
    except Exception:
        return None
    while array.ndim > 3 or (array.ndim == 3 and axes[0] not in "SC" and axes[-1] not in "SC"):
        array, axes = array[0], axes[1:]  # a stack (pages, time, ...): its first image
    if array.ndim == 3 and axes[0] in "SC" and axes[-1] not in "SC":
        array = np.moveaxis(array, 0, -1)
    return array


def to_unit_float(array: np.ndarray) -> Tensor:
    """Pixels ``[h, w, C]`` or ``[h, w]`` as float32 ``[C, h, w]``, integers scaled to [0, 1]
    (``_scaled``); the caller normalises. Whole decoded images and regions of large ones alike."""
    x = _scaled(np.ascontiguousarray(array))
    return x.unsqueeze(0) if x.ndim == 2 else x.permute(2, 0, 1)


def _deep_colour_png(path: str) -> bool:
    """Whether a PNG holds 16-bit colour, which PIL reduces to 8 bits (16-bit gray it reads whole)."""
    with open(path, "rb") as f:
        head = f.read(26)
    return len(head) == 26 and head[12:16] == b"IHDR" and head[24] == 16 and head[25] in (2, 6)


def _png16(path: str) -> Tensor:
    """A 16-bit colour PNG through torchvision's libpng decoder (deprecated there, hence the filter)."""
    import torchvision.io as io  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        raw = io.decode_png(io.read_file(path), io.ImageReadMode.UNCHANGED)
    return raw.to(torch.float32).div_(65535.0 if raw.dtype == torch.uint16 else 255.0)


def decode(path: str, channels: int = 3, max_pixels: int | None = None, draft: int | None = None) -> Tensor:
    """The image at ``path`` as float32 C x H x W, values in [0, 1] for integer files.

    Raises ``TooLarge`` (from the header) when it has more than ``max_pixels`` pixels; any other
    exception means the file cannot be decoded. ``draft``: a JPEG much larger than this side may be
    decoded at a reduced scale (still at least ``draft`` pixels on its shorter side)."""
    _check_size(path, max_pixels)
    array = _tiff_array(path) if _is_tiff(path) else None
    if array is not None:
        return to_channels(to_unit_float(array), channels)
    if path.lower().endswith(".png") and _deep_colour_png(path):
        return to_channels(_png16(path), channels)
    with _pil_open(path) as img:
        if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
            return to_channels(to_unit_float(np.array(img)), channels)
        mode = "RGB" if channels == 3 else "L"
        if draft is not None:
            img.draft(mode, (draft, draft))
        return to_channels(to_unit_float(np.array(img.convert(mode))), channels)


def read_mask(path: str, max_pixels: int | None = None) -> Tensor:
    """The label map at ``path`` as int64 H x W: a single-channel PNG or TIFF (8 or 16 bit, or a palette
    PNG whose indices are the labels); a colour mask is accepted when its channels are equal."""
    _check_size(path, max_pixels)
    array = _tiff_array(path) if _is_tiff(path) else None
    if array is None:
        with _pil_open(path) as img:
            if img.mode in ("RGBA", "LA", "PA"):
                img = img.convert(img.mode[:-1] if img.mode != "PA" else "P")
            array = np.array(img)
    if array.ndim == 3:
        if not (array == array[..., :1]).all():
            raise NotAMask(f"has {array.shape[-1]} channels that differ: save each mask with one channel "
                           "whose pixel is the class index (or a palette PNG of class indices)")
        array = array[..., 0]
    if np.issubdtype(array.dtype, np.floating):
        array = np.rint(array)
    return torch.from_numpy(array.astype(np.int64))


def normalise(x: Tensor) -> Tensor:
    """ImageNet normalisation in place of float pixels in [0, 1] (1 channel: the mean of the three)."""
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if x.shape[0] == 3 else (GRAY_MEAN, GRAY_STD)
    return x.sub_(torch.tensor(mean).view(-1, 1, 1)).div_(torch.tensor(std).view(-1, 1, 1))


def read_image(path: str, channels: int = 3) -> Tensor:
    """The whole image at ``path`` as float32 C x H x W, normalised exactly like training images."""
    path = os.fspath(path)
    return normalise(decode(path, channels))
