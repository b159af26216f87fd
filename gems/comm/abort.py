"""How a failing rank ends the job: its one line, then MPI_Abort (or, launched without MPI, its own\nexit, which the launcher turns into the job's end), whatever blocks its exit."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import NoReturn

__all__ = ["ABORT_GRACE", "ABORT_DEADLINE", "failure_line", "mpi_abort", "exit_abort"]

ABORT_GRACE = 0.5  # seconds between printing the failure and aborting the job
ABORT_DEADLINE = 5  # seconds after MPI_Abort by which this process is gone, whatever blocks its exit


def mpi_abort(code: int) -> NoReturn:
    """End the job through MPI_Abort (the launcher tears down every rank) with exit ``code``.

    MPICH's MPI_Abort tells the launcher, then calls exit(), which runs the C atexit handlers and
    static destructors of every loaded library while other threads (progress, data loading,
    gloo) still run; one of them can block for ever, and a launcher told not to clean up
    (``-disable-auto-cleanup``, srun without --kill-on-bad-exit) leaves the process behind. An
    alarm whose default action ends the process needs neither the interpreter nor any lock."""
    from mpi4py import MPI

    _deadline()
    MPI.COMM_WORLD.Abort(code)
    os._exit(code)  # not reached: Abort ends the process


def exit_abort(code: int) -> NoReturn:
    """End this rank with exit ``code`` where no MPI launched the job (torchrun, srun without MPI):
    the launcher sees a failed worker and ends the others (torchrun's agent always, srun with
    --kill-on-bad-exit). NCCL's communicators are aborted first, so that no peer waits in a kernel
    for this rank; gloo's peers see its connections close."""
    import torch.distributed as dist

    _deadline()
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        with contextlib.suppress(Exception):  # ending the process is what matters
            abort()
    os._exit(code)


def _deadline() -> None:
    """Output flushed, and an alarm that ends the process after ``ABORT_DEADLINE`` seconds."""
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(ValueError):  # signal.signal only works on the main thread
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(ABORT_DEADLINE)


def failure_line(rank: int, exc: BaseException) -> str:
    """The one line a failing rank prints: ``gems: rank R failed: Type: message``."""
    message = " ".join(str(exc).split())
    return f"gems: rank {rank} failed: {type(exc).__name__}: {message}".rstrip()
