"""Communication between the ranks of a gems job: the only package that talks MPI or torch.distributed.

    comm = gems.comm.create("mpi")                     # or "torch" (gloo on CPU, NCCL on CUDA)
    with comm.guard():                                 # any exception: one line, whole job aborted
        req = comm.irecv((buf_a, buf_b), src=0, tag=3) # buffers preallocated, filled in place
        comm.wait(req, "activations of micro-batch 3") # polls with back-off; CommTimeout if too long
        comm.allreduce(grads, mirror_group, "gradients of stage 1")

Every process is started by ``mpiexec -n N python ...`` (or ``srun``), for both backends: the
torch backend builds its process group from the MPI rank and size. The torch backend also starts
where no MPI library exists, under ``torchrun`` or a Slurm step without MPI (``gems.comm.launcher``
reads who the rank is from their variables; mpi4py is then never imported).

Waiting never blocks inside MPI or torch: ``Comm.wait`` tests the request, sleeps 50 us, tests,
sleeps 100 us, ... up to 2 ms, because MPI's blocking waits spin a core that an oversubscribed
node's computing ranks need, and because a loop can give up: after ``timeout`` seconds it raises
``CommTimeout`` naming the rank, the peer and the action, and ``Comm.guard`` aborts the job.

Messages: a tuple of tensors is one message per tensor, wire tag ``tag * 16 + index``; so at most
16 tensors per tuple and tags up to ``(TAG_UB - 15) // 16`` (MPICH: 33,554,431; torch: 134,217,727).
A tensor larger than ``MAX_MESSAGE_BYTES`` (just under 2 GiB; ``GEMS_MAX_MESSAGE_BYTES`` overrides
it) travels in consecutive pieces under its wire tag, unless MPI-4 large counts make that needless.
The torch backend starts each message with a header of its tag and byte sizes, checked on arrival
(NCCL ignores tags: a message posted out of order is an error, not swapped data), and posts a
message's tensors, and ``ibatch``'s operations, as one ``batch_isend_irecv`` group.

``comm.received`` counts the bytes of every point-to-point receive a rank posts, per tag, on every
backend (a plan prices what each rank receives per step: ``PositionEstimate.received_bytes``).
"""
from __future__ import annotations

import contextlib
import os
import socket

import torch

from gems.comm import launcher
from gems.comm.base import (TENSORS_PER_MESSAGE, Backoff, Comm, CommTimeout, Group, P2POp, Request, all_of,
                             usable_cores)
from gems.errors import GemsError

__all__ = ["create", "world_rank", "Comm", "Group", "Request", "all_of", "P2POp", "CommTimeout", "Backoff",
           "TENSORS_PER_MESSAGE", "default_threads", "configure_threads"]

BACKENDS = ("mpi", "torch")


def create(backend: str = "mpi", device: torch.device | str | None = None, timeout: float = 300.0,
           backoff: Backoff = Backoff(), allow_shared_gpu: bool = False) -> Comm:
    """The communicator of this process (COLLECTIVE: every rank calls it once, at start-up).

    ``device``: where this rank's tensors live (default: this rank's GPU when CUDA is present,
    else CPU); picks NCCL for the torch backend on CUDA. A bare "cuda" becomes the GPU this
    rank gets among those it sees (``gems.comm.placement.local_device``: cuda:<local rank> when
    every rank of the node sees every GPU, the rank's own device 0 when the launcher gave each
    rank its own); more ranks on a node than the GPUs they see is a GemsError, raised on every
    rank, unless ``allow_shared_gpu``. ``timeout``: seconds any single wait may last before
    CommTimeout (keep it above the longest compute between two messages). ``backoff``: the
    sleeps of the polling loop."""
    if backend not in BACKENDS:
        raise GemsError(f"unknown communication backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if not timeout > 0:
        raise GemsError(f"the communication timeout must be a positive number of seconds, got {timeout}")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if backend == "mpi":
        launcher.mpi()   # where no MPI library loads, the sentence that says what to do
        from gems.comm.mpi_backend import MPIComm

        return MPIComm(device, float(timeout), backoff, allow_shared_gpu)
    from gems.comm.torch_backend import TorchComm

    return TorchComm(device, float(timeout), backoff, allow_shared_gpu)


def world_rank() -> int:
    """This process's rank in the job as its launcher numbers it (MPI's, torchrun's or Slurm's
    variable; 0 without a launcher), e.g. to report an error that ``create`` raised on every rank
    once. Reads the environment only: it works where the communicator could not start."""
    names = (*launcher.MPI_VARIABLES, "RANK") + (("SLURM_PROCID",) if "SLURM_STEP_ID" in os.environ else ())
    for name in names:
        with contextlib.suppress(KeyError, ValueError):
            return int(os.environ[name])
    return 0


def default_threads(local_size: int, cores: int | None = None) -> int:
    """Intra-op threads for one of ``local_size`` ranks sharing ``cores`` cores (default: the
    cores this process may run on): an equal share, at least one."""
    cores = len(usable_cores()) if cores is None else cores
    return max(1, cores // max(1, local_size))


def configure_threads(comm: Comm) -> int:
    """Set torch's intra-op threads to this rank's share of its cores, unless OMP_NUM_THREADS is
    set; returns the thread count. COLLECTIVE (every rank calls it).

    The share counts only the ranks of this node whose allowed cores overlap ours: if the launcher
    pinned each rank to its own cores (srun --cpus-per-task), a rank uses all of them; if all
    ranks may run everywhere, they split the cores evenly. Oversubscribing cores with threads
    slows every rank down, most of all the ones on the pipeline's critical path."""
    mine = usable_cores()
    peers = comm.allgather_object((socket.gethostname(), sorted(mine)))
    if "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    host = socket.gethostname()
    sharing = sum(1 for h, cores in peers if h == host and mine.intersection(cores))
    threads = default_threads(sharing, len(mine))
    torch.set_num_threads(threads)
    return threads
