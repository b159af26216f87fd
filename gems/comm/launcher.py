"""Who started this process: an MPI launcher, torchrun, or a Slurm step without MPI.

MPI stays the default and the design: under ``mpiexec`` (or ``srun --mpi=pmi2``) MPI tells every
rank who it is. The torch backend can also start where no MPI library exists, taking its identity
from the launcher's environment:

    torchrun       RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (LOCAL_RANK, LOCAL_WORLD_SIZE);
                   torch's ``env://`` rendezvous, which also joins the store torchrun's agent
                   already hosts (TORCHELASTIC_USE_AGENT_STORE)
    Slurm step     SLURM_STEP_ID set and none of an MPI launcher's variables: SLURM_PROCID,
                   SLURM_NTASKS, SLURM_LOCALID; the store on the first host of SLURM_STEP_NODELIST
                   (MASTER_ADDR overrides), at MASTER_PORT or a port derived from the job and step ids

Reads the environment it is given; MPI is loaded only by ``mpi()``, where the launcher is MPI's.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gems.errors import GemsError

# Set by MPI launchers (MPICH/Intel MPI's hydra, PMIx, Open MPI): MPI knows the rank.
MPI_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")
# A Slurm step's store port when MASTER_PORT is unset: distinct for 16 concurrent steps of a job
# and for 2,000 consecutive jobs on one node.
SLURM_PORT_BASE = 20000


@dataclass(frozen=True)
class Identity:
    """This process in a job started without MPI: its rank, the world's size, where the rendezvous
    store listens, and which launcher said so."""

    rank: int
    size: int
    master_addr: str
    master_port: int
    launcher: str     # "torchrun" or "slurm"


def _integer(env: Mapping[str, str], name: str, launcher: str) -> int:
    value = env.get(name)
    if value is None:
        raise GemsError(f"the {launcher} environment is incomplete: {name} is not set; launch with {launcher} "
                        "as documented, or with mpiexec")
    try:
        return int(value)
    except ValueError:
        raise GemsError(f"{name}={value!r} is not a whole number: the {launcher} environment is broken") from None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``node[07-09,12],gpu1`` -> ``node07``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise GemsError(f"SLURM_STEP_NODELIST={nodelist!r} names no host: set MASTER_ADDR to the first task's host")
    prefix, ranges = match.groups()
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def identity(env: Mapping[str, str] | None = None) -> Identity | None:
    """This process's identity from torchrun's or a Slurm step's variables; None when an MPI
    launcher started it or no launcher did (MPI then decides: a world of one without a launcher).
    An incomplete launcher environment is a GemsError naming the missing variable."""
    env = os.environ if env is None else env
    if any(name in env for name in MPI_VARIABLES):
        return None
    if "RANK" in env or "WORLD_SIZE" in env:
        rank, size = _integer(env, "RANK", "torchrun"), _integer(env, "WORLD_SIZE", "torchrun")
        if not env.get("MASTER_ADDR"):
            raise GemsError("the torchrun environment is incomplete: MASTER_ADDR is not set; launch with torchrun "
                            "(which sets it) or set MASTER_ADDR to rank 0's host")
        port = _integer(env, "MASTER_PORT", "torchrun")
        return _checked(Identity(rank, size, env["MASTER_ADDR"], port, "torchrun"))
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        rank, size = _integer(env, "SLURM_PROCID", "Slurm step"), _integer(env, "SLURM_NTASKS", "Slurm step")
        host = env.get("MASTER_ADDR")
        if not host:
            if not env.get("SLURM_STEP_NODELIST"):
                raise GemsError("the Slurm step environment is incomplete: SLURM_STEP_NODELIST is not set; run "
                                "inside srun, or set MASTER_ADDR to the first task's host")
            host = first_host(env["SLURM_STEP_NODELIST"])
        if env.get("MASTER_PORT"):
            port = _integer(env, "MASTER_PORT", "Slurm step")
        else:
            job, step = _integer(env, "SLURM_JOB_ID", "Slurm step"), _integer(env, "SLURM_STEP_ID", "Slurm step")
            port = SLURM_PORT_BASE + (job % 2000) * 16 + step % 16
        return _checked(Identity(rank, size, host, port, "slurm"))
    return None


def _checked(me: Identity) -> Identity:
    if me.size < 1 or not 0 <= me.rank < me.size:
        raise GemsError(f"rank {me.rank} of a world of {me.size} from {me.launcher}'s environment is not a rank "
                        "of that world: the launcher's variables disagree")
    if not 0 < me.master_port < 65536:
        raise GemsError(f"port {me.master_port} for the rendezvous is not a TCP port: set MASTER_PORT to one "
                        "between 1024 and 65535")
    return me


def mpi() -> Any:
    """mpi4py's ``MPI`` module, started; where no MPI library loads, a GemsError saying what to do."""
    try:
        from mpi4py import MPI  # noqa: PLC0415 - MPI starts only where the launcher is MPI's
    except (ImportError, RuntimeError, OSError) as error:
        raise GemsError(f"no MPI library loads here ({' '.join(str(error).split())[:160]}): install one (pip "
                        "install mpich, or your site's MPI with mpi4py built against it), or launch with torchrun "
                        "and --comm torch") from None
    return MPI
