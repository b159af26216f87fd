"""Model state in host memory, ``StagePolicy.state_placement == "host-optimizer"``: the optimizer's
state and its update on the host (KARMA's host-side update, ZeRO-Offload's CPU optimizer).

For each part of such a stage (``GradSync``'s segments), the device keeps the parameters, and the
gradient segment that backward accumulates into only from the stage's first backward of the step to its
copy out (``gradients``, before each backward; no bucket holds it the rest of the step); this tier keeps, in host
memory allocated once before the first step (pinned where the device is CUDA; on CPU ranks a pool of
its own, filled only by copy):

    the segment's copy     the gradients, then the copy of the BatchNorm statistics, as on the device
    the parameters' copy   laid out as their gradients; the optimizer's parameters are views of it,
                           their ``.grad`` views of the segment's copy

One step of such a part::

    device   ... last backward |copy out|                                  |copy back| next forward
    host                            '-- allreduce -- loss, norm -- update --'

``copy_out`` after the stage's last backward (CUDA: on a copy stream after the compute stream's
work, so the rest of the backward runs beside it, the device segment's memory reused only once the copy
has read it; CPU: a plain copy), the sync group's allreduce
(or reduce-scatter) runs on the host copy, clipping scales the host gradients, the optimizer --
torch's CPU implementation, which the user's factory builds on the host parameters -- updates
them in place once the step-wide loss (and norm) is known, and ``copy_back`` hands the new values
to the device parameters before the stage's next forward. The arithmetic is the device's: on CPU
ranks bitwise the same as ``device``.

A part of a stage placed ``"host"`` (``gems.pipeline.hostweights``: parameters on the host too) is held
here alike, but the tier keeps no device buffer of its parameters (``HostWeights`` brings them to the
device per unit group and frees them again), and its gradients reach the host segment as backward makes
them (``grad_out``: added there micro-batch after micro-batch, in the order the device bucket would add
them), so ``copy_out`` brings only the BatchNorm statistics and ``zero_grads`` clears the host gradients
after each step.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from gems.errors import GemsError
from gems.plan import formats
from gems.units import format_size

PLACEMENT = "host-optimizer"


@dataclass
class _Part:
    device_params: torch.Tensor | None   # the part's parameters on the device, one flat buffer laid out as their
                                         # gradients; None when its weights live on the host (HostWeights)
    host_params: torch.Tensor     # its host copy, which the optimizer updates
    segment: torch.Tensor         # host copy of the device segment: gradients, then statistics
    grads: int                    # elements of gradients in the segment
    views: list[tuple[nn.Parameter, int]]   # each device parameter and where its gradient starts in them
    copied: object = None         # CUDA: the event after this step's copy out; CPU: True once copied
    device_grads: torch.Tensor | None = None   # the device's gradients, from the first backward to the copy out

    @property
    def weights(self) -> bool:
        """Whether the part's parameters live on the host (their gradients added here by ``grad_out``)."""
        return self.device_params is None


class _Staged:
    """CUDA: one parameter's gradient on its way to the host (a pinned buffer, the event after its copy),
    added into the host gradient before the next one reuses the buffer, or at the sync."""

    __slots__ = ("buffer", "event")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.event = buffer, None


class HostTier:
    """The host copies of the parts placed on the host, keyed as ``GradSync``'s segments."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = device.type == "cuda"   # pinned: copies overlap and MPI reads host memory directly
        self._stream: torch.cuda.Stream | None = None   # CUDA: the copies out, made with the first part
        self._parts: dict[tuple[int, int], _Part] = {}
        self._host: dict[int, nn.Parameter] = {}   # id(device parameter) -> its host parameter
        self._views: list[tuple[nn.Parameter, torch.Tensor]] = []   # (host parameter, its gradient's place)
        self._ids: set[int] = set()   # of the host parameters
        self._weights: set[int] = set()   # ids of the device parameters whose values live here (placement host)
        self._staged: dict[int, _Staged] = {}   # CUDA: id(device parameter) -> its gradient's way out
        self.timer = None   # the engine's ActionTimer: copies and the update as spans inside their action

    def timed(self, label: str):
        """The body a span ``label`` on the step's timeline ("copy-out s1", "host-update"; nothing
        without a timer). On CUDA it times the issuing of asynchronous copies, on the compute stream."""
        return nullcontext() if self.timer is None else self.timer.timed(label)

    def updating(self):
        """Around the optimizer's step: a span "host-update" where parts are held here."""
        return self.timed("host-update") if self._parts else nullcontext()

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self._parts

    @property
    def held(self) -> bool:
        """Whether any part is held here (where all of a rank's are, unsharded, its update runs on a worker:
        ``gems.pipeline.hostupdate``)."""
        return bool(self._parts)

    @property
    def asynchronous(self) -> bool:
        """Whether a copy out completes later (CUDA), so the collective on it is posted once the copy has
        arrived (``arrived``, ``GradSync.progress``) or at the sync."""
        return self.pin

    def add(self, key: tuple[int, int], statistics: torch.Tensor, flat: torch.Tensor, params: list[nn.Parameter],
            offsets: list[int], weights: bool = False) -> torch.Tensor:
        """Hold part ``key`` on the host: the device copy of its BatchNorm ``statistics``, ``flat`` (its
        parameters' device buffer, laid out as their gradients) and ``params`` at ``offsets`` in both;
        ``weights``: the parameters live on the host too (the tier keeps no hold on ``flat``, whose owner
        frees it). Returns the host copy of ``flat``."""
        if self.pin and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        host_params = self._allocate(flat)
        host_params.copy_(flat)
        # the host segment: the gradients, then the statistics; a part whose weights live here has its
        # gradients added into (so zeroed), the others copied from the device's at ``copy_out``
        host_segment = self._allocate(statistics, flat.numel())
        if weights:
            host_segment[:flat.numel()].zero_()
        staging = self._allocate(flat) if weights and self.pin else None
        for p, offset in zip(params, offsets):
            host = nn.Parameter(formats.like(host_params[offset:offset + p.numel()], p), p.requires_grad)
            host.grad = formats.like(host_segment[offset:offset + p.numel()], p)
            self._host[id(p)] = host
            self._views.append((host, host.grad))
            self._ids.add(id(host))
            if weights:
                self._weights.add(id(p))
            if staging is not None:
                self._staged[id(p)] = _Staged(formats.like(staging[offset:offset + p.numel()], p))
        self._parts[key] = _Part(None if weights else flat, host_params, host_segment, flat.numel(),
                                 list(zip(params, offsets)))
        return host_params

    @torch.no_grad()
    def gradients(self, key: tuple[int, int]) -> None:
        """Before a backward of part ``key``'s stage: its device gradients, zeros made at the step's first
        (every device parameter's ``.grad`` a view of them), for backward to accumulate into until
        ``copy_out`` drops them; nothing for a part whose weights live here (``grad_out`` takes those)."""
        part = self._parts[key]
        if part.weights or part.device_grads is not None or not part.grads:
            return
        part.device_grads = torch.zeros_like(part.device_params)
        for p, offset in part.views:
            p.grad = formats.like(part.device_grads[offset:offset + p.numel()], p)

    def _drop(self, part: _Part) -> None:
        """Part ``part``'s device gradients gone (``gradients`` makes them anew)."""
        part.device_grads = None
        for p, _ in part.views:
            p.grad = None

    def _allocate(self, like: torch.Tensor, more: int = 0) -> torch.Tensor:
        """Host memory for ``like``'s elements and ``more`` (pinned on CUDA), GemsError when there is none."""
        try:
            return torch.empty(like.numel() + more, dtype=like.dtype, pin_memory=self.pin)
        except RuntimeError as error:
            size = format_size((like.numel() + more) * like.element_size())
            raise GemsError(f"cannot have {size} of pinned host memory for the model state that --state-placement "
                            f"{PLACEMENT} (or host) keeps there "
                            f"({' '.join(str(error).split()[:12])}): free host memory, or place that state on the "
                            "device") from None

    @property
    def nbytes(self) -> int:
        """Host memory of the copies (the optimizer's state aside)."""
        return (sum(t.numel() * t.element_size() for part in self._parts.values()
                    for t in (part.host_params, part.segment))
                + sum(s.buffer.numel() * s.buffer.element_size() for s in self._staged.values()))

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of the host copies (its optimizer state then lives in host memory too)."""
        return id(p) in self._ids

    def parameter(self, p: nn.Parameter) -> nn.Parameter:
        """The parameter the optimizer updates for device parameter ``p``: its host copy, or ``p``."""
        return self._host.get(id(p), p)

    def values(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor holding device parameter ``p``'s values: its host copy where they live on the host
        (the device's storage is empty between uses), else ``p``."""
        return self._host[id(p)] if id(p) in self._weights else p

    def grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """The gradient the step reads for ``p`` (after the sync: the sums)."""
        return self.parameter(p).grad

    @property
    def views(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(host parameter, its gradient's place in the host segment) of every part."""
        return self._views

    def copy_out(self, key: tuple[int, int], statistics: torch.Tensor) -> None:
        """Start copying part ``key``'s device gradients (its backward is done; a part whose weights live
        here has its gradients here already) and the device copy of its ``statistics`` to the host, and
        drop the device's gradients (on CUDA their memory is reused only once the copy has read it)."""
        part = self._parts[key]
        grads = part.device_grads
        pairs = [(part.segment[part.grads:], statistics)]
        if grads is not None:
            pairs.append((part.segment[:part.grads], grads))
            self._drop(part)
        with self.timed(f"copy-out s{key[0]}"):
            if self._stream is None:
                for target, source in pairs:
                    target.copy_(source)
                part.copied = True
                return
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for target, source in pairs:
                    target.copy_(source, non_blocking=True)
                part.copied = torch.cuda.Event()
                part.copied.record(self._stream)
            if grads is not None:
                grads.record_stream(self._stream)

    @torch.no_grad()
    def grad_out(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Add ``grad``, one backward's gradient of device parameter ``p`` (whose values live here), into
        its host gradient: on CPU at once; on CUDA copied on the copy stream into ``p``'s pinned buffer and
        added once that copy is done (before the next one, or at the sync: ``ready``). Either way the host
        adds in the order the device bucket would, so the sums are the device's bit for bit."""
        host = self._host[id(p)].grad
        staged = self._staged.get(id(p))
        if staged is None:
            host.add_(grad)
            return
        self._land(host, staged)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            staged.buffer.copy_(grad, non_blocking=True)
            staged.event = torch.cuda.Event()
            staged.event.record(self._stream)
        grad.record_stream(self._stream)   # its memory is not reused before the copy has read it

    @staticmethod
    def _land(host: torch.Tensor, staged: _Staged) -> None:
        """CUDA: add a gradient whose copy was started into ``host``, once it has arrived."""
        if staged.event is not None:
            staged.event.synchronize()
            host.add_(staged.buffer)
            staged.event = None

    def _land_all(self) -> None:
        for pid, staged in self._staged.items():
            self._land(self._host[pid].grad, staged)

    @torch.no_grad()
    def zero_grads(self) -> None:
        """Clear the host gradients that ``grad_out`` adds into, and drop device gradients a step that
        ended early left (after every step, applied or not)."""
        for part in self._parts.values():
            if part.weights:
                part.segment[:part.grads].zero_()
            elif part.device_grads is not None:
                self._drop(part)

    def arrived(self, key: tuple[int, int]) -> bool:
        """Whether part ``key``'s copy out has completed, so its sum can be posted without waiting (never
        for a part whose weights live here: its gradients' copies land at ``ready``)."""
        copied = self._parts[key].copied
        return not self._parts[key].weights and (copied is True or (copied is not None and copied.query()))

    def copied(self, key: tuple[int, int]) -> bool:
        """Whether part ``key``'s copy out was started this step."""
        return self._parts[key].copied is not None

    def ready(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Part ``key``'s host segment once its copy out is complete: (segment, gradients, statistics)."""
        part = self._parts[key]
        if isinstance(part.copied, torch.cuda.Event):
            part.copied.synchronize()
        part.copied = None   # the next step copies anew
        if part.weights:
            self._land_all()
        return part.segment, part.segment[:part.grads], part.segment[part.grads:]

    def scale(self, factor: float) -> None:
        """Multiply every host gradient by ``factor`` (clipping)."""
        for part in self._parts.values():
            part.segment[:part.grads].mul_(factor)

    @torch.no_grad()
    def copy_back(self) -> None:
        """The updated parameters to the device (before any stage's next forward: the compute stream
        runs the copies first)."""
        if not self._parts:
            return
        with self.timed("copy-back"):
            for part in self._parts.values():
                if not part.weights:   # those come to the device group by group (HostWeights)
                    part.device_params.copy_(part.host_params, non_blocking=self.pin)

    @torch.no_grad()
    def refresh(self) -> None:
        """The device parameters to the host copies (after loading state into the model; parameters that
        live on the host are stored there by ``HostWeights.resident``)."""
        for part in self._parts.values():
            if not part.weights:
                part.host_params.copy_(part.device_params)

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """GemsError for an optimizer without an implementation on the host (one not from torch.optim)."""
        if self._parts and not type(optimizer).__module__.startswith("torch.optim"):
            raise GemsError(f"the optimizer {type(optimizer).__name__} has no host implementation that "
                            f"--state-placement {PLACEMENT} (or host) can run: use one of torch.optim's optimizers, "
                            "or --state-placement device")
