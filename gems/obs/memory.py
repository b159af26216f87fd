"""Measured memory of this rank, to set beside the plan's estimate.

The plan estimates tensor memory: parameters, gradients, optimizer state, buffers, the
activations kept for backward and the working memory of one forward or backward. A
``PeakMeter`` measures the same thing over a window of code (gems-train: its last step;
gems-bench: one more step after the timed ones, per schedule):

CUDA  ``torch.cuda.max_memory_allocated``, its peak reset at the window's start: every
      tensor on the device.
CPU   the tensors held at the window's start, named by the caller (``engine_tensors``;
      each storage once), plus the high-water mark of what PyTorch's CPU allocator
      allocated minus what it freed during the window. With memory profiling on, the
      allocator reports every allocation and free to the PyTorch profiler; the meter runs
      its legacy CPU recorder (unlike Kineto's it prints nothing) and adds up only those
      reports. It matches the allocator replay of ``torch.profiler``'s MemoryProfile to
      the byte. Cost while on: the profiler's per-op hook, ~5 us an op -- 0-10% of a
      resnet18 step at 128 px, ~15-30% for models of tiny ops -- so it meters one step,
      not every step; reading the records takes ~2 us each (5-40 ms per step).

Not seen on CPU: memory outside PyTorch's allocator (the interpreter, libraries, MPI's
buffers, tensors in shared memory such as batches from DataLoader workers); the frees of
blocks allocated before the window (the allocator does not know their size: PyTorch logs
one warning, "Memory block of unknown size...", the first time), so a named tensor freed
in the window still counts; and the frees of blocks a previous window allocated and left
alive are counted as frees in this one, so windows should end with what they allocated
freed (a training step does). Another profiler running at the same time makes ``start``
fail.

``process_peak_bytes`` is what the operating system charged the process on CPU: the peak
resident set size, ~0.7 GiB above the tensors for the interpreter and libraries alone.
"""
from __future__ import annotations

import itertools
import os
import resource
import sys
from collections.abc import Iterable

import torch
from torch import nn
from torch._C._profiler import _ExperimentalConfig
from torch.autograd import ProfilerConfig, ProfilerState, _disable_profiler_legacy, _enable_profiler_legacy


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (views share theirs)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def training_tensors(modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None = None,
                     *extra: torch.Tensor) -> list[torch.Tensor]:
    """Tensors a training loop holds between steps: the modules' parameters, gradients and
    buffers, the optimizer's state, and ``extra``."""
    out = list(extra)
    for module in modules:
        for p in module.parameters():
            out += [p] if p.grad is None else [p, p.grad]
        out += list(module.buffers())
    if optimizer is not None:
        out += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return out


def engine_tensors(engine) -> list[torch.Tensor]:
    """What a ``gems.Engine`` holds between steps on its device: its stages (parameters, buffers),
    the flat gradient bucket the gradients live in, and the optimizer's state but for that of
    the stages whose state lives in host memory (``gems.pipeline.hostopt``: another tier)."""
    engine.grads.update.settle()   # the optimizer's state as the last step's update (a host worker's) left it
    return training_tensors(engine.stages.values(), None, engine.bucket) + _optimizer_state(engine, on_host=False)


def device_state_bytes(engine) -> int:
    """Bytes of the optimizer's state a ``gems.Engine`` holds on its device (``engine_tensors``'
    share of it): none before its first applied step, in which torch's optimizers make it."""
    engine.grads.update.settle()
    return storage_bytes(_optimizer_state(engine, on_host=False))


def _optimizer_state(engine, on_host: bool) -> list[torch.Tensor]:
    """The tensors of the engine's optimizer's state of the parameters the host tier holds (``on_host``)
    or of the others (on the device)."""
    host = engine.grads.host
    return [v for p, state in engine.optimizer.state.items() if host.holds(p) == on_host for v in state.values()
            if torch.is_tensor(v)]


def host_tier_bytes(engine) -> int:
    """Host memory a ``gems.Engine`` holds for model state it keeps off the device
    (``--state-placement host-optimizer``): the host tier's copies of parameters and gradient
    segments, and the optimizer's state of the parameters it updates there. Static between steps,
    so its storages are counted as they are; the update's temporaries are not (on CPU ranks the
    allocator's high-water mark, the device tier's measure, sees them)."""
    engine.grads.update.settle()
    return engine.grads.host.nbytes + storage_bytes(_optimizer_state(engine, on_host=True))


def _memory_config() -> ProfilerConfig:
    """The CPU profiler with memory events only (no shapes, stacks or FLOPs)."""
    return ProfilerConfig(ProfilerState.CPU, False, True, False, False, False, _ExperimentalConfig())


_quieted = False


def _quiet_first_window() -> None:
    """Every window frees blocks allocated before it, and the first such free in a process makes
    the profiler print a C++ warning ("Memory block of unknown size was allocated before the
    profiling started") straight to stderr, once: a line on every rank of every run that says
    nothing to a user (those frees are simply not counted). Spend that warning once with
    stderr pointed at /dev/null."""
    global _quieted
    if _quieted:
        return
    _quieted = True
    block = torch.empty(1024)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        _enable_profiler_legacy(_memory_config())
        del block
        _disable_profiler_legacy()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class PeakMeter:
    """Peak tensor bytes over a window of code (see module docstring).

        meter = PeakMeter(device)
        meter.start(held=engine_tensors(engine))   # CPU: name what is already allocated
        engine.step(images, labels)
        peak = meter.stop()

    or ``with PeakMeter(device) as meter: ...`` then ``meter.peak``: on CPU, the peak above
    the window's start.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.held = 0        # bytes in use at the window's start
        self.peak = 0        # the last window's peak, including ``held``
        self._on = False

    def start(self, held: Iterable[torch.Tensor] = ()) -> None:
        """Open a window; ``held``: on CPU, the tensors already allocated that count."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.held = int(torch.cuda.memory_allocated(self.device))
        else:
            self.held = storage_bytes(held)
            _quiet_first_window()
            _enable_profiler_legacy(_memory_config())
        self._on = True

    def stop(self, since: float | None = None) -> int:
        """Close the window and return its peak bytes (``held`` included).

        ``since`` (a ``time.time()`` value, CPU only): take the peak over the part of the
        window after it, still counting what was allocated before it and is alive then
        (e.g. a window opened before a data load, measuring the step that follows it).
        """
        if not self._on:
            raise RuntimeError("PeakMeter.stop() without start()")
        self._on = False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
            return self.peak
        records = itertools.chain.from_iterable(_disable_profiler_legacy())
        events = sorted(((r.start_us(), r.cpu_memory_usage()) for r in records if r.kind() == "memory_alloc"),
                        key=lambda e: e[0])   # stable: each thread's records stay in their order
        begin = -float("inf") if since is None else since * 1e6   # records carry wall-clock microseconds
        live, high = 0, None
        for stamp, delta in events:
            if high is None and stamp >= begin:
                high = live          # what is alive when the measured part begins counts
            live += delta
            if high is not None:
                high = max(high, live)
        high = live if high is None else high
        self.peak = self.held + high
        return self.peak

    def close(self) -> None:
        """Close an open window without measuring it (a run that ends early)."""
        if self._on and self.device.type != "cuda":
            _disable_profiler_legacy()
        self._on = False

    def __enter__(self) -> PeakMeter:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._on:
            self.stop()


def process_peak_bytes(device: torch.device) -> int:
    """CUDA: max allocated since the last reset; CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def estimate_error(measured: int, estimated: int) -> str:
    """The estimate's relative error against the measurement, e.g. "-1.6%", for reports."""
    return f"{estimated / measured - 1:+.1%}" if measured else "n/a"


def rank_estimate(estimate, tile: int) -> int:
    """The plan's peak for a rank at ``tile`` of a position (its ``PositionEstimate``): a tile
    group's member's own (tile > 0), else the position's, which prices the leader (the member's
    bound, for a plan made before members were estimated)."""
    return estimate.member_peak_bytes if tile and estimate.member_peak_bytes else estimate.peak_bytes


def place(position: int, tile: int, bound: bool = False) -> str:
    """Where a rank's measured memory sits, for reports: "position r", "position r, tile t" for a
    tile group's member, and with ``bound`` "...; the leader's estimate, a bound" (a plan with no
    member estimate: the leader holds the most, the gathered boundaries and its stages' untiled
    units, which a member lacks)."""
    return f"position {position}" + (f", tile {tile}" if tile else "") + (
        "; the leader's estimate, a bound" if tile and bound else "")


def kind(device: torch.device) -> str:
    """What ``PeakMeter`` measures on ``device``, for reports."""
    if device.type == "cuda":
        return "tensors: CUDA max allocated"
    return "tensors: held at the start + CPU allocator high-water mark"
