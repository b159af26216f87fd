"""What a rank holds on a GPU besides its tensors: the CUDA context and communicator buffers.

The plan's peaks count tensors, what ``torch.cuda.max_memory_allocated`` sees. A rank on a
GPU also holds memory outside the caching allocator, which ``--memory-budget`` must leave
room for:

* the CUDA context: the driver's state and the kernels loaded into it (torch's own, cuDNN,
  cuBLAS). Since CUDA 11.7 kernels load lazily (``CUDA_MODULE_LOADING=LAZY``, torch's
  default), so it grows with the kernels a step uses;
* NCCL's buffers (``--comm torch``): every communicator a rank takes part in allocates its
  own, for every channel it opens; more channels on faster links (NVLink, H100) mean more.

Both are measured constants, not derived, and approximate. ``make gpu-check`` re-measures the
context (``torch.cuda.mem_get_info`` against ``torch.cuda.memory_reserved`` after the steps of its
memory tests: "outside_allocator" in its report); NCCL's figure is still from public reports.

* ``CUDA_CONTEXT_BYTES``: measured by ``make gpu-check`` on an H200 (torch 2.11.0+cu130, CUDA
  13.0, 2026-11-26): 808255488 bytes (770.8 MiB) outside the caching allocator after resnet50
  training steps at 1024^2 and 2048^2 (the context with the convolution, batch-norm and GEMM
  kernels loaded, and cuBLAS/cuDNN's handles). Public figures are lower because they load less:
  287 MB for a first CUDA tensor with lazy loading (pytorch/pytorch#86509), 426 MiB on an RTX
  6000 Ada with torch 2.10 + CUDA 13.0 (unslothai/unsloth-zoo#1053). 771 MiB.
* ``NCCL_COMMUNICATOR_BYTES``: 544 MB for a communicator of two A100s over NVLink and 688 MB
  for one of more (NVIDIA/nccl#964, torch frontend, one 4 MB allreduce each); memory grows
  linearly with the channels and with each communicator, more on H100 NVLink than on PCIe
  (NVIDIA/nccl#986). 688 MiB per communicator.

With ``--comm mpi`` no NCCL communicator exists; MPI's own buffers (host memory, or a
CUDA-aware MPI's registrations) are not counted.
"""
from __future__ import annotations

from gems.schedule import generators as schedules
from gems.schedule.topology import Topology

CUDA_CONTEXT_BYTES = 771 * 2**20
NCCL_COMMUNICATOR_BYTES = 688 * 2**20
COMMS = ("mpi", "torch")


def communicators(schedule: str, K: int, groups: int, position: int) -> int:
    """NCCL communicators a rank at ``position`` takes part in under the torch backend: one per
    neighbour it exchanges boundaries with, one for its gradient-sync group when that has other
    ranks, and the job's default group (barriers, broadcasts) when there is more than one rank."""
    peers = {a.peer for a in schedules.schedule(schedule, K, 1)[position] if a.peer >= 0}
    sync = len(Topology(K * groups, K, schedule).sync_group(position)) > 1   # rank `position` of group 0
    return len(peers) + int(sync) + int(K * groups > 1)


def device_overhead(schedule: str, K: int, groups: int, comm: str) -> dict[str, int]:
    """Bytes a rank holds on its GPU besides tensors, by part, for the position that holds the
    most: the CUDA context, and with ``comm`` "torch" the NCCL communicators' buffers."""
    parts = {"CUDA context": CUDA_CONTEXT_BYTES}
    count = max(communicators(schedule, K, groups, p) for p in range(K)) if comm == "torch" else 0
    if count:
        parts[f"{count} NCCL communicator{'s' * (count != 1)}"] = count * NCCL_COMMUNICATOR_BYTES
    return parts
