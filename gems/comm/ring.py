"""A ring allreduce and allgather built from point-to-point messages, for large host buffers.

Why by hand: with the MPI this project installs (the mpich wheel), MPI_Iallreduce of 47 MB of
float32 (resnet18's gradients) between two ranks of one node took 18-19 ms, whatever
``MPIR_CVAR_(I)ALLREDUCE_INTRA_ALGORITHM`` chose, where this ring took 8 ms and one 23.5 MB
exchange 1.9 ms: mpich's collectives move large buffers through its shared-memory cells (a copy in,
a copy out, per step), its point-to-point messages of that size in a single copy. The ring is the
bandwidth-optimal algorithm NCCL and gloo use: every element crosses 2(n - 1)/n times.

Chunk k of the buffer is ``flat[bounds[k]:bounds[k + 1]]`` (any sizes, empty ones included);
member r of the n sends to r + 1 and receives from r - 1 (mod n)::

    reduce-scatter, step s = 0..n-2: send chunk r-1-s, receive chunk r-2-s into scratch, add it in
                                     -> member r holds the sum of chunk r
    allgather,      step s = 0..n-2: send chunk r-s, receive chunk r-1-s in place
                                     -> every member holds every chunk

Each chunk's sum is computed once, by its member, and copied to the others: every member ends
with the same bits. An allgather alone (``reduce=False``) hands each member's chunk to all; a
reduce-scatter alone (``gather=False``) leaves member r with the sum of chunk r only.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor


class Ring:
    """One ring operation of member ``me`` of ``n`` on ``flat`` (see the module docstring).

    ``exchange(send, into)`` starts sending ``send`` to the next member and receiving the previous
    member's message into ``into``, returning a handle; ``finished(handle)`` tests it without
    blocking. ``scratch``: a tensor of ``flat``'s dtype with room for the largest chunk (reduce
    only). ``start`` posts the first step, ``poll`` advances and says whether all is done."""

    def __init__(self, flat: Tensor, bounds: Sequence[int], me: int, exchange: Callable[[Tensor, Tensor], Any],
                 finished: Callable[[Any], bool], reduce: bool, scratch: Tensor | None = None,
                 gather: bool = True) -> None:
        self.flat, self.bounds, self.me, self.n = flat, list(bounds), me, len(bounds) - 1
        self.exchange, self.finished, self.scratch = exchange, finished, scratch
        rounds = self.n - 1
        self.steps = (([(True, s) for s in range(rounds)] if reduce else [])
                      + ([(False, s) for s in range(rounds)] if gather else []))
        self.k = 0
        self.handle: Any = None
        self.received: Tensor | None = None

    def chunk(self, i: int) -> Tensor:
        i %= self.n
        return self.flat[self.bounds[i]:self.bounds[i + 1]]

    def start(self) -> Any:
        """Post the first step (nothing for a ring of one); returns its handle."""
        if self.steps:
            self._post()
        return self.handle

    def _post(self) -> None:
        adding, s = self.steps[self.k]
        r = self.me
        if adding:
            send, self.received = self.chunk(r - 1 - s), self.scratch[:self.chunk(r - 2 - s).numel()]
        else:
            send, self.received = self.chunk(r - s), self.chunk(r - 1 - s)
        self.handle = self.exchange(send, self.received)

    def poll(self) -> bool:
        """Advance as far as the messages allow; True once every step is done."""
        while self.k < len(self.steps):
            if not self.finished(self.handle):
                return False
            adding, s = self.steps[self.k]
            if adding:
                self.chunk(self.me - 2 - s).add_(self.received)
            self.k += 1
            if self.k < len(self.steps):
                self._post()
        self.handle = self.received = None
        return True


def even_bounds(numel: int, n: int) -> list[int]:
    """n + 1 bounds cutting ``numel`` elements into n chunks of about equal size."""
    return [i * numel // n for i in range(n + 1)]


class Scratch:
    """Receive buffers of finished rings, for the next ones: a fresh large buffer costs a page
    fault per page on first touch (the CPU allocator does not cache)."""

    def __init__(self) -> None:
        self._free: list[Tensor] = []

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        fits = [i for i, t in enumerate(self._free) if t.dtype == dtype and t.numel() >= numel]
        if not fits:
            return torch.empty(numel, dtype=dtype)
        return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))

    def give(self, buf: Tensor) -> None:
        self._free.append(buf)
