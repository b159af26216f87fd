"""Measure this device instead of assuming a V100 on PCIe 3 (``gems-plan --calibrate``).

Without measurements the planner prices FLOPs at a V100's fp32 peak times an efficiency
(``gems.schedule.simulate.V100_FLOPS`` x ``EFFICIENCY``) and offloading at PCIe 3 x16
(``options.HOST_BANDWIDTH``). ``calibrate`` measures both here:

* sustained FLOP/s: a 3x3 convolution (what CNN FLOPs are; on CUDA cuDNN runs it as the model
  would, TF32 included where torch allows it), its batch doubled until one run, after
  ``WARMUP`` unmeasured ones, lasts ``MIN_RUN_SECONDS``; then the median of ``REPEATS`` runs,
  each bracketed by device synchronisation;
* host-link bandwidth (CUDA only): ``HOST_COPY_BYTES`` copied from pinned host memory to the
  device and back, the median of each direction, the slower one kept (offload copies both
  ways). A CPU device has no host link: its memory is host memory.
* host optimizer throughput (either device: the host updates of ``--state-placement host-optimizer``
  and ``host`` run on this CPU): torch's fused CPU SGD (with and without momentum), Adam and AdamW
  on one tensor of ``UPDATE_ELEMENTS`` float32 parameters, the median of ``REPEATS`` steps after
  ``WARMUP``, as seconds per byte of gradients (``gems.partition.placement.HOST_UPDATE``'s unit), at
  this process's thread count.

A large convolution is an upper bound on what a whole network sustains (batch norm, ReLU and
small layers reach less), so the plan uses the rate at efficiency 1 unless told otherwise.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gems.errors import GemsError
from gems.units import format_size

CHANNELS, SIDE = 128, 56          # a ResNet stage-2 convolution: 1.85 GFLOP per image
MIN_RUN_SECONDS = 0.01            # long enough for a timer, short enough for a CPU (< 3 s in all)
MAX_BATCH = 256
WARMUP, REPEATS = 2, 5
HOST_COPY_BYTES = 256 * 2**20
UPDATE_ELEMENTS = 4 * 2**20       # 16 MiB of float32: long enough to time, a few ms per step on one thread


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` measured on one device."""

    device: str                        # "cuda" or "cpu"
    name: str                          # e.g. "NVIDIA H100 80GB HBM3", or the CPU's thread count
    dtype: str
    flops_per_second: float            # sustained, one 3x3 convolution forward
    host_bandwidth: float | None       # bytes/s each way over the host link; None: no host link (CPU)
    host_update: dict[str, float] = field(default_factory=dict)   # per optimizer, a host update's s/byte

    def line(self) -> str:
        """One line for people: the figures and how they were measured."""
        link = (f"host link {self.host_bandwidth / 1e9:.1f} GB/s (pinned {format_size(HOST_COPY_BYTES)} copies, "
                "slower direction)" if self.host_bandwidth is not None
                else "no host link (the device's memory is host memory)")
        update = ", ".join(f"{name} {rate * 1e9:.3f}" for name, rate in self.host_update.items())
        return (f"calibrated {self.name}: {self.flops_per_second / 1e12:.3f} TFLOP/s sustained ({self.dtype} 3x3 "
                f"convolution, median of {REPEATS}), {link}"
                + (f"; host updates in ns per byte of gradients ({torch.get_num_threads()} CPU threads): {update}"
                   if update else ""))


def calibrate(device: str = "cuda", dtype: torch.dtype = torch.float32) -> Calibration:
    """Measure ``device`` ("cuda": this process's current GPU; "cpu") at ``dtype`` (module docstring)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise GemsError("--calibrate measures the device the plan is for, and no CUDA device is visible here: "
                        "run it on the GPU machine, or pass --device cpu to plan for this CPU")
    if device not in ("cuda", "cpu"):
        raise GemsError(f"the device to calibrate must be 'cuda' or 'cpu', got {device!r}")
    where = torch.device(device)
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    bandwidth = _host_bandwidth(where) if device == "cuda" else None
    return Calibration(device, name, str(dtype).removeprefix("torch."), _conv_rate(where, dtype), bandwidth,
                       host_update_rates())


def host_update_rates(elements: int = UPDATE_ELEMENTS) -> dict[str, float]:
    """Seconds per byte of float32 gradients of one step of each of torch's CPU optimizers the planner
    prices (``gems.partition.profile.OPTIMIZER_STATE``), fused where torch has the kernel."""
    makers = {"sgd": lambda p, f: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=f),
              "sgd-nomomentum": lambda p, f: torch.optim.SGD(p, lr=0.1, fused=f),
              "adam": lambda p, f: torch.optim.Adam(p, lr=0.1, fused=f),
              "adamw": lambda p, f: torch.optim.AdamW(p, lr=0.1, fused=f)}
    rates = {}
    for name, make in makers.items():
        params = [torch.nn.Parameter(torch.zeros(elements))]
        params[0].grad = torch.full((elements,), 1e-3)
        try:
            optimizer = make(params, True)
        except (RuntimeError, ValueError):   # an older torch without the fused CPU kernel
            optimizer = make(params, None)
        rates[name] = _median(optimizer.step, torch.device("cpu")) / (4 * elements)
    return rates


def _conv_rate(device: torch.device, dtype: torch.dtype) -> float:
    weight = torch.randn(CHANNELS, CHANNELS, 3, 3, device=device, dtype=dtype)
    batch = 1
    with torch.no_grad():
        while True:
            x = torch.randn(batch, CHANNELS, SIDE, SIDE, device=device, dtype=dtype)
            seconds = _median(lambda: F.conv2d(x, weight, padding=1), device, repeats=1)   # warms up too
            if seconds >= MIN_RUN_SECONDS or batch >= MAX_BATCH:
                break
            batch *= 2
        seconds = _median(lambda: F.conv2d(x, weight, padding=1), device, warmup=0)
    return 2 * CHANNELS * CHANNELS * 9 * SIDE * SIDE * batch / seconds


def _host_bandwidth(device: torch.device) -> float:
    host = torch.empty(HOST_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(HOST_COPY_BYTES, dtype=torch.uint8, device=device)
    to_device = _median(lambda: on_device.copy_(host, non_blocking=True), device)
    to_host = _median(lambda: host.copy_(on_device, non_blocking=True), device)
    return HOST_COPY_BYTES / max(to_device, to_host)


def _median(run: Callable[[], object], device: torch.device, repeats: int = REPEATS, warmup: int = WARMUP) -> float:
    """Median seconds of ``run`` after ``warmup`` unmeasured calls (allocator, kernel selection),
    synchronising the device around each (CUDA work is asynchronous)."""
    samples = []
    for i in range(warmup + repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        if i >= warmup:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
