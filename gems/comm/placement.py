"""Which device a rank uses: its node's ranks compare the GPUs they see (``placement``, collective
over MPI, or ``placement_by_store`` through a torch.distributed store where no MPI launched the
job), and ``local_device`` (pure) decides."""
from __future__ import annotations

import json
import os
import socket
from typing import Any, Sequence

import torch

from gems.errors import GemsError


def local_device(device: torch.device, local_rank: int, node: Sequence[tuple[int, dict[str, str]]],
                 allow_shared_gpu: bool = False, host: str = "this node") -> torch.device:
    """``device`` with a GPU index: which of its visible GPUs local rank ``local_rank`` uses.

    Pure (testable without CUDA): ``node`` holds, per local rank of the node, the number of
    GPUs it sees (``torch.cuda.device_count()``, which already counts only the devices
    ``CUDA_VISIBLE_DEVICES`` leaves) and its GPU environment (``CUDA_VISIBLE_DEVICES``,
    ``SLURM_STEP_GPUS``). A GPU is named as physically as that environment tells: Slurm's
    IDs when ``SLURM_STEP_GPUS`` lists exactly the GPUs this rank sees, else the entries of
    ``CUDA_VISIBLE_DEVICES``, else the index. Ranks that see the same GPUs share them in
    local-rank order: the i-th of them takes visible GPU i. So a launcher that gives every
    task GPUs of its own (Slurm ``--gpus-per-task``, or ``CUDA_VISIBLE_DEVICES`` set per rank)
    puts each rank on its visible device 0, and ranks that all see every GPU of the node
    (``mpiexec``, Slurm ``--gpus-per-node``) take cuda:<local rank>. More ranks than the GPUs
    they see is a GemsError unless ``allow_shared_gpu`` (then they take turns round the GPUs).
    A "cuda" that already has an index, or another device type, is returned as given."""
    if device.type != "cuda" or device.index is not None:
        return device

    def names(count: int, env: dict[str, str]) -> tuple[str, ...]:
        listed = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        step = [g.strip() for g in env.get("SLURM_STEP_GPUS", "").split(",") if g.strip()]
        if len(step) == count:
            return tuple(step)
        return tuple(listed[:count]) if "CUDA_VISIBLE_DEVICES" in env else tuple(map(str, range(count)))

    views = [names(count, env) for count, env in node]
    mine = views[local_rank]
    if not mine:
        env = node[local_rank][1]
        shown = f"={env['CUDA_VISIBLE_DEVICES']!r}" if "CUDA_VISIBLE_DEVICES" in env else " unset"
        raise GemsError(f"local rank {local_rank} on {host} sees no GPU (CUDA_VISIBLE_DEVICES{shown}): make a GPU "
                        "visible to every rank, or run on the CPU")
    sharing = [r for r, view in enumerate(views) if view == mine]
    if len(sharing) > len(mine) and not allow_shared_gpu:
        raise GemsError(f"{len(sharing)} ranks on {host} share {len(mine)} visible GPU{'s' * (len(mine) != 1)}; "
                        f"launch at most {len(mine)} rank{'s' * (len(mine) != 1)} per node, or pass "
                        "--allow-shared-gpu to place several ranks on one GPU")
    return torch.device("cuda", sharing.index(local_rank) % len(mine))


def placement(world, device: torch.device,
              allow_shared_gpu: bool = False) -> tuple[int, int, int, int, torch.device]:
    """(rank, size, local rank, local size, device) of this process in the MPI ``world``
    communicator; "local" = the ranks sharing this node. Makes the device current on CUDA.

    COLLECTIVE: the ranks of a node compare what they see (``local_device`` decides), and a
    placement that cannot work on any node raises the same GemsError on every rank, so no
    rank of a healthy node is left waiting for the others."""
    from mpi4py import MPI  # noqa: PLC0415 - base stays importable without an MPI library

    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    node, local_rank, local_size = local.allgather(_seen(device)), local.rank, local.size
    local.Free()
    device, problem = _decide(device, local_rank, node, allow_shared_gpu, MPI.Get_processor_name())
    return world.rank, world.size, local_rank, local_size, _placed(device, world.allgather(problem))


def placement_by_store(store: Any, rank: int, size: int, device: torch.device,
                       allow_shared_gpu: bool = False) -> tuple[int, int, int, int, torch.device]:
    """``placement`` where no MPI launched the job: the ranks exchange what they see through the
    torch.distributed ``store`` all of them reach (keys under ``gems/placement/``); the ranks of a
    node are those of one host name, in rank order. COLLECTIVE, like ``placement``."""
    host = socket.gethostname()
    store.set(f"gems/placement/seen/{rank}", json.dumps([host, _seen(device)]))
    everyone = [json.loads(store.get(f"gems/placement/seen/{r}")) for r in range(size)]
    local = [r for r, (name, _) in enumerate(everyone) if name == host]
    node = [tuple(everyone[r][1]) for r in local]
    local_rank = local.index(rank)
    device, problem = _decide(device, local_rank, node, allow_shared_gpu, host)
    store.set(f"gems/placement/problem/{rank}", json.dumps(problem))
    problems = [json.loads(store.get(f"gems/placement/problem/{r}")) for r in range(size)]
    return rank, size, local_rank, len(local), _placed(device, problems)


def _seen(device: torch.device) -> tuple[int, dict[str, str]]:
    """What this rank sees: its GPU count and GPU environment (``local_device``'s ``node`` entry)."""
    return (torch.cuda.device_count() if device.type == "cuda" else 0,
            {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS") if k in os.environ})


def _decide(device: torch.device, local_rank: int, node: Sequence[tuple[int, dict[str, str]]],
            allow_shared_gpu: bool, host: str) -> tuple[torch.device, str | None]:
    try:
        return local_device(device, local_rank, node, allow_shared_gpu, host), None
    except GemsError as error:
        return device, str(error)


def _placed(device: torch.device, problems: Sequence[str | None]) -> torch.device:
    """The device, made current; the first rank's problem raised alike on every rank if any had one."""
    found = [p for p in problems if p is not None]
    if found:
        raise GemsError(found[0])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device
