"""Offloading a stage's saved tensors to host memory: the ``saved_tensors_hooks`` that move
them out during the forward and back before the backward (``_Offload``), and the bounded pool
of host buffers they live in (``HostPool``). ``gems.pipeline.stage`` explains when a stage
offloads and what that costs; the planner prices the pool (``gems.partition.costs``).
"""
from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

from gems.errors import GemsError
from gems.plan import MIN_OFFLOAD_BYTES
from gems.units import format_size

Key = tuple[int, int, int]   # (replica, micro-batch, stage)

# Bound of a HostPool that is given none (a plan that does not price offload's host memory,
# or a CPU device, where host memory is the device's): a node's host RAM is shared by its
# ranks (8 GPUs beside 512 GiB is common), so 16 GiB per rank pins at most a quarter of it.
DEFAULT_HOST_POOL_BYTES = 16 * 2**30


class HostPool:
    """Host buffers for offloaded tensors, reused across micro-batches and steps.

    Flat byte buffers kept per size (a CNN saves the same shapes every step): after the first
    step ``take`` finds a free one and pins nothing new. It allocates at most ``limit`` bytes
    (None: ``DEFAULT_HOST_POOL_BYTES``), then hands out unpinned memory (copies to it do not
    overlap compute) with one warning. ``held_bytes``: host bytes holding offloaded tensors
    now, pooled or not; ``peak_bytes``: its highest (what the plan's ``host_bytes``
    estimates); ``pooled_bytes``: allocated by the pool. ``pin`` needs a CUDA build.
    """

    def __init__(self, limit: int | None = None, pin: bool = False) -> None:
        self.limit = DEFAULT_HOST_POOL_BYTES if limit is None else limit
        self.pin = pin
        self.held_bytes = self.peak_bytes = self.pooled_bytes = 0
        self._free: dict[int, list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}
        self._pooled: set[int] = set()   # data pointers of the pool's own buffers
        self._warned = False

    def take(self, nbytes: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A byte buffer of ``nbytes`` and, for a reused one, the event after which the copies
        that last used it are done (CUDA: a copy into it must wait for that event first)."""
        free = self._free.get(nbytes)
        if free:
            buffer, done = free.pop()
        elif self.pooled_bytes + nbytes <= self.limit:
            buffer, done = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin), None
            self.pooled_bytes += nbytes
            self._pooled.add(buffer.data_ptr())
        else:
            if not self._warned:
                self._warned = True
                warnings.warn(f"offload's host pool is full ({format_size(self.limit)}): further offloaded tensors "
                              "use unpinned memory, whose copies do not overlap compute; plan with gems-plan so the "
                              "pool is sized to what offload holds at its peak", RuntimeWarning, stacklevel=2)
            buffer, done = torch.empty(nbytes, dtype=torch.uint8), None
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return buffer, done

    def give(self, buffer: torch.Tensor, done: torch.cuda.Event | None = None) -> None:
        """Return a buffer from ``take``; ``done``: recorded after the copies queued on it."""
        self.held_bytes -= buffer.numel()
        if buffer.data_ptr() in self._pooled:
            self._free.setdefault(buffer.numel(), []).append((buffer, done))


class _Saved:
    """One saved tensor sent to the host: its host copy (a view of a pool buffer), then its
    device copy; its version at pack, to detect in-place writes after it."""

    __slots__ = ("source", "version", "stage", "buffer", "host", "device", "ready")

    def __init__(self, source: torch.Tensor, stage: int, buffer: torch.Tensor, host: torch.Tensor) -> None:
        self.source, self.version, self.stage = weakref.ref(source), source._version, stage
        self.buffer: torch.Tensor | None = buffer
        self.host: torch.Tensor | None = host
        self.device: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None   # device copy complete (CUDA)


class _Offload:
    """saved_tensors_hooks that move a stage's saved tensors to host memory and back.

    CUDA: device->host copies run on a side stream after the compute stream's work so far
    (``record_stream`` keeps the source's memory from reuse until the copy is done) and after
    the last copies through the reused pool buffer; the prefetch copies back on the same
    stream, last saved first (backward needs them in reverse order), returns each buffer to
    the pool with the event of its copy, and each unpack waits on its tensor's event only.
    """

    def __init__(self, module: nn.Module, device: torch.device, pool: HostPool) -> None:
        self.module, self.device, self.pool = module, device, pool
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.saved: dict[Key, list[_Saved]] = {}
        self.bytes = 0   # moved to the host so far (for tests and traces)
        # GEMS_OFFLOAD_WAIT=1: the host waits for every copy (the baseline make gpu-check
        # measures the hidden copy time against); never set in training.
        self.wait = self.cuda and os.environ.get("GEMS_OFFLOAD_WAIT") == "1"

    @contextlib.contextmanager
    def saving(self, key: Key, inputs: tuple[torch.Tensor, ...]) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(*self.hooks(key, inputs)):
            yield

    def hooks(self, key: Key, inputs: tuple[torch.Tensor, ...]) -> tuple[Callable, Callable]:
        """The (pack, unpack) pair of one forward of ``key``: ``saving`` installs it; a stage whose
        parameters live on the host wraps it in its own (``gems.pipeline.hostweights``)."""
        # Parameters, buffers and the stage's inputs stay on the device anyway: never copied.
        resident = {t.untyped_storage().data_ptr()
                    for t in (*self.module.parameters(), *self.module.buffers(), *inputs) if t.numel()}
        saved = self.saved[key] = []
        by_id: dict[int, _Saved] = {}   # a tensor saved by several ops moves once

        def pack(t: torch.Tensor):
            if (t.device != self.device or t.layout != torch.strided
                    or t.numel() * t.element_size() < MIN_OFFLOAD_BYTES
                    or t.untyped_storage().data_ptr() in resident):
                return t
            known = by_id.get(id(t))
            if known is not None and known.source() is t:
                if known.version != t._version:
                    raise _modified_in_place(known.stage)
                return known
            item = by_id[id(t)] = self._to_host(t, key[2])
            saved.append(item)
            return item

        return pack, self._unpack

    def _to_host(self, t: torch.Tensor, stage: int) -> _Saved:
        nbytes = t.numel() * t.element_size()
        buffer, done = self.pool.take(nbytes)
        host = _shaped_like(buffer, t)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            if done is not None:
                self.stream.wait_event(done)
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)
            if self.wait:
                self.stream.synchronize()
        else:
            host.copy_(t)
        self.bytes += nbytes
        return _Saved(t, stage, buffer, host)

    def keep_on_device(self, key: Key, outputs: tuple[torch.Tensor, ...]) -> None:
        """Saved tensors that are the stage's outputs stay alive on the device (the engine
        keeps them for the backward): use those instead of bringing a second copy back."""
        out = {t.untyped_storage().data_ptr() for t in outputs}
        for item in self.saved.get(key, []):
            source = item.source()
            if source is not None and source.untyped_storage().data_ptr() in out:
                done = None
                if self.cuda:   # the copy out may still be reading into the buffer
                    done = torch.cuda.Event()
                    done.record(self.stream)
                self._release(item, done)
                item.device = source

    def prefetch(self, key: Key) -> None:
        for item in reversed(self.saved.pop(key, [])):
            if item.device is None:
                self._fetch(item)

    def _fetch(self, item: _Saved) -> None:
        """Copy ``item`` back to the device and give its host buffer back to the pool."""
        if self.cuda:
            with torch.cuda.stream(self.stream):
                item.device = item.host.to(self.device, non_blocking=True)
                item.ready = torch.cuda.Event()
                item.ready.record(self.stream)
            if self.wait:
                self.stream.synchronize()
        else:
            item.device = item.host.clone()   # the pool reuses the buffer: autograd needs its own tensor
        self._release(item, item.ready)

    def _release(self, item: _Saved, done: torch.cuda.Event | None) -> None:
        self.pool.give(item.buffer, done)
        item.buffer = item.host = None

    def _unpack(self, item):
        if isinstance(item, torch.Tensor):
            return item
        source = item.source()
        if source is not None and source._version != item.version:
            raise _modified_in_place(item.stage)
        if item.device is None:   # a backward whose prefetch was not called
            self._fetch(item)
        if item.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(item.ready)
            item.device.record_stream(stream)
            item.ready = None
        return item.device


def _shaped_like(buffer: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``buffer`` viewed with ``t``'s dtype and shape, and its strides when ``t`` is dense
    (as ``torch.empty_like`` would: channels-last stays channels-last on the way back)."""
    flat = buffer.view(t.dtype)
    dims = sorted((stride, size) for stride, size in zip(t.stride(), t.shape) if size != 1)
    span = 1
    for stride, size in dims:
        if stride != span:
            return flat.view(t.shape)
        span *= size
    return flat.as_strided(t.shape, t.stride())


def _modified_in_place(stage: int) -> GemsError:
    return GemsError(f"a module of stage {stage} modified a tensor in place after autograd saved it (e.g. "
                     "nn.ReLU(inplace=True) after a layer whose output is offloaded): use inplace=False there "
                     f"or exclude stage {stage} from offload")
