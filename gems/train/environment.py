"""What a run ran on, for its checkpoints' manifests: software versions, the world, its hosts and
devices.

    record(comm)   # COLLECTIVE: {"python": "3.11.7", "torch": "2.14.1", ..., "hosts": [...]}

Versions of Python, torch, CUDA and cuDNN (when present), the MPI library and mpi4py (when this
process loaded them), gems and its git commit (when it runs from a checkout); the world size, and
per rank its host and device, gathered once per launch.
"""
from __future__ import annotations

import platform
import socket
import subprocess
import sys
from pathlib import Path

import torch

import gems


def _commit() -> str | None:
    """The git commit of the checkout gems runs from, if it runs from one."""
    root = Path(gems.__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = done.stdout.strip() if done.returncode == 0 else ""
    return commit or None


def software() -> dict:
    """This process's versions (no communication)."""
    found = {"python": platform.python_version(), "torch": torch.__version__, "gems": gems.__version__,
             "gems_commit": _commit()}
    if torch.cuda.is_available():
        found["cuda"] = torch.version.cuda
        found["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if "mpi4py.MPI" in sys.modules:   # only where the launcher is MPI's: never load it here
        found["mpi4py"] = sys.modules["mpi4py"].__version__
        found["mpi"] = " ".join(sys.modules["mpi4py.MPI"].Get_library_version().splitlines()[0].split())
    return {k: v for k, v in found.items() if v is not None}


def record(comm) -> dict:
    """The environment record of a launch: rank 0's versions, the world, each rank's host and
    device. COLLECTIVE (every rank calls it once)."""
    device = comm.device
    named = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)
    ranks = comm.allgather_object((socket.gethostname(), named))
    return {**software(), "backend": comm.backend, "world": comm.size,
            "hosts": [host for host, _ in ranks], "devices": [dev for _, dev in ranks]}
