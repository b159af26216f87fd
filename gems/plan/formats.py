"""The plan's memory formats (``Plan.memory_format``): how a stage lays out its 4-D tensors, by name
and by tensor.

``"contiguous"`` is NCHW; ``"channels_last"`` is NHWC, the layout cuDNN's tensor-core convolutions and
oneDNN's NHWC kernels read without a reorder. A format chosen for a stage holds for every
tensor of it, and each path that allocates a tensor or makes one contiguous keeps it:

- parameters: ``Module.to(memory_format=...)`` (``convert``) turns 4-D weights NHWC; the gradient
  bucket's views and the sharded optimizer's flat parameter buffer take each parameter's strides
  (``like``), so neither the gradients nor the parameters fall back to NCHW;
- activations follow their inputs through convolutions, pointwise ops and ``torch.cat``; the images
  enter NHWC (the engine's ``Tensor.to(memory_format=...)``);
- messages: a packed message's receive views carry the format's strides (``strides``), so the
  receiver's tensor has it with no permuting copy; spatial tiles and halos allocate and make
  contiguous in the format of the tensor they come from (``format_of``, ``empty_as``, ``dense``).
"""
from __future__ import annotations

import math

import torch

from gems.errors import GemsError
from gems.plan import MEMORY_FORMATS


def of_name(name: str) -> torch.memory_format:
    """The torch format of a plan's ``memory_format``."""
    return torch.channels_last if name == "channels_last" else torch.contiguous_format


def name_of(fmt: torch.memory_format | str | None) -> str:
    """A plan's name for ``fmt`` (a torch format or already a name; None: contiguous)."""
    if isinstance(fmt, str):
        if fmt not in MEMORY_FORMATS:
            raise GemsError(f"memory format {fmt!r} is not one of {', '.join(MEMORY_FORMATS)}")
        return fmt
    return "channels_last" if fmt is torch.channels_last else "contiguous"


def takes_format(module: torch.nn.Module) -> bool:
    """Whether a module has a 4-D parameter, the only kind ``channels_last`` changes."""
    return any(p.dim() == 4 for p in module.parameters())


def convert(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """``module`` with its 4-D parameters and buffers in format ``name`` (in place, as ``Module.to``)."""
    return module.to(memory_format=of_name(name)) if name == "channels_last" else module


def format_of(t: torch.Tensor) -> torch.memory_format:
    """The format ``t`` is laid out in: channels_last for a 4-D tensor whose channels are
    innermost (more than one of them), else contiguous."""
    if t.dim() == 4 and t.size(1) > 1 and t.stride(1) == 1 and t.stride(3) == t.size(1):
        return torch.channels_last
    return torch.contiguous_format


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` laid out densely in the format it has (``format_of``); no copy when it is."""
    return t.contiguous(memory_format=format_of(t))


def empty_as(t: torch.Tensor, shape, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` on ``t``'s device, in ``t``'s format (``new_empty`` always
    gives NCHW)."""
    fmt = format_of(t) if len(shape) == 4 else torch.contiguous_format
    return torch.empty(shape, dtype=t.dtype if dtype is None else dtype, device=t.device, memory_format=fmt)


def strides(shape, name: str) -> tuple[int, ...]:
    """The strides of a dense tensor of ``shape`` in format ``name`` (channels_last: 4-D shapes only)."""
    shape = tuple(shape)
    if name == "channels_last" and len(shape) == 4:
        n, c, h, w = shape
        return (h * w * c, 1, w * c, c)
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def like(flat: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A view of the 1-D ``flat`` (``t.numel()`` elements) shaped and strided as ``t``, which is laid out
    densely in some order (a parameter, NCHW or NHWC): the bucket's gradient views and the sharded
    parameters keep each parameter's format. A tensor not dense in any order gets NCHW strides."""
    if t.is_contiguous() or not _dense(t):
        return flat.view(t.shape)
    return flat.as_strided(t.shape, t.stride())


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive places in some order of its dimensions."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True
