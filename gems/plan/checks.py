"""What a plan must satisfy before training runs it (``Plan.check``): one sentence naming the fix for
each way a plan -- a hand-edited or damaged JSON file above all -- can describe no layout. The plan's
vocabulary comes in as arguments: this module imports no plan type, so nothing imports in a circle."""
from __future__ import annotations

from gems.errors import GemsError


def check(plan, memory_formats: tuple[str, ...], placements: tuple[str, ...]) -> None:
    """Raise GemsError unless ``plan``'s cuts describe its ``stages`` non-empty stages of its units,
    with the shapes, estimates, policies, routes and spatial part that go with them; its memory format
    one of ``memory_formats``, each stage's state placement one of ``placements``."""
    n, K = len(plan.unit_names), plan.stages
    ok = (len(plan.cuts) == K + 1 and plan.cuts[0] == 0 and plan.cuts[-1] == n
          and all(a < b for a, b in zip(plan.cuts, plan.cuts[1:]))
          and len(plan.stage_output_shapes) == K and len(plan.stage_output_dtypes) == K)
    if not ok:
        raise GemsError(f"the plan's cuts {plan.cuts} do not split its {n} units into {K} non-empty stages: "
                        f"use {K + 1} increasing cut points from 0 to {n}")
    if not plan.input_shape or any(d <= 0 for d in plan.input_shape):
        raise GemsError(f"the plan's input shape {list(plan.input_shape)} is not a sample's shape (its sizes, each "
                        "at least 1, such as channels, height and width): regenerate it with gems-plan --json")
    if plan.fits is not None and plan.memory_budget is None:
        raise GemsError(f"the plan says whether it fits (fits: {str(plan.fits).lower()}) but has no memory budget: "
                        "give its memory_budget, set fits to null, or regenerate it with gems-plan --json")
    if len(plan.policies) != K:
        raise GemsError(f"the plan has {len(plan.policies)} stage policies for {K} stages: give one per stage")
    if plan.forward_bytes and len(plan.forward_bytes) != K:
        raise GemsError(f"the plan has {len(plan.forward_bytes)} forward-only figures for {K} positions: "
                        "regenerate it with gems-plan --json")
    if plan.routes and (len(plan.routes) != K or plan.routes[0] or any(
            not (isinstance(r, (list, tuple)) and len(r) == 3 and -1 <= r[0] < s
                 and (r[0] < 0 or 0 <= r[1] < len(plan.stage_output_shapes[r[0]])))
            for s, route in enumerate(plan.routes) for r in route)):
        raise GemsError("the plan's routes do not say where each stage's inputs come from: regenerate it "
                        "with gems-plan --json")
    if plan.host_bytes and len(plan.host_bytes) != K or plan.state_host_bytes and len(plan.state_host_bytes) != K:
        raise GemsError(f"the plan has {len(plan.host_bytes or plan.state_host_bytes)} host memory figures for {K} "
                        "positions: regenerate it with gems-plan --json")
    if len(plan.stage_estimates) != K or len(plan.positions) != K:
        raise GemsError(f"the plan has {len(plan.stage_estimates)} stage and {len(plan.positions)} position "
                        f"estimates for {K} stages: regenerate it with gems-plan --json")
    for s, e in enumerate(plan.stage_estimates):
        lo, hi = plan.cuts[s], plan.cuts[s + 1]
        if (e.first_unit, e.end_unit, list(e.unit_names)) != (lo, hi, list(plan.unit_names[lo:hi])):
            raise GemsError(f"the plan's estimate of stage {s} is not of its units {lo}..{hi - 1}: regenerate "
                            "it with gems-plan --json")
    for s, (shapes, dtypes) in enumerate(zip(plan.stage_output_shapes, plan.stage_output_dtypes)):
        if (not shapes or len(shapes) != len(dtypes) or any(d < 0 for shape in shapes for d in shape)
                or not all(_is_dtype(name) for name in dtypes)):
            raise GemsError(f"stage {s}'s output shapes {shapes} and dtypes {dtypes} do not describe tensors: "
                            "regenerate the plan with gems-plan --json")
    if plan.memory_format not in memory_formats:
        raise GemsError(f"the plan's memory format {plan.memory_format!r} is not one of {', '.join(memory_formats)}: "
                        "fix the plan or regenerate it with gems-plan --json")
    if plan.spatial_grid and not (len(plan.spatial_grid) == 2 and min(plan.spatial_grid) >= 1
                                  and 0 < plan.spatial_end <= plan.cuts[1]):
        raise GemsError(f"the plan's spatial part (grid {plan.spatial_grid}, end unit {plan.spatial_end}) is not a "
                        f"rows x cols grid with an end inside stage 0 (units 1..{plan.cuts[1]}): fix the plan or "
                        "regenerate it with gems-plan --spatial")
    if plan.spatial_start and not (plan.spatial_grid and max(plan.spatial_end, plan.cuts[-2]) <= plan.spatial_start
                                   < plan.cuts[-1]):
        raise GemsError(f"the plan's spatial suffix starts at unit {plan.spatial_start}, which is not inside the last "
                        f"stage (units {plan.cuts[-2]}..{plan.cuts[-1] - 1}) after the spatial prefix (ending at "
                        f"{plan.spatial_end}): fix the plan or regenerate it with gems-plan --spatial")
    for s, policy in enumerate(plan.policies):
        if policy.state_placement not in placements:
            raise GemsError(f"stage {s}'s state placement {policy.state_placement!r} is not one of "
                            f"{', '.join(placements)}: fix the plan's policies")
        lo, hi, end = plan.cuts[s], plan.cuts[s + 1], plan.cuts[s]
        _check_weight_groups(s, policy, lo, hi)
        for seg in policy.recompute:
            if not (isinstance(seg, (list, tuple)) and len(seg) == 2 and end <= seg[0] < seg[1] <= hi):
                raise GemsError(f"stage {s} recompute segment {seg} is not an increasing [first, end) unit range "
                                f"inside the stage's units [{lo}, {hi}): fix the plan's policies")
            end = seg[1]
            for edge in ([plan.spatial_end] if s == 0 and plan.spatial_grid else []) + (
                    [plan.spatial_start] if s == plan.stages - 1 and plan.spatial_start else []):
                if seg[0] < edge < seg[1]:
                    raise GemsError(f"stage {s} recompute segment {seg} crosses an edge of the spatial part (unit "
                                    f"{edge}): end the segment there or start it there")


def _is_dtype(name: str) -> bool:
    import torch  # noqa: PLC0415 - only plans read from files need it

    return isinstance(getattr(torch, name, None), torch.dtype)


def _check_weight_groups(s: int, policy, lo: int, hi: int) -> None:
    """GemsError unless stage ``s``'s weight groups (units ``[lo, hi)``) are empty, or, under the "host"
    placement, ``[first, end)`` unit ranges that cover the stage in order."""
    groups = policy.weight_groups
    if not groups:
        return
    if policy.state_placement != "host":
        raise GemsError(f"stage {s} has weight groups {groups} but its state placement is "
                        f"{policy.state_placement!r}: weight groups need state_placement \"host\", so drop them or "
                        "place the stage's state on the host")
    at = lo
    for group in groups:
        if not (isinstance(group, (list, tuple)) and len(group) == 2 and group[0] == at and at < group[1] <= hi):
            raise GemsError(f"stage {s}'s weight groups {groups} do not cover its units [{lo}, {hi}) in order: give "
                            f"[first, end) ranges, each starting where the last ended, from {lo} to {hi}")
        at = group[1]
    if at != hi:
        raise GemsError(f"stage {s}'s weight groups {groups} do not cover its units [{lo}, {hi}) in order: give "
                        f"[first, end) ranges, each starting where the last ended, from {lo} to {hi}")
