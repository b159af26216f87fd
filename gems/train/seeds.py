"""Seeds mixed from integers, so every random choice of the data layer has its own generator.

A sample's choices come from ``generator(seed, epoch, index)``: the same on every rank, in every
DataLoader worker and every Python run, and independent of every other sample's. Nothing in the
data layer reads or advances the global torch RNG.
"""
from __future__ import annotations

import hashlib

import torch


def mix(*parts: int | str) -> int:
    """A 63-bit seed mixed from the parts: well spread, identical on every rank and Python run."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(*parts: int | str) -> torch.Generator:
    """A CPU generator seeded with ``mix(*parts)``."""
    return torch.Generator().manual_seed(mix(*parts))
