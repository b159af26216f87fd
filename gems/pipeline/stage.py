"""Per-stage memory policies: recompute and offload a stage's activations, model untouched.

A stage's ``StagePolicy`` (``gems.partition.plan``) names recompute segments (model unit
ranges ``[first, end)``) and whether what backward needs goes to host memory. The engine
runs every stage forward through a ``StageRunner`` and calls ``prefetch`` when that
micro-batch's backward starts. The math does not change: same gradients, and BatchNorm's
running statistics are updated once per forward, never by a recomputation.

Which forwards a policy applies to
----------------------------------
Take one position's compute actions in order (forward and backward; messages, sync and
step do not count). A forward is *immediate* when the next one is its own backward (same
replica, micro-batch and stage), and *waiting* otherwise (``gems.pipeline.schedule.waiting_forwards``).
``mast`` K=2 m=1, position 0: ``F d0.s0  F u0.s1  B u0.s1  B d0.s0`` -- d0.s0 waits, u0.s1
is immediate. ``1f1b`` K=2 m=2: position 0 ``F d0.s0  F d1.s0  B d0.s0  B d1.s0`` -- both
wait (as every forward does under ``gpipe``, whose backwards run first in, first out);
position 1 ``F d0.s1  B d0.s1  F d1.s1  B d1.s1`` -- both immediate, as every forward is
under ``mp``.

- waiting forward: every recompute segment runs under checkpoint; offload is on.
- immediate forward: nothing is offloaded, and the stage's last segment runs without
  checkpoint when it ends at the stage's last unit; every other segment runs under
  checkpoint. Its backward starts at once, with that last segment: what offloading moves
  would come straight back and the last segment would be rematerialized straight away, so
  both would cost time and lower no peak. The earlier segments are still recomputed, one
  at a time, which is what lowers the peak. (A stage that is one segment therefore
  recomputes nothing in an immediate forward; under ``mp`` only multi-segment recompute helps.)

Memory per micro-batch, for the planner
---------------------------------------
Write X, Y for the stage's input and output (the engine keeps both until the backward,
under every policy), A_U for what units outside segments save, and I_i, A_i for segment
i's input and everything its units save (input included). From a waiting forward until
its backward, the device keeps:

- none:               A_U + sum A_i.
- recompute:          A_U + sum I_i; during its backward, + max A_i (one segment
                      rematerialized at a time, freed as its backward ends).
- offload:            X, Y, parameters, and saved tensors under ``MIN_OFFLOAD_BYTES``; the rest
                      waits in host memory (pinned, on CUDA) and all of it comes back when
                      that micro-batch's backward starts (so + A_U + sum A_i then).
- recompute+offload:  as offload, where what is saved is A_U + sum I_i (the checkpoint
                      inputs); during its backward, those back, + max A_i.

An immediate forward holds, from its forward until its backward, what a waiting one holds
while the backward of its last segment runs (everything back from the host, that segment
rematerialized), so both reach the same peak. Time: a checkpointed segment runs its
forward twice (``checkpointed_segments`` says which, per forward); offloading copies what it
moves out during the forward and back at the backward, on a side stream beside the compute.

On a CPU device the host *is* the device: offloading still copies every saved tensor
into a separate CPU tensor and back (so the tests exercise the math), but saves nothing.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gems.errors import GemsError
from gems.plan import MIN_OFFLOAD_BYTES, StagePolicy

Key = tuple[int, int, int]   # (replica, micro-batch, stage)


def as_tuple(x: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A unit's output as a tuple of tensors (a tensor becomes a 1-tuple): the runtime's view
    of every stage boundary."""
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    raise GemsError(f"a unit must return a tensor or a tuple of tensors; got {_describe(x)}: change the "
                    "unit's forward to return tensors only.")


def _describe(x: object) -> str:
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} of ({', '.join(type(t).__name__ for t in x)})"
    return type(x).__name__


def unpack(xs: tuple[torch.Tensor, ...]):
    """The value a unit takes: a tensor, or a tuple when the boundary carries several."""
    return xs[0] if len(xs) == 1 else xs


def checkpointed_segments(policy: StagePolicy, waiting: bool, end_unit: int) -> list[list[int]]:
    """The recompute segments one forward of a stage ending before unit ``end_unit`` runs
    under checkpoint: all of them, but the last of an immediate forward when it ends the stage."""
    segments = [list(seg) for seg in policy.recompute]
    if not waiting and segments and segments[-1][1] == end_unit:
        segments.pop()
    return segments


class StageRunner:
    """Runs one stage's forward under its ``StagePolicy``.

    Args:
        module: the stage (``model[lo:hi]``, on ``device``).
        first_unit: ``lo``, the model index of its first unit (policies name model units).
        policy: what to recompute and whether to offload.
        device: where the stage runs.
    """

    def __init__(self, module: nn.Sequential, first_unit: int, policy: StagePolicy,
                 device: torch.device) -> None:
        self.module, self.policy = module, policy
        self._pieces = {waiting: _pieces(module, first_unit,
                                         checkpointed_segments(policy, waiting, first_unit + len(module)))
                        for waiting in (True, False)}
        self.offload = _Offload(module, device) if policy.offload else None

    def forward(self, inputs: tuple[torch.Tensor, ...], key: Key, waiting: bool) -> tuple[torch.Tensor, ...]:
        """The stage's output for one micro-batch; ``waiting``: whether its backward is not
        the next compute action (``gems.pipeline.schedule.waiting_forwards``)."""
        offload = self.offload is not None and waiting
        with self.offload.saving(key, inputs) if offload else contextlib.nullcontext():
            xs = inputs
            for piece, recompute in self._pieces[waiting]:
                if recompute:
                    xs = checkpoint(functools.partial(_run, piece), *xs, use_reentrant=False,
                                    preserve_rng_state=True, context_fn=functools.partial(_contexts, piece))
                else:
                    xs = _run(piece, *xs)
        if offload:
            self.offload.keep_on_device(key, xs)
        return xs

    def prefetch(self, key: Key) -> None:
        """Start bringing back what the forward of ``key`` offloaded (call as its backward starts)."""
        if self.offload is not None:
            self.offload.prefetch(key)


def _pieces(module: nn.Sequential, first_unit: int,
            segments: list[list[int]]) -> list[tuple[nn.Sequential, bool]]:
    """The stage as consecutive runs of units, each with whether it runs under checkpoint."""
    if not segments:
        return [(module, False)]   # the stage module itself, its own hooks included
    pieces, at = [], 0
    for first, end in segments:
        lo, hi = first - first_unit, end - first_unit
        if at < lo:
            pieces.append((module[at:lo], False))
        pieces.append((module[lo:hi], True))
        at = hi
    if at < len(module):
        pieces.append((module[at:], False))
    return pieces


def _run(piece: nn.Sequential, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return as_tuple(piece(unpack(xs)))


def _contexts(piece: nn.Module) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """checkpoint's (forward, recomputation) contexts: the recomputation works on copies of
    the buffers, so running statistics (and ``num_batches_tracked``) are updated once."""
    return contextlib.nullcontext(), _scratch_buffers(piece)


@contextlib.contextmanager
def _scratch_buffers(piece: nn.Module) -> Iterator[None]:
    # Copies rather than momentum tricks: exact for momentum=None (cumulative averages) and
    # for counters, and the real buffers see no write (so no version bump) at all.
    real = [(m, name, b) for m in piece.modules() for name, b in m.named_buffers(recurse=False)]
    for m, name, b in real:
        setattr(m, name, b.clone())
    try:
        yield
    finally:
        for m, name, b in real:
            setattr(m, name, b)


class _Saved:
    """One saved tensor sent to the host: its host copy, then its device copy."""

    __slots__ = ("source", "host", "device", "ready")

    def __init__(self, source: torch.Tensor, host: torch.Tensor) -> None:
        self.source = weakref.ref(source)
        self.host: torch.Tensor | None = host
        self.device: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None   # device copy complete (CUDA prefetch)


class _Offload:
    """saved_tensors_hooks that move a stage's saved tensors to host memory and back.

    CUDA: device->host copies run on a side stream after the compute stream's work so far
    (``record_stream`` keeps the source's memory from reuse until the copy is done); the
    prefetch copies back on the same stream, last saved first (backward needs them in
    reverse order), and each unpack waits on its tensor's event only.
    """

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module, self.device = module, device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.saved: dict[Key, list[_Saved]] = {}
        self.bytes = 0   # moved to the host so far (for tests and traces)

    @contextlib.contextmanager
    def saving(self, key: Key, inputs: tuple[torch.Tensor, ...]) -> Iterator[None]:
        # Parameters, buffers and the stage's inputs stay on the device anyway: never copied.
        resident = {t.untyped_storage().data_ptr()
                    for t in (*self.module.parameters(), *self.module.buffers(), *inputs)}
        saved = self.saved[key] = []
        by_id: dict[tuple[int, int], _Saved] = {}   # a tensor saved by several ops moves once

        def pack(t: torch.Tensor):
            if (t.device != self.device or t.layout != torch.strided
                    or t.numel() * t.element_size() < MIN_OFFLOAD_BYTES
                    or t.untyped_storage().data_ptr() in resident):
                return t
            known = by_id.get((id(t), t._version))
            if known is not None and known.source() is t:
                return known
            item = by_id[(id(t), t._version)] = _Saved(t, self._to_host(t))
            saved.append(item)
            return item

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty_like(t, device="cpu", pin_memory=self.cuda)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)
        else:
            host.copy_(t)
        self.bytes += t.numel() * t.element_size()
        return host

    def keep_on_device(self, key: Key, outputs: tuple[torch.Tensor, ...]) -> None:
        """Saved tensors that are the stage's outputs stay alive on the device (the engine
        keeps them for the backward): use those instead of bringing a second copy back."""
        out = {t.untyped_storage().data_ptr() for t in outputs}
        for item in self.saved.get(key, []):
            source = item.source()
            if source is not None and source.untyped_storage().data_ptr() in out:
                item.device, item.host = source, None

    def prefetch(self, key: Key) -> None:
        items = self.saved.pop(key, [])
        if not self.cuda:
            return
        with torch.cuda.stream(self.stream):
            for item in reversed(items):
                if item.device is None:
                    item.device = item.host.to(self.device, non_blocking=True)
                    item.ready = torch.cuda.Event()
                    item.ready.record(self.stream)
                    item.host = None

    def _unpack(self, item):
        if isinstance(item, torch.Tensor):
            return item
        if item.device is None:   # CPU, or a backward without prefetch
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
            item.device, item.host = item.host.to(self.device, non_blocking=self.cuda), None
        elif item.ready is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(item.ready)
            item.device.record_stream(stream)
            item.ready = None
        return item.device
