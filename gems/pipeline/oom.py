"""A rank running out of memory while training, in words that name the fix.

``OutOfMemory`` (a GemsError) replaces an allocator's failure: CUDA OOM, or the CPU allocator
failing, e.g. under ``gems-train --enforce-memory-budget``. The engine raises it in place of the
allocator's error, naming the rank, the action, the plan's estimate for the rank and what to
change, and ends the job with it (``Comm.fail``): peers are mid-step, so it cannot be caught
and training continued.
"""
from __future__ import annotations

import re
import resource

from gems.errors import GemsError
from gems.units import format_size

# How c10's DefaultCPUAllocator words a failed allocation (either, depending on how the system
# allocator failed); CUDA raises torch.OutOfMemoryError instead.
_CPU_ALLOCATOR_FAILURE = re.compile(r"DefaultCPUAllocator: (can't allocate memory|not enough memory)")
_ONEDNN_FAILURE = "could not create a primitive"
_REQUEST = re.compile(r"tried to allocate (\d+ bytes|\d+(?:\.\d+)? [KMGT]iB)", re.IGNORECASE)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator's failure: CUDA OOM, the CPU allocator's, or MemoryError;
    under a data limit (``--enforce-memory-budget``) also oneDNN failing to build a kernel, which
    it reports only as "could not create a primitive"."""
    import torch  # noqa: PLC0415 - the CLIs import this module and must start fast

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    limited = resource.getrlimit(resource.RLIMIT_DATA)[0] != resource.RLIM_INFINITY
    return bool(_CPU_ALLOCATOR_FAILURE.search(str(exc))) or (limited and str(exc) == _ONEDNN_FAILURE)


class OutOfMemory(GemsError):
    """Rank ``rank`` ran out of ``device`` memory in ``where`` (e.g. ``describe_action(a)``) while
    running ``position`` of ``plan``; ``cause`` is the allocator's error. The message quotes the
    plan's estimated peak and budget for that position and suggests, in order, more stages (the
    fewest the ranks can form, or more ranks), recomputation (unless all its stages recompute
    already) and smaller micro-batches."""

    def __init__(self, rank: int, device: str, where: str, plan, position: int, cause: BaseException) -> None:
        request = _REQUEST.search(str(cause))
        amount = ""
        if request:
            text = request.group(1)
            amount = f" allocating {format_size(int(text.split()[0])) if text.endswith('bytes') else text}"
        budget = (f"the budget is {format_size(plan.memory_budget)}" if plan.memory_budget is not None
                  else "no memory budget was given")
        least, world = max(plan.stages + 1, plan.smallest_fitting_stages or 0), plan.stages * plan.groups
        more = next((k for k in range(least, world + 1) if world % k == 0), None)
        fixes = [f"--stages {more}" if more else f"--stages {least} on a multiple of {least} ranks"]
        if not all(plan.policies[s].recompute for s in plan.positions[position].stages):
            fixes.append("--recompute auto")
        fixes.append(f"more --micro-batches (now {plan.micro_batches} of {plan.micro_batch_size} images)"
                     if plan.micro_batch_size > 1 else "a smaller --image-size")
        super().__init__(
            f"rank {rank} ran out of {device} memory{amount} in {where}; the plan estimates a peak of "
            f"{format_size(plan.positions[position].peak_bytes)} for its position {position} and {budget}: "
            f"use {', '.join(fixes[:-1])} or {fixes[-1]}")
