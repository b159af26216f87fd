"""The bookkeeping of the fake run (``gems.partition.profile``): which tensors share a
storage, and when storages are created and freed.

``StorageKeys`` names storages stably (views share a key; a copy can be made to count as its
original). ``Allocations``, a dispatch mode, logs every storage created and freed while it
is active, so the profile can replay the live bytes of any window (a unit's forward or
backward) and find its peak; it also records the largest operand of ops whose kernels take
scratch memory that no fake run can see (``WORKSPACE_OPS``, ``scratch_bytes``). ``Precision``, another, follows
which storages ``torch.autocast`` would hold in its lower precision. ``WeightedOutputs``, a
third, adds up the outputs of the ops a trainable parameter enters.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gems.plan import formats


class StorageKeys:
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
# allows one copy of the largest tensor such an op reads or writes (``scratch_bytes``) ...
WORKSPACE_OPS = {"convolution", "convolution_backward", "native_batch_norm", "native_batch_norm_backward",
                  "_native_batch_norm_legit", "_native_batch_norm_legit_functional", "mm", "addmm", "bmm",
                  "_batch_norm_with_update", "batch_norm_backward", "cudnn_convolution", "cudnn_batch_norm"}


# ... except the backward of a spatial (k > 1), non-grouped convolution that computes its input's
# gradient, which holds a copy of its input and one of its output gradient at once (oneDNN:
# both in blocked layouts, channels padded to a multiple of BLOCK; measured beside the input
# gradient it makes, 3x an activation for a 64 -> 64 3x3 convolution, not 2x). A 1x1 convolution
# reorders nothing there, a depthwise one about one copy: they keep the one-copy allowance.
BLOCK = 16


def blocked_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` (N, C, ...) in a blocked layout: C padded to a multiple of ``BLOCK``."""
    if t.dim() < 3 or t.shape[1] == 0:
        return tensor_bytes(t)
    channels = t.shape[1]
    return tensor_bytes(t) // channels * (-(-channels // BLOCK) * BLOCK)


def scratch_bytes(name: str, args: tuple, operands: Sequence[torch.Tensor]) -> int:
    """Scratch memory allowed to one call of the workspace op ``name`` (see ``WORKSPACE_OPS``)."""
    largest = max((tensor_bytes(t) for t in operands), default=0)
    if any(t.dim() == 4 and formats.format_of(t) is torch.channels_last for t in operands):
        if name == "convolution_backward" and args[10][1]:
            return 2 * tensor_bytes(args[2])
        return 0
    if name == "convolution_backward":
        grad_output, x, weight, groups, mask = args[0], args[1], args[2], args[9], args[10]
        if mask[0] and groups == 1 and any(k > 1 for k in weight.shape[2:]):
            return max(largest, blocked_bytes(x) + blocked_bytes(grad_output))
    return largest


class Allocations(TorchDispatchMode):
    """Logs every storage created and freed while active: a live-bytes timeline.

    Each new storage gets a serial number; ``peak_since`` replays the log from a mark,
    optionally ignoring some storages (e.g. parameter gradients, counted as static memory).
    ``scratch`` is the most kernel scratch memory one workspace op of the window is allowed.
    """

    def __init__(self) -> None:
        super().__init__()
        self._log: list[tuple[int, int]] = []      # (serial, +bytes / -bytes)
        self._serial: dict[int, int] = {}          # id(storage) -> serial, while alive
        self._next = 0
        self.scratch = 0                           # bytes: the most a workspace op has been allowed
        self.largest_activation = 0                # ... of those not in ``static`` (parameters, buffers)
        self.static: set[int] = set()              # ids of the storages of parameters and buffers

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
        name = func.name().split("::")[-1].split(".")[0]
        if name in WORKSPACE_OPS:
            self.scratch = max(self.scratch, scratch_bytes(name, args, operands))
            self.largest_activation = max([self.largest_activation, *(
                tensor_bytes(t) for t in operands if id(t.untyped_storage()) not in self.static)])
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
        """Start a window: returns the log position, resets ``scratch`` and ``largest_activation``."""
        self.scratch = self.largest_activation = 0
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


class WeightedOutputs(TorchDispatchMode):
    """The first new output of every op that reads a trainable parameter (``trainable``: the ids
    of their storages): its gradient, arriving at that op, is what a split backward keeps between
    its halves (``gems.pipeline.splitgrad``); ``bytes(lowered, dtype)`` sums them, those whose
    storage key (``keys``) autocast holds in ``dtype`` (``Precision.lowered``) at its size, since
    a gradient has its tensor's dtype. Views of a parameter (a transposed weight) and in-place
    updates make no new storage and count nothing."""

    def __init__(self, trainable: set[int], keys: StorageKeys) -> None:
        super().__init__()
        self.trainable, self.keys = trainable, keys
        self.outputs: list[tuple[int, int, int]] = []   # (storage key, bytes, elements)

    def bytes(self, lowered: set[int] = frozenset(), dtype: torch.dtype | None = None) -> int:
        return sum(n * dtype.itemsize if dtype is not None and key in lowered else nbytes
                   for key, nbytes, n in self.outputs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        operands = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        if operands & self.trainable:
            first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
            if first is not None and id(first.untyped_storage()) not in operands and first.is_floating_point():
                self.outputs.append((self.keys(first), tensor_bytes(first), first.numel()))
        return out


# How autocast treats the ops a CNN reaches the dispatcher with (its CUDA op lists; nn.Conv2d
# arrives as convolution, nn.Linear as addmm or mm): these run in the lower precision, on copies
# of their full-precision inputs that they keep for backward ...
LOWER_PRECISION_OPS = {"convolution", "_convolution", "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv",
                       "addr"}
# ... these in float32 whatever their inputs; every other op in the precision of its inputs.
FLOAT32_OPS = {"_softmax", "_log_softmax", "native_layer_norm", "native_group_norm", "nll_loss_forward",
               "nll_loss2d_forward", "mse_loss", "l1_loss", "smooth_l1_loss", "binary_cross_entropy_with_logits",
               "kl_div", "exp", "expm1", "log", "log10", "log1p", "log2", "pow", "sum", "prod", "cumsum", "cumprod",
               "norm", "linalg_vector_norm", "rsqrt", "reciprocal", "softplus", "acos", "asin", "cosh", "sinh", "tan",
               "erfinv", "cdist", "_pdist_forward", "renorm"}


class Precision(TorchDispatchMode):
    """Follows which storages a forward under ``torch.autocast`` would hold in its lower
    precision, while the fake run itself stays in full precision.

    A storage is *lowered* when a lower-precision op makes it, or an op outside both lists whose
    floating activation inputs (parameters and buffers aside) are all lowered. ``copied`` adds
    up the bytes of the lower-precision copies autocast makes of a lower-precision op's
    full-precision inputs (weights, and activations not lowered yet), which that op keeps for
    backward. An approximation of autocast's own rules (module docstring of
    ``gems.partition.profile``)."""

    def __init__(self, keys: StorageKeys, static: set[int], dtype: torch.dtype) -> None:
        super().__init__()
        self.keys, self.static, self.dtype = keys, static, dtype
        self.lowered: set[int] = set()     # storage keys
        self.copied = 0                    # bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.name().split("::")[-1].split(".")[0]
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        activations = [t for t in inputs if self.keys(t) not in self.static]
        if name in LOWER_PRECISION_OPS:
            low = True
            self.copied += sum(t.numel() * self.dtype.itemsize for t in inputs
                               if self.keys(t) not in self.lowered and (t.dim() > 1 or self.keys(t) not in self.static))
        else:
            low = name not in FLOAT32_OPS and bool(activations) and all(self.keys(t) in self.lowered
                                                                        for t in activations)
        taken = {self.keys(t) for t in inputs}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and self.keys(t) not in taken:
                (self.lowered.add if low else self.lowered.discard)(self.keys(t))
        return out


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

