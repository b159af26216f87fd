"""The host tier's update in a worker thread (``--state-placement host-optimizer`` and ``host``:
``gems.pipeline.hostopt``), so a rank posts its next step's first actions while the host updates.

On a rank whose every stage keeps its model state on the host, the step's update
(``optimizer.step()``, once the step-wide loss and norm have decided that it is applied and how
the gradients are clipped) is handed to one worker thread, and ``engine.step`` returns without waiting for it. The update is
*settled* -- waited for, the new parameters copied back to the device, the host gradients of the
parts whose weights live there cleared -- before anything reads or writes what it owns: the next
step's first compute action or weight prefetch (the receives and the loss normaliser before them
overlap it), an evaluation or prediction, the engine's state, the optimizer's ``zero_grad``,
``state_dict`` and ``load_state_dict``, the memory meter. The worker calls no MPI. A rank that also
holds a stage on the device (whose gradients' places the next step resets), or whose optimizer is
sharded (the new parameters go to the other members at once), updates within the step as before.

The update runs on a *frozen* view of the optimizer: the same parameters and state, each parameter
group's settings copied when it starts, so the learning rate the trainer (or a scheduler) writes
for the next step before ``engine.step`` cannot reach the update in flight: the arithmetic is the
synchronous one's, bit for bit. The update's own time is the host's; what a rank loses to it is
the wait when it settles, a span "host-update" inside the action that waits (``timed``).
"""
from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from gems.pipeline.hostopt import HostTier


class HostUpdate:
    """The update of ``tier``'s parts: at most one in flight, run by one worker thread (made at the first)."""

    def __init__(self, tier: HostTier) -> None:
        self.tier = tier
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._zero_later = False   # the step's end asked for the host gradients cleared: they were still read

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def launch(self, optimizer: torch.optim.Optimizer) -> None:
        """Start ``optimizer``'s step on the worker, its groups' settings as they are now."""
        self.settle()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="gems-host-update")
        frozen = _frozen(optimizer)
        if getattr(optimizer.step, "_wrapped_by_lr_sched", False):
            optimizer._opt_called = True   # what a scheduler's wrapper of step records (its order check)
        self._pending = self._pool.submit(type(optimizer).step, frozen)

    def settle(self) -> None:
        """Wait for the update in flight, if any (a span "host-update"), then copy the new parameters to
        the device and clear the host gradients if asked meanwhile; the worker's exception, if it raised,
        is raised here."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        with self.tier.timed("host-update"):
            pending.result()
        self.tier.copy_back()
        if self._zero_later:
            self._zero_later = False
            self.tier.zero_grads()

    def zero_grads(self) -> None:
        """The tier's ``zero_grads`` now, or once the update that reads the gradients is settled."""
        if self.pending:
            self._zero_later = True
        else:
            self.tier.zero_grads()

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.state_dict()`` and ``load_state_dict()`` settle first (its ``zero_grad``
        does through ``GradSync.keep_grads_in_bucket``)."""
        for name in ("state_dict", "load_state_dict"):
            method = getattr(optimizer, name)

            @functools.wraps(method)
            def settled(*args, method=method, **kwargs):
                self.settle()
                return method(*args, **kwargs)
            setattr(optimizer, name, settled)


def _frozen(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` with its parameter groups' settings copied: the same parameters, state and
    hooks. Its class's ``step`` runs on it as on the optimizer (torch.optim's steps read only
    ``param_groups``, ``state`` and ``defaults``), untouched by later writes to the groups."""
    frozen = object.__new__(type(optimizer))
    frozen.__dict__.update(optimizer.__dict__)
    frozen.param_groups = [dict(group) for group in optimizer.param_groups]
    return frozen
