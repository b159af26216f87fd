"""Measure each unit's forward + backward time on a real device at the real size.

Optional input to ``plan(..., balance_by="time", unit_times=...)``; without it "time" is
estimated from FLOPs. Units run one at a time on one micro-batch, so the device needs
memory for one unit's activations only: earlier units produce the next input without
keeping a graph.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch
from torch import nn


def measure_times(model: nn.Sequential, input_shape: Sequence[int], micro_batch_size: int,
                  device: str | torch.device | None = None, dtype: torch.dtype = torch.float32,
                  repeats: int = 3) -> list[float]:
    """Seconds per unit for one micro-batch, forward plus backward (median of ``repeats``,
    after one warm-up). The model is not modified: each unit is copied to ``device``
    (default: CUDA if available, else CPU) while it is timed."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    x: torch.Tensor | tuple = torch.randn((micro_batch_size, *input_shape), device=device, dtype=dtype)
    times = []
    for unit in model:
        unit = copy.deepcopy(unit).to(device=device, dtype=dtype).train()
        samples = []
        for _ in range(repeats + 1):
            inputs = _leaves(x)
            _sync(device)
            start = time.perf_counter()
            out = unit(inputs)
            outs = [t for t in _tuple(out) if t.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            _sync(device)
            samples.append(time.perf_counter() - start)
        times.append(sorted(samples[1:])[len(samples[1:]) // 2])
        with torch.no_grad():   # the next unit's input, without a graph
            x = unit(x)
        del unit, out, outs
    return times


def _tuple(x) -> tuple:
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


def _leaves(x):
    """A fresh leaf copy of x (requiring grad when floating point), same structure."""
    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().requires_grad_(t.is_floating_point())
    return leaf(x) if isinstance(x, torch.Tensor) else tuple(leaf(t) for t in x)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
