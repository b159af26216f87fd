"""``--state-placement host`` priced: parameters in host memory, on the device per weight group
(Harmony's swapping, ZeRO-Infinity's parameter offload).

A host stage's model state is held in host memory as under ``host-optimizer`` (the optimizer's
state and update, host copies of the trainable parameters and of the gradient segment:
``StageEstimate.host_state_bytes``, ``gems.pipeline.hostweights``), and the device keeps only its
frozen parameters and buffers (BatchNorm statistics, which go down with the segment once per step).
Its units are cut into **weight groups** (``StagePolicy.weight_groups``): a group's trainable
parameters come to the device for each visit of the stage (``gems.schedule.visits``: every compute
action, or with grouping every run of consecutive forwards or backwards) and leave after it; its
gradients leave as its backward makes them, added into the host gradient. So per position, per step::

    device   frozen parameters and buffers, and the resident groups: on CUDA the largest group with
             its gradients, and the largest group's weights again for the next group, copied in
             meanwhile (``resident_bytes``, a bound; on CPU nothing is prefetched),
             plus activations and working memory as for any stage -- no optimizer state
    up       (forward + backward visits) x trainable parameters
    down     backward visits x gradients + the buffers once

Groups (``weight_groups``): consecutive units, each group closed once its weights reach
``MIN_GROUP_BYTES``. Group size does not change the bytes moved per visit -- every group moves
once -- only how much of them the device holds at once and how much of a visit's transfer hides
behind its compute: the next group's copy runs beside the current group's compute, the first
group's cannot. So groups are as small as a copy stays efficient (a copy of at least
``MIN_GROUP_BYTES`` runs a PCIe link near its full rate; smaller ones pay their latency and
launch): the least resident memory and the most overlap. If these groups do not fit the budget,
no larger ones would. A unit is never split: a unit larger than the floor is a group of its own.

Time (``gems.schedule.simulate``, from ``StageEstimate.group_bytes``): a visit's uploads run on
the host link at ``host_bandwidth``, each direction apart, the first group's exposed, the rest
overlapping the visit's compute; the gradients' copies down likewise. Activation offload uses the
same link; the simulator does not yet make the two queue behind each other. The host update
(``placement.HOST_UPDATE``) follows the step's sync, as for ``host-optimizer``; the updated parameters
need no copy back, the next visit brings them.
Grouping moves a stage's weights once per run of its consecutive forwards (backwards) on a rank instead
of once per action, but a micro-batch's output leaves only after every group but the last has run over
the whole run: fewer bytes, less pipelining. The plan keeps whichever the simulator predicts faster
(``faster_grouping``, ``Plan.swap_grouped``, for the runtime to follow); its note gives the other's volume.
"""
from __future__ import annotations

from collections.abc import Sequence

from gems.plan import Plan
from gems.schedule import ir
from gems.schedule.visits import visit_counts
from .backward import predicted_step
from .records import UnitProfile

SWAPPED = "host"
NOTE = "--state-placement host:"   # how the plan's note on the weight groups' transfers begins
MIN_GROUP_BYTES = 64 * 2**20


def weight_groups(units: Sequence[UnitProfile], first: int) -> list[list[int]]:
    """The weight groups of a stage of ``units`` starting at unit ``first`` (module docstring)."""
    groups: list[list[int]] = []
    size = MIN_GROUP_BYTES
    for u, unit in enumerate(units, start=first):
        if size >= MIN_GROUP_BYTES:
            groups.append([u, u + 1])
            size = 0
        groups[-1][1] = u + 1
        size += unit.grad_bytes   # its trainable parameters: what moves
    return groups


def group_bytes(units: Sequence[UnitProfile], groups: Sequence[Sequence[int]], first: int) -> list[int]:
    """Per group, the trainable parameters that come to the device per visit (as many bytes of gradients
    go back)."""
    return [sum(u.grad_bytes for u in units[lo - first:hi - first]) for lo, hi in groups]


def resident_bytes(held: Sequence[tuple[Sequence[UnitProfile], Sequence[Sequence[int]], int]], cuda: bool) -> int:
    """What the weight groups of a position's host stages hold on its device at most (``held``: per host
    stage, its units, its groups, its first unit): the largest group's weights -- each gradient leaves for
    the host as autograd makes it (the largest is priced as its unit's backward working memory):
    resnet18 64^2, gpipe K = 1, m = 1, 2, 4, one group: 67.32, 67.35, 58.49 MiB measured against 67.7
    priced --, and as much again where a stage has several groups, whose group-major backward
    (``gems.pipeline.grouping``) gets a group's gradients at once; on CUDA as much again for the
    gradients on their way out, and the largest group's weights once more for the next group, copied in
    meanwhile (where there is another; nothing is prefetched on CPU)."""
    weights = [size for units, groups, first in held for size in group_bytes(units, groups, first)]
    if cuda:
        return (3 if len(weights) > 1 else 2) * max(weights, default=0)
    several = any(len(groups) > 1 for _, groups, _ in held)
    return (2 if several else 1) * max(weights, default=0)


def swap_volume(actions: list[ir.Action], stages: dict[int, tuple[int, int]], grouped: bool) -> tuple[int, int]:
    """(up, down) bytes per step of one position's list for its host ``stages`` ({stage: (trainable
    parameter bytes, buffer bytes)}), as the module docstring counts them."""
    up = down = 0
    for s, (forward, backward) in visit_counts(actions, grouped).items():
        if s in stages:
            weights, buffers = stages[s]
            up += (forward + backward) * weights
            down += backward * weights + buffers
    return up, down


def faster_grouping(plan: Plan) -> bool:
    """Whether ``plan``'s step is shorter with its host stages' runs group-major (``Plan.swap_grouped``)
    than with each action a visit of its own: the predicted step (``gems.partition.backward``) both ways."""
    plan.swap_grouped = True
    grouped = predicted_step(plan)
    plan.swap_grouped = False
    return grouped < predicted_step(plan)
