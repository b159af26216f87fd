"""Whether to split the backward: ``plan(split_backward=None)``, ``--split-backward auto``.

Splitting each backward into an input-gradient and a later weight-gradient action
(``gems.pipeline.splitgrad``) lets the schedule put weight-gradients into bubbles, but it is not
always faster: the split orders of the schedule search (``gems.schedule.search``) are tuned for
balanced stages, and the input-gradient pass holds the gradients at each layer's output until
the weight-gradient pass (``CostModel.split``). So ``auto`` plans both ways and keeps

* the plan with the shorter predicted step (the simulator on the plan's stage costs, network
  not counted, as ``Plan.step_seconds``) among those that fit the memory budget on the fewest
  ranks (``--spatial auto`` tiles stage 0 on more ranks only where nothing fits without);
* the plan without the split on a tie (predicted steps within ``TIE``), when neither fits, or
  when the split one cannot be made -- it is the simpler one to run.

The simulator prices the two halves together as one backward; measured they cost more
(``benchmarks/split_backward.py``, resnet18 at 256^2 on 2 CPU threads: 72.0 ms against 61.4 ms,
1.17x), which a small predicted gain does not cover. That is one reason why ``plan()`` and the
commands leave the split off unless asked (``auto``, or on); the other is that existing callers
would silently get another schedule order than the one they asked for.
"""
from __future__ import annotations

from collections.abc import Callable

from gems.errors import GemsError
from gems.plan import Plan
from gems.schedule.network import IDEAL
from gems.schedule.simulate import costs_from_plan, simulate
from gems.schedule.topology import ranks_per_group
from gems.units import format_ms, format_size

# The words of --split-backward, and what plan(split_backward=...) makes of each (None: auto).
SPLIT_MODES: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
TIE = 1e-3   # relative: predicted steps closer than this (0.1%) are equal, and the split is not chosen


def split_mode(value: bool | str | None) -> bool | None:
    """``plan()``'s ``split_backward``: True / "on" (split), False / "off" (not), None / "auto"
    (the faster that fits); GemsError naming the choices for anything else."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in SPLIT_MODES:
        return SPLIT_MODES[value.strip().lower()]
    raise GemsError(f"split backward must be one of {', '.join(SPLIT_MODES)} (or True, False, None for auto), "
                    f"got {value!r}")


def predicted_step(plan: Plan, costs=None, order: str | None = None) -> float:
    """Seconds of one step of ``plan`` as ``Plan.step_seconds`` predicts it: its stage costs at
    its sustained rate (or ``costs``), every policy and spatial part counted, the network free, in
    its order (or the schedule search's ``order``)."""
    costs = costs_from_plan(plan, plan.flops_per_second, 1.0) if costs is None else costs
    return simulate(plan.schedule, plan.stages, plan.micro_batches, costs, IDEAL, plan.groups,
                    split=plan.split_backward, order=plan.order if order is None else order).step_time


def choose(planned: Callable[[bool], tuple[Plan, str]]) -> tuple[Plan, str]:
    """``planned(split)`` with the split or without it, whichever the module docstring says to keep,
    with a note saying which and why. ``planned`` returns a plan and what travels with it (the
    planner's reason why no spatial part helps); a GemsError making the plain plan is raised."""
    plain = planned(False)
    try:
        split = planned(True)
    except GemsError as error:
        plain[0].notes.append(f"backward not split (--split-backward auto): the split plan cannot be made: {error}")
        return plain
    chosen, note = _better(plain[0], split[0])
    chosen.notes.append(note)
    return split if chosen is split[0] else plain


def _better(plain: Plan, split: Plan) -> tuple[Plan, str]:
    """The plan to keep of the two, and the note saying why. A plan on more ranks (``--spatial
    auto`` tiled it to fit) is no rival to one on fewer, however fast."""
    t_plain, t_split = predicted_step(plain), predicted_step(split)
    times = f"predicted step {format_ms(t_split)} split, {format_ms(t_plain)} not split (network not counted)"
    fits_plain, fits_split = plain.fits is not False, split.fits is not False
    ranks_plain, ranks_split = _ranks(plain), _ranks(split)
    if fits_split and (not fits_plain or ranks_split < ranks_plain):
        why = "only the split plan fits the budget" if not fits_plain else (
            f"the split plan fits on {ranks_split} ranks per group, the other on {ranks_plain}")
        return split, f"backward split (--split-backward auto): {why}; {times}"
    if fits_split and ranks_split == ranks_plain and t_split < t_plain * (1 - TIE):
        return split, (f"backward split (--split-backward auto): {times}, "
                       f"{1 - t_split / t_plain:.1%} shorter")
    if not fits_plain:
        why = "neither plan fits the budget"
    elif not fits_split:
        worst = max(split.positions, key=lambda p: p.peak_bytes)
        why = (f"the split plan does not fit: position {worst.position} would need "
               f"{format_size(worst.peak_bytes + split.overhead_bytes)}, over the budget of "
               f"{format_size(split.memory_budget)}")
    elif ranks_split > ranks_plain:
        why = (f"the split plan fits only on {ranks_split} ranks per group (tile groups of {split.tiles}), "
               f"the other on {ranks_plain}")
    else:
        why = "splitting is no faster"
    return plain, f"backward not split (--split-backward auto): {why}; {times}"


def _ranks(plan: Plan) -> int:
    """Ranks of one group: K, and P - 1 more at each position that is a tile group."""
    return ranks_per_group(plan.stages, plan.schedule, plan.tiles, bool(plan.spatial_start))
