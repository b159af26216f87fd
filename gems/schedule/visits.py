"""Weight visits: when a stage whose parameters live in host memory (``--state-placement host``)
needs them on the device, read off one position's action list.

A stage's weights come to the device for each *visit* and leave after it. Without grouping every
compute action is a visit of its own; with grouping (Harmony's), a run of consecutive compute
actions of one stage in one direction -- forwards, or backwards (a split backward's input and
weight halves both count as backward) -- is one visit: the runtime runs the run group-major (each
weight group over every micro-batch of the run, then the next group), so each group's weights
move once per run. Messages between the run's actions do not break it; another stage's compute,
or the other direction, does. gpipe, K = 2, m = 4, position 1::

    F0 F1 F2 F3 B0 B1 B2 B3     ungrouped: 8 visits    grouped: 2 (one forward run, one backward run)

Group-major, a micro-batch's output is ready only when the run's last group has run over it, after
every other group has run over every micro-batch of the run: fewer transfers, less pipelining.
``group_major`` rewrites a list so for the simulator (``gems.schedule.simulate``), and ``transfer_seconds``
prices each visit's copies there. Pure Python: no torch.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from . import ir


class Visit(NamedTuple):
    """One visit: ``stage``, whether it is a backward one, and the indices of its compute actions."""

    stage: int
    backward: bool
    actions: tuple[int, ...]


def visits(actions: list[ir.Action], grouped: bool) -> list[Visit]:
    """The visits of one position's list, in order (module docstring)."""
    found: list[Visit] = []
    for i, a in enumerate(actions):
        if a.op not in ir.COMPUTE:
            continue
        backward = a.op != ir.FORWARD
        last = found[-1] if found else None
        if grouped and last is not None and (last.stage, last.backward) == (a.stage, backward):
            found[-1] = last._replace(actions=(*last.actions, i))
        else:
            found.append(Visit(a.stage, backward, (i,)))
    return found


def visit_counts(actions: list[ir.Action], grouped: bool) -> dict[int, tuple[int, int]]:
    """{stage: (forward visits, backward visits)} of one position's list."""
    counts: dict[int, tuple[int, int]] = {}
    for v in visits(actions, grouped):
        forward, backward = counts.get(v.stage, (0, 0))
        counts[v.stage] = (forward + (not v.backward), backward + v.backward)
    return counts


@dataclass(frozen=True)
class Part(ir.Action):
    """A share of one compute action: the pass of its first weight group (``part`` 0), of the middle ones
    (1) or of the last (2) over it, in a group-major run (``group_major``)."""

    part: int = 0
    share: float = 1.0


def group_major(lists: list[list[ir.Action]], groups: dict[int, int]) -> list[list[ir.Action]]:
    """``lists`` as the runtime runs the grouped visits of the stages in ``groups`` ({stage: its weight
    groups}, equal shares of the compute assumed): in each run of two or more actions, the first group
    over every micro-batch (receiving as before), the middle groups over every micro-batch, then the last
    group over every micro-batch, each followed by the sends its output releases (Fk.g: forward of
    micro-batch k through group g of 3)::

        recv F0 send recv F1 send   ->   recv F0.0 recv F1.0 | F0.1 F1.1 | F0.2 send F1.2 send
    """
    out = []
    for actions in lists:
        runs = {v.actions[0]: v for v in visits(actions, grouped=True)
                if groups.get(v.stage, 1) > 1 and len(v.actions) > 1}
        made: list[ir.Action] = []
        i = 0
        while i < len(actions):
            if i not in runs:
                made.append(actions[i])
                i += 1
                continue
            v, n = runs[i], groups[runs[i].stage]
            segment = actions[v.actions[0]:v.actions[-1] + 1]
            compute = [a for a in segment if a.op in ir.COMPUTE]
            released = [a.op in ir.SENDS and a.stage == v.stage for a in segment]
            made += [_part(a, 0, 1 / n) if a.op in ir.COMPUTE else a for a, r in zip(segment, released) if not r]
            made += [_part(a, 1, (n - 2) / n) for a in compute] if n > 2 else []
            made += [_part(a, 2, 1 / n) if a.op in ir.COMPUTE else a
                     for a, r in zip(segment, released) if a.op in ir.COMPUTE or r]
            i = v.actions[-1] + 1
        out.append(made)
    return out


def _part(a: ir.Action, part: int, share: float) -> Part:
    return Part(a.op, a.replica, a.micro, a.stage, a.peer, a.other, part, share)


def transfer_seconds(lists: list[list[ir.Action]], seconds: Callable[[ir.Action], float], uploads: list[list[float]],
                     download: list[float] | None, grouped: bool,
                     offload: Callable[[int, ir.Action], float] | None = None) -> dict[ir.Action, float]:
    """Seconds each visit of a stage whose ``uploads`` (per weight group, seconds to bring its weights to
    the device; empty: a stage on the device) adds to its first compute action: its first group's upload,
    exposed, and whatever the other groups' uploads (and, for a backward visit, the gradients' copies down,
    ``download``, on the link's other direction) take beyond the visit's compute (``seconds``), which
    they overlap. The host link is shared with activation offload: ``offload(position, action)`` gives the
    seconds a compute action's offloaded activations take on it (a forward's down, a backward's back up);
    what they take beyond the compute alone is the offload policy's own price, so a visit adds only what
    its weights' copies make exposed besides."""
    added = {}
    for p, actions in enumerate(lists):
        for v in visits(actions, grouped):
            up = uploads[v.stage]
            if up:
                compute = sum(seconds(actions[i]) for i in v.actions)
                down = download[v.stage] if v.backward and download else 0.0
                moved = sum(offload(p, actions[i]) for i in v.actions) if offload else 0.0
                shared_up, shared_down = (moved, 0.0) if v.backward else (0.0, moved)
                alone = max(0.0, moved - compute)
                added[actions[v.actions[0]]] = up[0] + max(0.0, sum(up[1:]) + shared_up - compute,
                                                           down + shared_down - compute) - alone
    return added
