"""Data-loading worker processes: how they start under MPI, and that they end with their rank.

Workers start through ``forkserver`` (``spawn`` where it is missing): forking an MPI process is unsafe.
The fork server imports torch, torchvision and the datasets once, so later loaders' workers start in
milliseconds.

A worker's parent is then the fork server, not the rank, and each worker holds the write end of the
server's "alive" pipe (multiprocessing passes it so that children may start processes too). So when a
rank dies without cleaning up (SIGKILL, the OOM killer), neither notices: torch's worker watchdog
compares the worker's parent with the fork server, which lives while the worker holds its pipe, and the
resource tracker lives while either does. A launcher that kills the rank's process group hides this;
a plain ``python`` run, or a launcher that reaps only the rank, would leave all three behind. Each
worker therefore watches its rank itself (``watch_rank``) and exits the moment the rank has ended; the
fork server and resource tracker then see their pipes close and end too.
"""
from __future__ import annotations

import functools
import multiprocessing
import os
import select
import signal
import threading
import time

__all__ = ["context", "start_server", "watch_rank"]

POLL_SECONDS = 0.5  # how often a worker looks for its rank where the system has no process descriptors
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)   # what stops a rank after a checkpoint (gems.train.trainer)


def context():
    """The multiprocessing context loaders' workers start from."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    forkserver = multiprocessing.get_context("forkserver")
    # Once the server runs this has no effect: the first loader's preload list holds for the process.
    forkserver.set_forkserver_preload(["__main__", "gems.train.datasets", "torchvision.transforms.v2"])
    return forkserver


def start_server() -> None:
    """Start the fork server now, in the background: its start-up (a fresh interpreter importing
    torch and torchvision, seconds) then overlaps the planning and the engine's set-up instead of
    delaying the first batch while the other ranks wait for this one.

    It starts (with the resource tracker it starts first) with the rank's stop signals blocked, and so
    do the workers forked from it: a launcher that signals every process of a job -- Slurm's ``scancel
    --signal=USR1``, its SIGTERM before a time limit, mpiexec forwarding a signal to the ranks' process
    groups -- would otherwise kill them while the rank saves its checkpoint, and the rank's exit would
    print the relaunched tracker's tracebacks (``KeyError: '/mp-...'``). They end with the rank
    (``watch_rank``, their pipes)."""
    if context().get_start_method() == "forkserver":
        from multiprocessing import forkserver  # noqa: PLC0415
        # a blocked signal stays blocked across fork and exec; this thread's own arrive once unblocked
        before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            forkserver.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


def watch_rank():
    """A loader's ``worker_init_fn``, made in the rank: the worker ends as soon as this process has."""
    return functools.partial(_end_with, os.getpid())


def _end_with(rank: int, worker_id: int) -> None:  # noqa: ARG001 - the DataLoader passes the worker's id
    threading.Thread(target=_wait_then_exit, args=(rank,), name="gems-rank-watch", daemon=True).start()


def _wait_then_exit(rank: int) -> None:
    # A process descriptor (Linux >= 5.3) becomes readable when the process ends: no polling, and no
    # mistaking a later process that reuses the id. Elsewhere, poll for the id.
    try:
        descriptor = os.pidfd_open(rank)
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError):
        while _alive(rank):
            time.sleep(POLL_SECONDS)
    else:
        select.select([descriptor], [], [])
    os._exit(0)  # the rank is gone: nobody will read what this worker makes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        pass
    return True
