"""Square views of training and evaluation images: one crop, flip and rotation for an image and its mask.

Segmentation (``Params``, ``view``)
    A sample's random choices are drawn first, all of them, from its own generator (seeded with
    (seed, epoch, index) by the caller), in a fixed order whatever is present: window corner, horizontal
    flip, vertical flip, quarter turns, brightness, contrast, saturation. So an image-only rank and a
    mask-only rank draw the same numbers and cut the same window, the global torch RNG is never read,
    and the result does not depend on which process (DataLoader worker) computes it.

    The window is S x S. An image larger than S is cropped; a side shorter than S is padded, the image
    with zeros (after normalisation: the dataset mean) and the mask with ``IGNORE``, so padding never
    counts in a loss or a metric::

        larger:  +---------------+        smaller:  +---------+ . . .
                 |   +-----+     |                  | content |     .   window S x S, content at a
                 |   | S^2 |     |                  +---------+     .   random offset (eval: centred),
                 |   +-----+     |                  .  IGNORE / 0   .   the rest padding
                 +---------------+                  . . . . . . . . .

    The geometric steps (flips, quarter turns) run through torchvision.transforms.v2 kernels on
    ``tv_tensors.Image`` / ``tv_tensors.Mask``, so the image and its mask move together; colour jitter
    (mild: factors within 1 +- ``JITTER``) touches the image only. Evaluation uses a centred window and
    nothing random.

Classification (``classify``)
    Today's behaviour: resize the shorter side to ``resize`` (antialiased), then an S x S crop, random
    with a horizontal flip for training, centred for evaluation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gems.train.images import normalise
from gems.train.targets import IGNORE

JITTER = 0.2   # brightness, contrast and saturation factors are drawn from [1 - JITTER, 1 + JITTER]


@dataclass(frozen=True)
class Params:
    """One sample's view: window corner (negative = padding before the content), flips, quarter turns
    (counter-clockwise) and colour factors (1.0 = unchanged)."""
    top: int
    left: int
    hflip: bool = False
    vflip: bool = False
    turns: int = 0
    brightness: float = 1.0
    contrast: float = 1.0
    saturation: float = 1.0


def _corner(u: float, length: int, size: int) -> int:
    """A uniformly drawn window start: inside the image when it is longer than the window, else the
    offset (<= 0) that places the content inside the window."""
    low, high = min(0, length - size), max(0, length - size)
    return low + int(u * (high - low + 1))


def draw(g: torch.Generator, height: int, width: int, size: int, augment: bool = True) -> Params:
    """A training view of an H x W sample: random window, and with ``augment`` flips, turns, jitter."""
    u = torch.rand(8, generator=g).tolist()   # always 8 draws: the sequence never depends on the inputs
    top, left = _corner(u[0], height, size), _corner(u[1], width, size)
    if not augment:
        return Params(top, left)
    factor = [1.0 + JITTER * (2.0 * v - 1.0) for v in u[5:8]]
    return Params(top, left, u[2] < 0.5, u[3] < 0.5, min(int(u[4] * 4), 3), *factor)


def centred(height: int, width: int, size: int) -> Params:
    """The evaluation view: the centred window (centre crop, or the content centred in padding)."""
    return Params((height - size) // 2, (width - size) // 2)


def _window(x: Tensor, p: Params, size: int, fill: float) -> Tensor:
    """The size x size window at (p.top, p.left) of x (... x H x W); outside x it holds ``fill``."""
    h, w = x.shape[-2:]
    rows = slice(max(p.top, 0), min(p.top + size, h))
    cols = slice(max(p.left, 0), min(p.left + size, w))
    content = x[..., rows, cols]
    if content.shape[-2:] == (size, size):
        return content
    out = torch.full((*x.shape[:-2], size, size), fill, dtype=x.dtype)
    r, c = max(-p.top, 0), max(-p.left, 0)
    out[..., r:r + content.shape[-2], c:c + content.shape[-1]] = content
    return out


def _geometry(x, p: Params):
    """Flips and quarter turns of an Image or a Mask, through the v2 kernels (which dispatch on it)."""
    from torchvision import tv_tensors  # noqa: PLC0415
    from torchvision.transforms.v2 import functional as F  # noqa: PLC0415

    if p.hflip:
        x = F.horizontal_flip(x)
    if p.vflip:
        x = F.vertical_flip(x)
    if p.turns:
        x = tv_tensors.wrap(torch.rot90(x.as_subclass(torch.Tensor), p.turns, (-2, -1)), like=x)
    return x


def _jitter(image, p: Params):
    from torchvision.transforms.v2 import functional as F  # noqa: PLC0415

    if p.brightness != 1.0:
        image = F.adjust_brightness(image, p.brightness)
    if p.contrast != 1.0:
        image = F.adjust_contrast(image, p.contrast)
    if p.saturation != 1.0 and image.shape[0] == 3:
        image = F.adjust_saturation(image, p.saturation)
    return image


def view(p: Params, size: int, image: Tensor | None = None,
         mask: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
    """The S x S view ``p`` of an image (float C x H x W in [0, 1] -> normalised) and/or its mask (int64
    H x W of labels or IGNORE); either may be None (a rank that needs only one of them)."""
    from torchvision import tv_tensors  # noqa: PLC0415

    if image is not None:   # jitter and normalise the content only, then pad it with zeros
        h, w = image.shape[-2:]
        content = image[:, max(p.top, 0):min(p.top + size, h), max(p.left, 0):min(p.left + size, w)]
        x = _jitter(tv_tensors.Image(content), p).as_subclass(torch.Tensor)
        if x.untyped_storage().data_ptr() == image.untyped_storage().data_ptr():
            x = x.clone()   # normalise works in place: never on the caller's pixels
        x = _window(normalise(x), Params(min(p.top, 0), min(p.left, 0)), size, 0.0)
        image = _geometry(tv_tensors.Image(x), p).as_subclass(torch.Tensor).contiguous()
    if mask is not None:
        m = _window(mask, p, size, IGNORE)
        mask = _geometry(tv_tensors.Mask(m), p).as_subclass(torch.Tensor).contiguous()
    return image, mask


def classify(image: Tensor, size: int, resize: int, g: torch.Generator | None,
             flip: bool = True) -> Tensor:
    """Classification view of float pixels in [0, 1]: shorter side -> ``resize``, then an S x S crop,
    random (with a horizontal flip when ``flip``) given a generator, centred without one; normalised."""
    from torchvision.transforms.v2 import functional as F  # noqa: PLC0415

    image = F.resize(image, [resize], antialias=True).clamp_(0.0, 1.0)
    h, w = image.shape[-2:]
    if g is None:
        top, left, mirror = (h - size) // 2, (w - size) // 2, False
    else:
        u = torch.rand(3, generator=g).tolist()
        top, left, mirror = int(u[0] * (h - size + 1)), int(u[1] * (w - size + 1)), flip and u[2] < 0.5
    image = image[:, top:top + size, left:left + size]
    if mirror:
        image = image.flip(-1)
    return normalise(image.contiguous())
