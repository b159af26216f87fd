"""The bookkeeping of the fake run (``gems.partition.profile``): which tensors share a
storage, and when storages are created and freed.

``StorageKeys`` names storages stably (views share a key; a copy can be made to count as its
original). ``Allocations``, a dispatch mode, logs every storage created and freed while it
is active, so the profile can replay the live bytes of any window (a unit's forward or
backward) and find its peak; it also records the largest operand of ops whose kernels take
scratch memory that no fake run can see (``WORKSPACE_OPS``).
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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
# allows one copy of the largest tensor such an op reads or writes.
WORKSPACE_OPS = {"convolution", "convolution_backward", "native_batch_norm", "native_batch_norm_backward",
                  "_native_batch_norm_legit", "_native_batch_norm_legit_functional", "mm", "addmm", "bmm",
                  "_batch_norm_with_update", "batch_norm_backward", "cudnn_convolution", "cudnn_batch_norm"}


class Allocations(TorchDispatchMode):
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
        if func.name().split("::")[-1].split(".")[0] in WORKSPACE_OPS:
            self.largest_operand = max([self.largest_operand, *(tensor_bytes(t) for t in operands)])
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


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

