"""Profile a model unit by unit at the real input size without allocating it.

The model runs once, forward then backward, on fake tensors (``FakeTensorMode``): every
tensor has its real shape, dtype and storage but no data, so a ResNet-101 on 2048x2048
images profiles in seconds on a laptop. Three PyTorch tools do the measuring:

* ``saved_tensors_hooks`` sees every tensor autograd keeps for backward; we record its
  *storage* (views and in-place results share one) and which units keep it;
* ``FlopCounterMode`` counts forward and backward FLOPs;
* a small dispatch mode (``_Allocations``) watches storages being created and freed, which
  gives the working memory a unit needs on top of what it keeps (temporaries in forward,
  gradient buffers in backward).

Kernels also take scratch memory that no fake run can see (oneDNN reorders weights and
activations on the CPU, cuDNN takes workspace on the GPU). Working memory therefore allows
one copy of the largest tensor a convolution, batch norm or matmul touches, and one of the
largest parameter gradient (computed before it is accumulated). Against the CPU allocator
this lands within a few percent on whole models (``python -m gems.partition.accuracy``).

Activation bytes of any stage
-----------------------------
A stage [lo, hi) keeps, per micro-batch in flight, every storage that is

    saved by a unit inside the stage  |  or its input boundary  |  or its output boundary

counted once. The input boundary stays alive because the runtime keeps the received input
for the backward pass; the output boundary because backward starts from it. A storage
saved by a unit of the stage but made before the stage can only have reached the stage
through the input boundary, so the three sets describe exactly what the stage holds.
``ModelProfile.activation_matrix()`` evaluates this for all (lo, hi) at once.

Each unit runs on a detached copy of the previous unit's output (aliased back to it, so a
unit that modifies its input in place is still profiled as in the whole model), which
lets backward run unit by unit and measure each unit's gradient buffers separately.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from gems.errors import GemsError

# Optimizer state per trainable parameter, in parameter sizes.
OPTIMIZER_STATE = {"sgd": 1, "sgd-nomomentum": 0, "adam": 2, "adamw": 2}


@dataclass(frozen=True)
class UnitProfile:
    """One unit at one micro-batch size. Bytes and FLOPs are per micro-batch."""

    name: str
    param_bytes: int          # all parameters
    grad_bytes: int           # parameters that require grad (their .grad)
    optimizer_bytes: int      # optimizer state for those parameters
    buffer_bytes: int         # e.g. BatchNorm running statistics
    saved_bytes: int          # storages this unit keeps for backward (parameters excluded)
    output_shapes: tuple[tuple[int, ...], ...]   # per sample: batch dim dropped
    output_dtypes: tuple[str, ...]
    output_bytes: int         # what is sent to the next stage (sum of tensor sizes)
    forward_flops: int
    backward_flops: int
    forward_working: int      # peak of new allocations during its forward (outputs and saved included)
    backward_working: int     # output gradient + peak of new allocations during its backward

    @property
    def static_bytes(self) -> int:
        """Memory the unit holds whatever the micro-batch: parameters, gradients, state, buffers."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buffer_bytes


@dataclass(frozen=True)
class Storage:
    """A storage some unit saves for backward or passes on across a unit boundary.

    ``boundaries`` holds b for "in the output of unit b" (b = -1: the model input).
    """

    nbytes: int
    savers: tuple[int, ...]
    boundaries: tuple[int, ...]


@dataclass
class ModelProfile:
    """Per-unit profile plus the storages needed to price any stage exactly."""

    units: list[UnitProfile]
    input_shapes: tuple[tuple[int, ...], ...]   # per sample
    input_dtypes: tuple[str, ...]
    micro_batch_size: int
    dtype: str
    optimizer: str
    storages: list[Storage] = field(repr=False)
    _matrix: np.ndarray | None = field(default=None, repr=False, compare=False)
    _working: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.units)

    def activation_bytes(self, lo: int, hi: int) -> int:
        """Bytes stage [lo, hi) keeps per micro-batch in flight (see module docstring)."""
        return sum(s.nbytes for s in self.storages
                   if (lo - 1) in s.boundaries or (hi - 1) in s.boundaries
                   or any(lo <= u < hi for u in s.savers))

    def activation_matrix(self) -> np.ndarray:
        """A[lo, hi] = activation_bytes(lo, hi) for all 0 <= lo < hi <= n (float64, 0 elsewhere)."""
        if self._matrix is None:
            self._matrix = _activation_matrix(len(self.units), self.storages)
        return self._matrix

    def boundary_bytes(self) -> np.ndarray:
        """B[b + 1] = bytes of the storages crossing boundary b (the output of unit b; b = -1: input)."""
        out = np.zeros(len(self.units) + 1)
        for s in self.storages:
            for b in s.boundaries:
                out[b + 1] += s.nbytes
        return out

    def working_matrix(self) -> np.ndarray:
        """W[lo, hi] = how far the memory of one micro-batch's forward or backward through stage
        [lo, hi) rises above ``activation_bytes(lo, hi)`` (its temporaries and gradients).

        While unit u runs forward, the stage holds A[lo, u] (what units lo..u-1 keep, and u's
        input) plus u's new allocations. While u runs backward, what units after u saved is
        freed: the stage holds what units lo..u saved, its input and its output, plus u's
        gradients and temporaries. The peak is the max over u of both.
        """
        if self._working is None:
            A = self.activation_matrix()
            S = _activation_matrix(len(self.units), self.storages, with_output=False)
            B = self.boundary_bytes()
            fwd = np.array([u.forward_working for u in self.units], dtype=np.float64)
            bwd = np.array([u.backward_working for u in self.units], dtype=np.float64)
            n = len(self.units)
            W = np.zeros((n + 1, n + 1))
            for lo in range(n):
                before = np.concatenate([[B[lo]], A[lo, lo + 1:n]])      # A[lo, u] for u = lo..n-1
                after = A[lo, lo + 1:]                                   # A[lo, u + 1], i.e. A[lo, hi]
                forward = np.maximum.accumulate(before + fwd[lo:])
                backward = after + bwd[lo:]                             # u = hi - 1
                inner = np.maximum.accumulate(S[lo, lo + 1:] + bwd[lo:])  # u < hi - 1, plus the output:
                backward[1:] = np.maximum(backward[1:], inner[:-1] + B[lo + 2:])
                W[lo, lo + 1:] = np.maximum(np.maximum(forward, backward) - after, 0.0)
            self._working = W
        return self._working

    def unit_sums(self, attribute: str) -> np.ndarray:
        """Prefix sums of a per-unit quantity: S[hi] - S[lo] is its total over [lo, hi)."""
        values = [getattr(u, attribute) for u in self.units]
        return np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])


def _activation_matrix(n: int, storages: Sequence[Storage], with_output: bool = True) -> np.ndarray:
    """Vectorised ``activation_bytes`` for every segment (without the output boundary when
    ``with_output`` is False).

    A storage that never crosses a boundary is saved only by the unit that made it, so it
    adds to every segment containing that unit (prefix sums). The few storages that cross
    boundaries get an (n+1) x (n+1) mask each.
    """
    internal = np.zeros(n)
    out = np.zeros((n + 1, n + 1))
    lo = np.arange(n + 1)[:, None]
    hi = np.arange(n + 1)[None, :]
    for s in storages:
        if not s.boundaries:
            for u in s.savers:
                internal[u] += s.nbytes
            continue
        # next_saver[lo] = first saver >= lo (n + 1 when none): saved inside iff it is < hi.
        next_saver = np.full(n + 1, n + 1)
        for u in sorted(s.savers, reverse=True):
            next_saver[: u + 1] = u
        bounds = np.zeros(n + 1, dtype=bool)
        for b in s.boundaries:
            bounds[b + 1] = True  # boundary b is the input of segment lo = b+1 and output of hi = b+1
        mask = bounds[:, None] | (next_saver[:, None] < hi)
        if with_output:
            mask |= bounds[None, :]
        out += s.nbytes * mask
    prefix = np.concatenate([[0.0], np.cumsum(internal)])
    out += prefix[None, :] - prefix[:, None]
    out[lo >= hi] = 0.0
    return out


def profile(model: nn.Sequential, input_shape: Sequence[int], micro_batch_size: int,
            dtype: torch.dtype = torch.float32, optimizer: str = "sgd",
            model_name: str | None = None) -> ModelProfile:
    """Profile ``model`` (an nn.Sequential of units) on a fake micro-batch of
    ``micro_batch_size`` samples of ``input_shape`` (per sample, e.g. (3, 2048, 2048)).

    Parameters and buffers are faked too (in ``dtype`` when floating point), so neither the
    input nor the weights are allocated; the model may even live on the meta device.
    Raises GemsError when the model cannot take the input (e.g. an image too small).
    """
    if optimizer not in OPTIMIZER_STATE:
        raise GemsError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATE)}")
    if not isinstance(model, nn.Sequential) or len(model) == 0:
        raise GemsError("the model must be a non-empty nn.Sequential of units: build it with gems.models.build")
    names = [name for name, _ in model.named_children()]
    units = list(model)
    training = [u.training for u in units]
    try:
        for u in units:
            u.train()  # profile what training keeps: BatchNorm in batch-statistics mode
        with FakeTensorMode(allow_non_fake_inputs=True):
            return _Run(units, names, tuple(input_shape), micro_batch_size, dtype, optimizer,
                        model_name or "the model").result()
    finally:
        for u, was_training in zip(units, training):
            u.train(was_training)


class _Run:
    """One fake forward and backward of all units (call inside FakeTensorMode)."""

    def __init__(self, units: list[nn.Module], names: list[str], input_shape: tuple[int, ...], batch: int,
                 dtype: torch.dtype, optimizer: str, model_name: str) -> None:
        self.units, self.names, self.batch = units, names, batch
        self.input_shape, self.dtype, self.optimizer, self.model_name = input_shape, dtype, optimizer, model_name
        self.keys = _StorageKeys()
        self.allocations = _Allocations()
        self.flops = FlopCounterMode(display=False)
        self.params, self.buffers = zip(*(_fake_state(u, dtype) for u in units))
        self.static = {self.keys(t) for state in (*self.params, *self.buffers) for t in state.values()}
        self.saved: dict[int, tuple[int, set[int]]] = {}   # storage key -> (nbytes, saving units)
        self.unit = -1

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = self.keys(t)
        if key not in self.static:
            self.saved.setdefault(key, (_storage_bytes(t), set()))[1].add(self.unit)
        return t

    def result(self) -> ModelProfile:
        x = torch.empty((self.batch, *self.input_shape), dtype=self.dtype)
        n = len(self.units)
        boundaries = [_as_tuple(x, "the input")]   # boundaries[b + 1] = output of unit b
        leaves, fwd_flops, fwd_working = [], [], []
        previous: torch.Tensor | tuple = x
        for i, unit in enumerate(self.units):
            self.unit = i
            leaf, arg = self._detached(previous)
            start = self.allocations.mark()
            state = {**self.params[i], **self.buffers[i]}
            with self.flops, self.allocations, torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                try:
                    previous = torch.func.functional_call(unit, state, (arg,))
                except GemsError:
                    raise
                except (RuntimeError, ValueError, IndexError, TypeError) as error:
                    raise self._input_error(i, error) from None
            fwd_flops.append(self.flops.get_total_flops())
            fwd_working.append(self.allocations.peak_since(start) + self.allocations.largest_operand)
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
        nbytes = {self.keys(t): _storage_bytes(t) for b in boundaries for t in b}
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
            bwd_working[i] = (sum(_storage_bytes(g) for _, g in pairs) + self.allocations.peak_since(start, ignore)
                              + max((_tensor_bytes(g) for g in param_grads), default=0)
                              + self.allocations.largest_operand)
            grads = [leaf.grad for leaf in leaves[i]]
            outputs[i] = []
            del pairs, param_grads

        storages = self._storages(boundary_keys, nbytes)
        factor = OPTIMIZER_STATE[self.optimizer]
        profiles = []
        for i in range(n):
            trainable = sum(_tensor_bytes(p) for p in self.params[i].values() if p.requires_grad)
            out = shapes[i + 1]
            profiles.append(UnitProfile(
                name=self.names[i],
                param_bytes=sum(_tensor_bytes(p) for p in self.params[i].values()),
                grad_bytes=trainable,
                optimizer_bytes=factor * trainable,
                buffer_bytes=sum(_tensor_bytes(b) for b in self.buffers[i].values()),
                saved_bytes=sum(s.nbytes for s in storages if i in s.savers),
                output_shapes=tuple(shape for shape, _, _ in out),
                output_dtypes=tuple(dt for _, dt, _ in out),
                output_bytes=sum(b for _, _, b in out),
                forward_flops=int(fwd_flops[i]), backward_flops=int(bwd_flops[i]),
                forward_working=int(fwd_working[i]), backward_working=int(bwd_working[i]),
            ))
        return ModelProfile(units=profiles, input_shapes=tuple(s for s, _, _ in shapes[0]),
                            input_dtypes=tuple(d for _, d, _ in shapes[0]), micro_batch_size=self.batch,
                            dtype=_dtype_name(self.dtype), optimizer=self.optimizer, storages=storages)

    def _storages(self, boundary_keys: list[list[int]], nbytes: dict[int, int]) -> list[Storage]:
        crossings: dict[int, set[int]] = {}
        for b, keys in enumerate(boundary_keys):
            for key in keys:
                crossings.setdefault(key, set()).add(b - 1)
        keys = list(self.saved) + [k for k in crossings if k not in self.saved]
        return [Storage(nbytes=self.saved[k][0] if k in self.saved else nbytes[k],
                        savers=tuple(sorted(self.saved[k][1])) if k in self.saved else (),
                        boundaries=tuple(sorted(crossings.get(k, ()))))
                for k in keys]

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
        if isinstance(error, (DataDependentOutputException, DynamicOutputShapeException)):
            return GemsError(f"unit {self.names[i]} of {self.model_name} reads tensor values to decide shapes or "
                             f"control flow ({error}), which a fake-tensor profile cannot follow: make its forward "
                             "depend on tensor shapes only")
        shape = "x".join(str(d) for d in self.input_shape)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        small = any(words in reason.lower() for words in ("small", "more than 1 value", "greater than", "less than"))
        fix = "use a larger image size" if small else "use an input shape the model accepts"
        return GemsError(f"{self.model_name} cannot take {shape} input (unit {self.names[i]}: {reason}); {fix}")


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _StorageKeys:
    """Stable keys for storages (views share a key); ``alias`` makes a copy count as its original."""

    def __init__(self) -> None:
        self._alias: dict[int, int] = {}
        self._pinned: list[torch.UntypedStorage] = []   # aliased copies stay alive: their ids stay unique

    def __call__(self, t: torch.Tensor) -> int:
        key = id(t.untyped_storage())
        return self._alias.get(key, key)

    def alias(self, copy: torch.Tensor, original: torch.Tensor) -> None:
        storage = copy.untyped_storage()
        self._pinned.append(storage)
        self._alias[id(storage)] = self(original)


# Ops whose kernels take scratch memory the fake run cannot see (oneDNN reorders weights and
# activations to blocked layouts, cuDNN takes convolution workspace): a unit's working memory
# allows one copy of the largest tensor such an op reads or writes.
_WORKSPACE_OPS = {"convolution", "convolution_backward", "native_batch_norm", "native_batch_norm_backward",
                  "_native_batch_norm_legit", "_native_batch_norm_legit_functional", "mm", "addmm", "bmm",
                  "_batch_norm_with_update", "batch_norm_backward", "cudnn_convolution", "cudnn_batch_norm"}


class _Allocations(TorchDispatchMode):
    """Logs every storage created and freed while active: a live-bytes timeline.

    Each new storage gets a serial number; ``peak_since`` replays the log from a mark,
    optionally ignoring some storages (e.g. parameter gradients, counted as static memory).
    """

    def __init__(self) -> None:
        super().__init__()
        self._log: list[tuple[int, int]] = []      # (serial, +bytes / -bytes)
        self._serial: dict[int, int] = {}          # id(storage) -> serial, while alive
        self._next = 0
        self.largest_operand = 0                   # bytes of the largest tensor an op has read or written

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views, in-place and out= results reuse an input's storage: not an allocation.
        operands = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = {id(t.untyped_storage()) for t in operands}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                operands.append(t)
                storage = t.untyped_storage()
                if id(storage) not in self._serial and id(storage) not in inputs:
                    self._track(storage)
        if func.name().split("::")[-1].split(".")[0] in _WORKSPACE_OPS:
            self.largest_operand = max([self.largest_operand, *(_tensor_bytes(t) for t in operands)])
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        serial, nbytes, key = self._next, storage.nbytes(), id(storage)
        self._next += 1
        self._serial[key] = serial
        self._log.append((serial, nbytes))
        weakref.finalize(storage, self._free, key, serial, nbytes)

    def _free(self, key: int, serial: int, nbytes: int) -> None:
        if self._serial.get(key) == serial:
            del self._serial[key]
        self._log.append((serial, -nbytes))

    def mark(self) -> int:
        """Start a window: returns the log position, resets ``largest_operand``."""
        self.largest_operand = 0
        return len(self._log)

    def serials(self, tensors: Sequence[torch.Tensor]) -> set[int]:
        return {self._serial[id(t.untyped_storage())] for t in tensors if id(t.untyped_storage()) in self._serial}

    def peak_since(self, start: int, ignore: set[int] = frozenset()) -> int:
        live = peak = 0
        for serial, delta in self._log[start:]:
            if serial not in ignore:
                live += delta
                peak = max(peak, live)
        return peak


def _fake_state(unit: nn.Module, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Fake parameters and buffers of one unit, by shape (the real ones are never read)."""
    def fake(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype)
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


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
