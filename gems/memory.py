"""Measured peak memory of this rank, to set beside the plan's estimate.

CUDA: ``torch.cuda.max_memory_allocated`` (tensors only, what the plan estimates).
CPU: the process's peak resident set size (``getrusage`` ``ru_maxrss``), which also counts
the Python interpreter, torch's libraries and allocator slack: an upper bound on tensors.
"""
from __future__ import annotations

import resource
import sys

import torch


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def current_bytes(device: torch.device) -> int:
    """Memory in use now: CUDA allocated, or this process's resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def kind(device: torch.device) -> str:
    """What ``peak_bytes`` measures, for reports."""
    return "max allocated (CUDA)" if device.type == "cuda" else "peak RSS (process)"
