"""Profile a model unit by unit at the real input size without allocating it.

The model runs once, forward then backward, on fake tensors (``FakeTensorMode``): every
tensor has its real shape, dtype and storage but no data, so a ResNet-101 on 2048x2048
images profiles in seconds on a laptop. Three PyTorch tools do the measuring:

* ``saved_tensors_hooks`` sees every tensor autograd keeps for backward; we record its
  *storage* (views and in-place results share one) and which units keep it;
* ``FlopCounterMode`` counts forward and backward FLOPs;
* a small dispatch mode (``tracking.Allocations``) watches storages being created and freed, which
  gives the working memory a unit needs on top of what it keeps (temporaries in forward,
  gradient buffers in backward).

Kernels also take scratch memory that no fake run can see (oneDNN reorders weights and
activations on the CPU, cuDNN takes workspace on the GPU). Working memory therefore allows
one copy of the largest tensor a convolution, batch norm or matmul touches -- for the backward
of a spatial convolution, a copy of its input and one of its output gradient, channels padded
to oneDNN's blocks (``tracking.scratch_bytes``) -- and one of the largest parameter gradient
(computed before it is accumulated). Against the CPU allocator
this lands within a few percent on whole models (``python -m gems.partition.accuracy``).

Each unit runs on a detached copy of the previous unit's output (aliased back to it, so a
unit that modifies its input in place is still profiled as in the whole model), which
lets backward run unit by unit and measure each unit's gradient buffers separately.

Under ``torch.autocast`` (``autocast=torch.bfloat16``, gems-train ``--amp bf16``) the run stays
in full precision and ``tracking.Precision`` follows what autocast would lower: storages made by
convolutions and matmuls, and by the ops that take only such storages (batch norm, ReLU,
pooling, additions of them), are priced at the lower precision's size, and the lower-precision
copies a convolution or matmul makes of its full-precision inputs (its weight, the image) are
added as storages it keeps. A documented approximation: storages that cross a unit boundary keep
their full size (the runtime sends boundaries in the plan's dtypes, so the stage receiving one
holds it at full size; the stage sending one is overestimated by half of it), FLOPs and working
memory stay those of the full-precision run (upper bounds), and ops that autocast runs in
float32 (softmax, layer norm, losses) make full-precision storages without the copies of their
inputs.

What comes out is plain records (``gems.partition.records``): per unit its bytes and FLOPs,
and the storages kept or passed on, from which any stage is priced without running again.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from gems.errors import GemsError
from gems.graph import READS, TRACING, input_error
from gems.plan import formats
from .records import ModelProfile, Storage, UnitProfile
from .tracking import Allocations, Precision, StorageKeys, WeightedOutputs, storage_bytes, tensor_bytes

# Optimizer state per trainable parameter, in parameter sizes.
OPTIMIZER_STATE = {"sgd": 1, "sgd-nomomentum": 0, "adam": 2, "adamw": 2}


def profile(model: nn.Sequential, input_shape: Sequence[int], micro_batch_size: int,
            dtype: torch.dtype = torch.float32, optimizer: str = "sgd",
            model_name: str | None = None, autocast: torch.dtype | None = None,
            memory_format: str = "contiguous") -> ModelProfile:
    """Profile ``model`` (an nn.Sequential of units) on a fake micro-batch of
    ``micro_batch_size`` samples of ``input_shape`` (per sample, e.g. (3, 2048, 2048)).

    Parameters and buffers are faked too (in ``dtype`` when floating point), so neither the
    input nor the weights are allocated; the model may even live on the meta device.
    ``autocast``: price activations as forwards under ``torch.autocast`` to this dtype keep
    them (module docstring). ``memory_format``: the layout of 4-D parameters and of the input
    (``gems.plan.formats``); activations follow them as in the real run.
    Raises GemsError when the model cannot take the input (e.g. an image too small).
    """
    if optimizer not in OPTIMIZER_STATE:
        raise GemsError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATE)}")
    if not isinstance(model, nn.Sequential) or len(model) == 0:
        raise GemsError("the model must be a non-empty nn.Sequential of units: build it with gems.models.build")
    names = getattr(model, "unit_names", None) or [name for name, _ in model.named_children()]
    units = list(model)
    training = {m: m.training for m in model.modules()}   # each its own: a frozen BatchNorm stays frozen
    try:
        for u in units:
            u.train()  # profile what training keeps: BatchNorm in batch-statistics mode
        with TRACING, FakeTensorMode(allow_non_fake_inputs=True):   # no other thread's fx trace meanwhile
            return _Run(units, names, tuple(input_shape), micro_batch_size, dtype, optimizer,
                        model_name or "the model", autocast, memory_format).result()
    finally:
        for m, was_training in training.items():
            m.training = was_training


class _Run:
    """One fake forward and backward of all units (call inside FakeTensorMode)."""

    def __init__(self, units: list[nn.Module], names: list[str], input_shape: tuple[int, ...], batch: int,
                 dtype: torch.dtype, optimizer: str, model_name: str, autocast: torch.dtype | None,
                 memory_format: str = "contiguous") -> None:
        self.units, self.names, self.batch = units, names, batch
        self.input_shape, self.dtype, self.optimizer, self.model_name = input_shape, dtype, optimizer, model_name
        self.format = formats.of_name(memory_format)
        self.keys = StorageKeys()
        self.allocations = Allocations()
        self.flops = FlopCounterMode(display=False)
        self.params, self.buffers = zip(*(_fake_state(u, dtype, self.format) for u in units))
        self.allocations.static = {id(t.untyped_storage()) for state in (*self.params, *self.buffers)
                                   for t in state.values()}
        self.static = {self.keys(t) for state in (*self.params, *self.buffers) for t in state.values()}
        self.saved: dict[int, tuple[int, set[int]]] = {}   # storage key -> (nbytes, saving units)
        self.unit = -1
        lower = autocast is not None and autocast.itemsize < dtype.itemsize
        self.precision = Precision(self.keys, self.static, autocast) if lower else None
        self.copied: list[int] = []                         # per unit: bytes of autocast's input copies
        self.weighted = WeightedOutputs({id(t.untyped_storage()) for state in self.params for t in state.values()
                                         if t.requires_grad}, self.keys)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = self.keys(t)
        if key not in self.static:
            self.saved.setdefault(key, (storage_bytes(t), set()))[1].add(self.unit)
        return t

    def result(self) -> ModelProfile:
        x = torch.empty((self.batch, *self.input_shape), dtype=self.dtype,
                        memory_format=self.format if len(self.input_shape) == 3 else torch.contiguous_format)
        n = len(self.units)
        boundaries = [_as_tuple(x, "the input")]   # boundaries[b + 1] = output of unit b
        leaves, fwd_flops, fwd_working, eval_working, captured = [], [], [], [], []
        previous: torch.Tensor | tuple = x
        for i, unit in enumerate(self.units):
            self.unit = i
            leaf, arg = self._detached(previous)
            start = self.allocations.mark()
            state = {**self.params[i], **self.buffers[i]}
            copied = self.precision.copied if self.precision else 0
            self.weighted.outputs = []
            with self.flops, self.allocations, self.weighted, self.precision or contextlib.nullcontext(), \
                    torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                try:
                    previous = torch.func.functional_call(unit, state, (arg,))
                except GemsError:
                    raise
                except (RuntimeError, ValueError, IndexError, TypeError) as error:
                    raise self._input_error(i, error) from None
            self.copied.append(self.precision.copied - copied if self.precision else 0)
            captured.append(self.weighted.bytes(self.precision.lowered, self.precision.dtype) if self.precision
                            else self.weighted.bytes())
            fwd_flops.append(self.flops.get_total_flops())
            fwd_working.append(self.allocations.peak_since(start) + self.allocations.scratch)
            eval_working.append(self._eval_working(unit, state, arg))
            leaves.append(leaf)
            boundaries.append(_as_tuple(previous, f"unit {self.names[i]}"))
            self._check_batch(boundaries[-1], i)
        del previous, arg, state

        # Backward from the last unit: the gradient of unit i's output is that of unit i+1's input.
        bwd_flops, bwd_working = [0] * n, [0] * n
        grads = [torch.ones_like(t) if t.requires_grad else None for t in boundaries[-1]]
        outputs = [list(b) for b in boundaries[1:]]
        shapes = [[(tuple(t.shape[1:]), _dtype_name(t.dtype), t.numel() * t.element_size()) for t in b]
                  for b in boundaries]
        boundary_keys = [[self.keys(t) for t in b] for b in boundaries]
        nbytes = {self.keys(t): storage_bytes(t) for b in boundaries for t in b}
        del boundaries
        for i in reversed(range(n)):
            pairs = [(t, g) for t, g in zip(outputs[i], grads) if g is not None and t.requires_grad]
            start = self.allocations.mark()
            if pairs:
                with self.flops, self.allocations:
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
                bwd_flops[i] = self.flops.get_total_flops()
            # Parameter gradients are static memory, but each is computed before it is stored or
            # accumulated: count the largest one as working memory.
            param_grads = [p.grad for p in self.params[i].values() if p.grad is not None]
            ignore = self.allocations.serials(param_grads)
            bwd_working[i] = (sum(storage_bytes(g) for _, g in pairs) + self.allocations.peak_since(start, ignore)
                              + max((tensor_bytes(g) for g in param_grads), default=0)
                              + self.allocations.scratch)
            grads = [leaf.grad for leaf in leaves[i]]
            outputs[i] = []
            del pairs, param_grads

        storages = self._storages(boundary_keys, nbytes)
        factor = OPTIMIZER_STATE[self.optimizer]
        profiles = []
        for i in range(n):
            trainable = sum(tensor_bytes(p) for p in self.params[i].values() if p.requires_grad)
            out = shapes[i + 1]
            profiles.append(UnitProfile(
                name=self.names[i],
                param_bytes=sum(tensor_bytes(p) for p in self.params[i].values()),
                grad_bytes=trainable,
                optimizer_bytes=factor * trainable,
                buffer_bytes=sum(tensor_bytes(b) for b in self.buffers[i].values()),
                saved_bytes=sum(s.nbytes for s in storages if i in s.savers),
                output_shapes=tuple(shape for shape, _, _ in out),
                output_dtypes=tuple(dt for _, dt, _ in out),
                output_bytes=sum(b for _, _, b in out),
                forward_flops=int(fwd_flops[i]), backward_flops=int(bwd_flops[i]),
                forward_working=int(fwd_working[i]), backward_working=int(bwd_working[i]),
                eval_working=int(eval_working[i]), captured_bytes=int(captured[i]),
            ))
        return ModelProfile(units=profiles, input_shapes=tuple(s for s, _, _ in shapes[0]),
                            input_dtypes=tuple(d for _, d, _ in shapes[0]), micro_batch_size=self.batch,
                            dtype=_dtype_name(self.dtype), optimizer=self.optimizer, storages=storages)

    def _eval_working(self, unit: nn.Module, state: dict, arg: object) -> int:
        """The unit's new allocations in a forward-only step (eval mode, no_grad), on a copy of
        its input made outside the tracker (the training forward's input stays untouched)."""
        copy = tuple(t.detach().clone() for t in _as_tuple(arg, "a unit"))
        unit.eval()
        try:
            start = self.allocations.mark()
            with torch.no_grad(), self.allocations, self.precision or contextlib.nullcontext():
                torch.func.functional_call(unit, state, (copy[0] if isinstance(arg, torch.Tensor) else copy,))
            # Beyond the scratch allowed for the largest operand (as in training), CPU kernels
            # (oneDNN) reorder a convolution's activations as well as its weight, which a forward-only
            # step's peak, made of working memory alone, feels: one more copy of the largest activation
            return (self.allocations.peak_since(start) + self.allocations.scratch
                    + self.allocations.largest_activation)
        finally:
            unit.train()

    def _storages(self, boundary_keys: list[list[int]], nbytes: dict[int, int]) -> list[Storage]:
        crossings: dict[int, set[int]] = {}
        readers: dict[int, set[int]] = {}     # units that read a storage they take (not merely pass on)
        for b, keys in enumerate(boundary_keys):
            reads = getattr(self.units[b], "meta", {}).get(READS) if b < len(self.units) else ()
            for q, key in enumerate(keys):
                crossings.setdefault(key, set()).add(b - 1)
                if reads is None or q in reads:
                    readers.setdefault(key, set()).add(b)
        keys = list(self.saved) + [k for k in crossings if k not in self.saved]

        def size(k: int) -> int:
            full = self.saved[k][0] if k in self.saved else nbytes[k]
            if self.precision and k in self.precision.lowered and k not in crossings:
                return full * self.precision.dtype.itemsize // self.dtype.itemsize
            return full
        copies = [Storage(nbytes=n, savers=(u,), boundaries=()) for u, n in enumerate(self.copied) if n]
        return [Storage(nbytes=size(k), savers=tuple(sorted(self.saved[k][1])) if k in self.saved else (),
                        boundaries=tuple(sorted(crossings.get(k, ()))), readers=tuple(sorted(readers.get(k, ()))))
                for k in keys] + copies

    def _detached(self, previous: torch.Tensor | tuple) -> tuple[tuple[torch.Tensor, ...], object]:
        """Unit input cut off from the previous unit's graph (so backward runs per unit).

        A tensor that needs grad becomes a leaf plus a clone of it: the unit may modify the
        clone in place like it would modify a non-leaf. The clone is an alias of the
        original storage for the accounting, and is made outside the allocation tracker.
        """
        leaves, inputs = [], []
        for t in _as_tuple(previous, "a unit"):
            leaf = t.detach().requires_grad_(t.requires_grad)
            arg = leaf.clone() if leaf.requires_grad else leaf
            self.keys.alias(arg, t)
            leaves.append(leaf)
            inputs.append(arg)
        return tuple(leaves), inputs[0] if isinstance(previous, torch.Tensor) else tuple(inputs)

    def _check_batch(self, outputs: tuple[torch.Tensor, ...], i: int) -> None:
        for t in outputs:
            if t.dim() == 0 or t.shape[0] != self.batch:
                raise GemsError(f"unit {self.names[i]} returns a tensor of shape {tuple(t.shape)} whose first "
                                f"dimension is not the batch ({self.batch}): keep the batch first in every unit output")

    def _input_error(self, i: int, error: Exception) -> GemsError:
        return input_error(self.model_name, self.names[i], self.input_shape, error)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _fake_state(unit: nn.Module, dtype: torch.dtype, fmt: torch.memory_format = torch.contiguous_format
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Fake parameters and buffers of one unit, by shape (the real ones are never read); 4-D ones in ``fmt``."""
    def fake(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                           memory_format=fmt if t.dim() == 4 else torch.contiguous_format)
    params = {name: fake(p).requires_grad_(p.requires_grad) for name, p in unit.named_parameters()}
    buffers = {name: fake(b) for name, b in unit.named_buffers()}
    return params, buffers


def _as_tuple(x: object, what: str) -> tuple[torch.Tensor, ...]:
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and x and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    raise GemsError(f"{what} returns {type(x).__name__}, not a tensor or a tuple of tensors: "
                    "make every unit return tensors only")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
