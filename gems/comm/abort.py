"""How a failing rank ends the job: its one line, then MPI_Abort, whatever blocks its exit."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import NoReturn

__all__ = ["ABORT_GRACE", "ABORT_DEADLINE", "failure_line", "mpi_abort"]

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

    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(ValueError):  # signal.signal only works on the main thread
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(ABORT_DEADLINE)
    MPI.COMM_WORLD.Abort(code)
    os._exit(code)  # not reached: Abort ends the process


def failure_line(rank: int, exc: BaseException) -> str:
    """The one line a failing rank prints: ``gems: rank R failed: Type: message``."""
    message = " ".join(str(exc).split())
    return f"gems: rank {rank} failed: {type(exc).__name__}: {message}".rstrip()
