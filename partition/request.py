"""What ``plan()`` checks of its request before planning: positive counts, the input shape per
sample, the dtype; one sentence naming the fix for anything else."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gems.errors import GemsError


def positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise GemsError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def input_shape_of(shape: Sequence[int]) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if not dims or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in dims):
        raise GemsError(f"the input shape must be positive sizes per sample such as (3, 2048, 2048), got {shape!r}")
    return tuple(int(d) for d in dims)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def dtype_of(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise GemsError(f"unsupported dtype {dtype!r}: choose one of {', '.join(_DTYPES)}")
