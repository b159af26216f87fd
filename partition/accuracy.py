"""How close the fake-tensor profile is to a real run on the CPU.  ``python -m gems.partition.accuracy``

For each model, at a small image size, the profile's estimates are compared with real
forward/backward passes of whole models and of stages at random cut points:

* parameter bytes: the real tensors' sizes;
* activation bytes of a stage: the same saved_tensors_hooks on real tensors (storages by
  data pointer, each once, parameters excluded) plus the stage's input and output;
* peak bytes of a stage's forward + backward on top of its parameters and gradients (both
  allocated before, as from the second micro-batch of a step on): the high-water mark of the
  CPU allocator over the pass, by ``gems.obs.memory.PeakMeter``. The estimate is the stage's
  activations plus its working memory (``ModelProfile.working_matrix``).

Activations and parameters come out exact. The peak is within a few percent on whole
models at batch 2 and more. At batch 1 on small feature maps (under 20480 input elements,
3x3 kernels) PyTorch convolves on the CPU by im2col ("Slow2d", see
``torch._C._select_conv_backend``) instead of oneDNN: its column buffer, 9x the input,
exceeds the profile's allowance for kernel scratch memory (one copy of the largest operand),
up to 40% of a sub-MiB stage; where that operand is a large weight (deep ResNet layers),
im2col reorders no weight and the allowance is a weight copy too high.

    GEMS_ACCURACY_SIZE=160 python -m gems.partition.accuracy     # other image size (default 64)
    GEMS_ACCURACY_FORMAT=channels_last python -m gems.partition.accuracy   # NHWC (default contiguous)
    GEMS_ACCURACY_AMP=bf16 python -m gems.partition.accuracy   # forwards under bf16 autocast
"""
from __future__ import annotations

import functools
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gems.obs.memory import PeakMeter
from gems.plan import formats

from .profile import profile
from .records import ModelProfile


class _Fork(nn.Module):
    """A tuple-passing unit: returns (x, conv(x)), like an AmoebaNet cell's (prev, cur)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.conv(x)


class _Join(nn.Module):
    """Takes the pair, returns one tensor: BN-ReLU(in place) of the sum with a 1x1 conv."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(channels)
        self.conv = nn.Conv2d(channels, channels, 1)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        prev, cur = x
        return self.conv(torch.relu_(self.bn(prev + cur)))


def toy_model(num_classes: int = 10) -> nn.Sequential:
    """A small model of every unit kind the profiler must handle: plain layers, BatchNorm,
    ReLU, pooling, tuple-passing units, a head."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        _Fork(16), _Join(16), nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes))


@dataclass
class Comparison:
    """Estimated and real bytes for one stage [lo, hi) of one model."""

    model: str
    lo: int
    hi: int
    params: tuple[int, int]
    activations: tuple[int, int]
    peak: tuple[int, int]


def compare(model: nn.Sequential, input_shape: Sequence[int], batch: int, cuts: Sequence[tuple[int, int]],
            name: str = "model", prof: ModelProfile | None = None,
            memory_format: str = "contiguous", autocast: torch.dtype | None = None) -> list[Comparison]:
    """Estimated vs real bytes for each stage (lo, hi) of ``model`` (see module docstring), its
    tensors in ``memory_format`` (the real run's and the profile's), forwards under ``autocast``."""
    prof = prof or profile(model, input_shape, batch, memory_format=memory_format, autocast=autocast)
    formats.convert(model.train(), memory_format)
    torch.manual_seed(0)
    x = torch.randn(batch, *input_shape).contiguous(memory_format=formats.of_name(memory_format))
    inputs = [x]
    cast = functools.partial(torch.autocast, "cpu", dtype=autocast, enabled=autocast is not None)
    with torch.no_grad(), cast():   # real inputs of every unit, without keeping graphs
        for unit in model:
            inputs.append(unit(inputs[-1]))
    units = list(model)
    out = []
    for lo, hi in cuts:
        params = sum(p.numel() * p.element_size() for u in units[lo:hi] for p in u.parameters())
        est_params = sum(u.param_bytes for u in prof.units[lo:hi])
        est_act = prof.activation_bytes(lo, hi)
        est_peak = est_act + int(prof.working_matrix()[lo, hi])
        with cast():
            real = _real_activations(units, inputs[lo], lo, hi), _real_peak(units, inputs[lo], lo, hi, cast)
        out.append(Comparison(name, lo, hi, (est_params, params), (est_act, real[0]), (est_peak, real[1])))
    return out


def _leaf(x, needs_grad: bool):
    def one(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().requires_grad_(needs_grad and t.is_floating_point())
    return one(x) if isinstance(x, torch.Tensor) else tuple(one(t) for t in x)


def _tensors(x) -> tuple[torch.Tensor, ...]:
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


def _run(units: list[nn.Module], x, lo: int, hi: int):
    for unit in units[lo:hi]:
        x = unit(x)
    return x


def _real_activations(units: list[nn.Module], x, lo: int, hi: int) -> int:
    """Bytes a real stage keeps for backward: saved storages (by data pointer) + input + output."""
    static = {t.untyped_storage().data_ptr() for u in units for t in (*u.parameters(), *u.buffers())}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in static:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    leaf = _leaf(x, lo > 0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = _run(units, leaf, lo, hi)
    for t in (*_tensors(leaf), *_tensors(y)):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(kept.values())


def _real_peak(units: list[nn.Module], x, lo: int, hi: int, cast) -> int:
    """Peak bytes the CPU allocator holds during a real forward + backward of the stage (from
    the input's copy to the last gradient), above its parameters and gradients."""
    for unit in units[lo:hi]:   # steady state: gradients exist and accumulate (2nd micro-batch on)
        for p in unit.parameters():
            p.grad = torch.zeros_like(p)
    with PeakMeter("cpu") as meter:
        leaf = _leaf(x, lo > 0)
        with cast():
            outs = [t for t in _tensors(_run(units, leaf, lo, hi)) if t.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        del leaf, outs
    for unit in units[lo:hi]:
        unit.zero_grad(set_to_none=True)
    return meter.peak


def random_cuts(n: int, count: int, seed: int = 0) -> list[tuple[int, int]]:
    """The whole model plus ``count`` random stages (lo, hi)."""
    rng = random.Random(seed)
    cuts = [(0, n)]
    while len(cuts) < count + 1:
        lo, hi = sorted(rng.sample(range(n + 1), 2))
        if (lo, hi) not in cuts:
            cuts.append((lo, hi))
    return cuts


def _ratio(pair: tuple[int, int]) -> str:
    est, real = pair
    return "n/a" if not real else f"{est / real:.3f}"


def main() -> None:
    from gems.models import build

    size, batch = int(os.environ.get("GEMS_ACCURACY_SIZE", 64)), 2
    memory_format = os.environ.get("GEMS_ACCURACY_FORMAT", "contiguous")
    autocast = torch.bfloat16 if os.environ.get("GEMS_ACCURACY_AMP") == "bf16" else None
    models = [("toy", toy_model()), ("resnet18", build("resnet18", num_classes=10)),
              ("preact-resnet29", build("preact-resnet", depth=29, num_classes=10)),
              ("amoebanet-d(3,16)", build("amoebanet-d", num_classes=10, num_layers=3, num_filters=16))]
    precision = "bf16 autocast" if autocast else "float32"
    print(f"estimate / real at {batch}x3x{size}x{size}, {precision}, {memory_format}, CPU (ratio 1.000 = exact)")
    print(f"{'model':20s} {'stage':>9s} {'params':>7s} {'activations (est, real MiB)':>30s} "
          f"{'peak over params+grads (est, real MiB)':>41s}")
    for name, model in models:
        for c in compare(model, (3, size, size), batch, random_cuts(len(model), 3), name, None, memory_format,
                         autocast):
            act, peak = c.activations, c.peak
            print(f"{name:20s} {f'[{c.lo},{c.hi})':>9s} {_ratio(c.params):>7s} "
                  f"{_ratio(act):>7s} ({act[0] / 2**20:7.2f}, {act[1] / 2**20:7.2f}) "
                  f"{_ratio(peak):>20s} ({peak[0] / 2**20:7.2f}, {peak[1] / 2**20:7.2f})")


if __name__ == "__main__":
    main()
