"""Human-readable byte sizes: ``parse_size("40GiB")`` and ``format_size(42949672960)``.

Units, case-insensitive, with or without a space after the number:

    B                      bytes (also a bare number: "123")
    KiB MiB GiB TiB        binary: 1024, 1024**2, ...
    K   M   G   T          binary too, as in ``free -h``, Slurm ``--mem`` and ``java -Xmx``
    KB  MB  GB  TB         decimal (SI): 1000, 1000**2, ...

A GPU sold as "40GB" has 40 GiB of memory (NVIDIA counts in binary), so for GPU budgets
prefer the explicit binary form ``40GiB``; ``40GB`` is 7% smaller and is taken literally.
"""
from __future__ import annotations

import math
import re

from gems.errors import GemsError

_FACTORS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]\+?(\d+))?\s*([a-zA-Z]*)\s*$")
_VALID_FORMS = "a number of bytes with an optional unit, e.g. 123, 512MiB, 40GiB, 1.5G or 40GB"


def parse_size(text: str | int) -> int:
    """Bytes named by ``text`` ("40GiB", "40GB", "512MiB", "1.5G", "123"); an int passes through.

    Fractions of a byte round down. Raises GemsError for anything else (negative, unknown unit).
    """
    if isinstance(text, bool):
        raise GemsError(f"a size must be {_VALID_FORMS}; got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise GemsError(f"a size cannot be negative; got {text}")
        return text
    match = _SIZE.match(str(text))
    unit = match.group(3).lower() if match else None
    if match is None or unit not in _FACTORS:
        raise GemsError(f"cannot read size {text!r}: write {_VALID_FORMS}")
    try:
        value = float(match.group(1)) * 10.0 ** int(match.group(2) or 0) * _FACTORS[unit]
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise GemsError(f"size {text!r} is too large: write {_VALID_FORMS}")
    return int(value)


def format_size(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps the number >= 1: "512 B", "1.50 GiB"."""
    value = float(nbytes)
    if abs(value) < 1024:
        return f"{int(value)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")


def format_ms(seconds: float) -> str:
    """``seconds`` in milliseconds to four significant digits: "582 ms", "0.004949 ms"."""
    return f"{seconds * 1e3:.4g} ms"
