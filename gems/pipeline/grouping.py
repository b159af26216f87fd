"""Group-major runs (Harmony's grouping) of a stage whose parameters live on the host
(``--state-placement host``, ``Plan.swap_grouped``): the order in which the executor runs them.

A *visit* (``gems.schedule.visits``) is a run of one position's consecutive compute actions of one
stage in one direction; messages between them do not break it. Run group-major, each weight group
goes over every micro-batch of the visit while it is on the device, so it moves once per visit
instead of once per action. gpipe K = 2, m = 2, stage 1 in groups g0 g1 (F1.g0: micro-batch 1's
forward through group g0)::

    per action   recv0 F0 send0 recv1 F1 send1        g0 g1 | g0 g1    4 group loads
    group-major  recv0 F0.g0 recv1 F1.g0 | F0.g1 send0 F1.g1 send1     2 group loads

Receives (and messages of other stages) keep their place, with the first group's pass over each
micro-batch; the visit's own sends wait for the last group's pass over their micro-batch, as
``gems.schedule.visits.group_major`` prices it. A backward visit goes the other way: the last group
over every micro-batch first (starting from the loss or the received gradients), the first group
last, then the input gradients' sends. Each micro-batch's backward is cut at the group boundaries (the
tensors one group hands the next in its forward): the pass of group g starts from the gradients of
group g + 1's inputs and asks for those of its own inputs and of its parameters (``torch.autograd.grad``
over that part of the graph), whose gradients go straight to the host tier.

The arithmetic per micro-batch is unchanged, and every layer sees the micro-batches in the same order,
so the step equals the per-action one bit for bit (BatchNorm's statistics included) -- but a model that
draws random numbers (dropout) draws them in another order. A stage runs group-major when its forward's
checkpointed pieces each fit in one group, it offloads nothing (the boundaries would keep its offloaded
activations on the device) and its backward is not split; otherwise per action.
"""
from __future__ import annotations

from typing import NamedTuple

from gems.schedule import ir
from gems.schedule.visits import visits


class Step(NamedTuple):
    """One step of a group-major run: ``kind`` "action" (run action ``index`` as usual), "begin" / "end"
    (set up / finish compute action ``index``), "pass" (group ``group``'s share of compute action
    ``index``) or "release" (group ``group`` leaves the device)."""

    kind: str
    index: int = -1
    group: int = -1


def groupable(runner, stage: int, actions: list[ir.Action]) -> int:
    """The weight groups of ``stage`` (run by ``runner``, a ``StageRunner``) when it can run group-major
    (module docstring), else 0."""
    weights = runner.weights
    if weights is None or len(weights.groups) < 2 or runner.offload is not None:
        return 0
    if any(a.stage == stage and a.op in (ir.BACKWARD_INPUT, ir.BACKWARD_WEIGHT) for a in actions):
        return 0
    if runner.group_pieces(True) is None or runner.group_pieces(False) is None:
        return 0
    return len(weights.groups)


def group_major(actions: list[ir.Action], groups: dict[int, int]) -> dict[int, tuple[int, int, list[Step]]]:
    """{first index of each visit of a stage in ``groups`` ({stage: its weight groups, 2 or more}): (its
    last index, its stage, its steps)} of one position's action list (module docstring)."""
    runs: dict[int, tuple[int, int, list[Step]]] = {}
    for visit in visits(actions, grouped=True):
        n = groups.get(visit.stage, 0)
        if n < 2:
            continue
        first, last = visit.actions[0], visit.actions[-1]
        segment = range(first, last + 1)
        compute = list(visit.actions)
        order = list(range(n - 1, -1, -1)) if visit.backward else list(range(n))
        released = {j for j in segment if actions[j].op in ir.SENDS and actions[j].stage == visit.stage}
        steps: list[Step] = []
        for j in segment:   # the first group's pass, messages in place but the visit's own sends
            if j in compute:
                steps += [Step("begin", j), Step("pass", j, order[0])]
            elif j not in released:
                steps.append(Step("action", j))
        steps.append(Step("release", group=order[0]))
        for g in order[1:-1]:
            steps += [Step("pass", j, g) for j in compute] + [Step("release", group=g)]
        for j in segment:   # the last group's pass, each micro-batch's sends after it
            if j in compute:
                steps += [Step("pass", j, order[-1]), Step("end", j)]
            elif j in released:
                steps.append(Step("action", j))
        steps.append(Step("release", group=order[-1]))
        runs[first] = (last, visit.stage, steps)
    return runs
