"""One message, one flat buffer: the tensors of a message packed back to back in bytes.

Both ends know a message's layout in advance -- shapes and dtypes from the plan, rows from the
micro-batch -- so nothing but the data travels: any number of tensors, of any dtype (floating,
integer, bool), in one transfer (one ``isend``/``irecv``, split only where the transport caps a
transfer's size). The receiver's tensors are views into the buffer, so unpacking copies nothing;
packing copies each tensor once, converting it to the layout's dtype on the way (a stage run
under autocast still sends the plan's dtypes).

A layout has a memory format (the plan's, ``gems.plan.formats``): in ``channels_last`` a 4-D tensor's
bytes are laid out NHWC and its receive view has those strides, so a stage running NHWC sends and
receives without a permuting copy; the format is part of the digest.

The buffer opens with a 16-byte header: a digest of the message (its identity and layout) and
the byte count. Where the buffer is on the host (MPI's usual case) the receiver checks it, so two
ranks that disagree about a message -- different plans, a schedule bug -- fail with a sentence
naming the message instead of training on misread bytes. On a GPU, reading it would stall the
stream, and NCCL's fixed sizes catch most of the same disagreements, so it is not read there.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch

from gems.errors import GemsError
from gems.plan import formats

HEADER = 16      # bytes: digest, byte count (two int64)
ALIGN = 16       # every tensor starts at a multiple of this many bytes (dtype views need alignment)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Layout:
    """Where each tensor of a message sits in its flat buffer.

    Args:
        shapes: per tensor, its shape without the batch dimension.
        dtypes: per tensor, its dtype.
        rows: the batch dimension of every tensor (images per micro-batch).
        memory_format: how 4-D tensors lie in the buffer, "contiguous" (NCHW) or "channels_last" (NHWC).
    """

    def __init__(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], rows: int,
                 memory_format: str = "contiguous") -> None:
        self.shapes = [(rows, *shape) for shape in shapes]
        self.strides = [formats.strides(shape, memory_format) for shape in self.shapes]
        self.dtypes = list(dtypes)
        self.offsets, at = [], HEADER
        for shape, dtype in zip(self.shapes, self.dtypes):
            self.offsets.append(at)
            at = _aligned(at + math.prod(shape) * dtype.itemsize)
        self.nbytes = at
        self._text = ";".join(f"{tuple(s)}:{d}" for s, d in zip(self.shapes, self.dtypes)) + f";{memory_format}"

    def digest(self, what: str) -> int:
        """The header's digest of message ``what`` (its printed identity) with this layout."""
        return zlib.crc32(f"{what}|{self._text}".encode())

    def empty(self, device: torch.device) -> torch.Tensor:
        """A buffer to receive into."""
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def pack(self, tensors: Sequence[torch.Tensor], what: str, device: torch.device) -> torch.Tensor:
        """The tensors in one buffer (each converted to its layout dtype), headed for message ``what``."""
        if len(tensors) != len(self.shapes):
            raise GemsError(f"message {what} has {len(tensors)} tensors where its layout has {len(self.shapes)}: "
                            "the stage returned a different tuple than the plan was made for; make the plan again")
        flat = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        flat[:HEADER].view(torch.int64).copy_(torch.tensor([self.digest(what), self.nbytes], dtype=torch.int64))
        for view, t in zip(self._views(flat), tensors):
            if tuple(t.shape) != tuple(view.shape):
                raise GemsError(f"message {what} carries a tensor of shape {tuple(t.shape)} where the plan says "
                                f"{tuple(view.shape)}: make the plan at this image size and batch")
            view.copy_(t.detach())
        return flat

    def unpack(self, flat: torch.Tensor, what: str) -> tuple[torch.Tensor, ...]:
        """The tensors of a received buffer, as views of it; the header checked on the host."""
        if flat.device.type == "cpu":
            digest, nbytes = flat[:HEADER].view(torch.int64).tolist()
            if (digest, nbytes) != (self.digest(what), self.nbytes):
                raise GemsError(f"message {what} arrived with a header for another message or layout: the ranks "
                                "disagree about the plan or the schedule; give every rank the same plan")
        return tuple(self._views(flat))

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[at:at + math.prod(shape) * dtype.itemsize].view(dtype).as_strided(shape, strides)
                for at, shape, strides, dtype in zip(self.offsets, self.shapes, self.strides, self.dtypes)]
