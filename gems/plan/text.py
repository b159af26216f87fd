"""A plan as text for people: ``Plan.table()``, printed by gems-plan and gems-train (the plan
comes in as an argument: this module imports no plan type, so nothing imports in a circle)."""
from __future__ import annotations

import math

from gems.plan.edges import edge_tensors
from gems.units import format_size


def table(plan) -> str:
    """A human summary: inputs, one row per stage and per position, the balance, the messages
    that carry more than one tensor or skip stages, the budget."""
    shape = "x".join(map(str, plan.input_shape))
    policed = any(p.kind != "none" for p in plan.policies)
    placed = bool(plan.state_host_bytes)   # some stage's model state in host memory (gems.partition.placement)
    lazy = any(p.gradient_bytes for p in plan.positions)   # gradients on the device only from a first backward
    lines = [
        f"model {plan.model_name}, input {shape}, batch {plan.batch_size} "
        f"({plan.micro_batch_size} per micro-batch), {plan.groups} group(s), {plan.dtype}"
        + (f" ({plan.amp} autocast)" if plan.amp != "none" else "")
        + (f", {plan.memory_format}" if plan.memory_format != "contiguous" else "") + f", {plan.optimizer}",
        f"schedule {plan.schedule}, {plan.stages} stages, {plan.micro_batches} micro-batch(es) per replica, "
        f"balanced by {plan.balance_by}"
        + (f"; order: {plan.order}" if plan.order else "") + ("; split backward" if plan.split_backward else ""),
        *_spatial(plan),
        "",
        _rows(["stage", "units", "first..last unit", "params", "policy"] + ["state"] * placed + ["activations/mb"]
              + ["w/o policy"] * policed + ["between halves/mb"] * plan.split_backward + ["output/mb", "GFLOP/mb"],
              [[str(s.stage), str(s.end_unit - s.first_unit), _span(s.unit_names), format_size(s.param_bytes),
                policy.label] + [_placement(policy)] * placed + [format_size(s.activation_bytes)]
               + [format_size(s.plain_activation_bytes)] * policed
               + [format_size(s.split_bytes)] * plan.split_backward
               + [format_size(s.output_bytes), f"{s.forward_flops / 1e9:.1f}"]
               for s, policy in zip(plan.stage_estimates, plan.policies)]),
        "",
        _rows(["position", "stages", "units", "params", "activations", "transient"]
              + ["grads (backward)"] * lazy + ["est. peak"]
              + ["w/o policy", "+s/step"] * policed + ["host (offload)"] * bool(plan.host_bytes)
              + ["host (state)", "swap up/down per step"] * placed + ["GFLOP/step"],
              [[str(p.position), ",".join(map(str, p.stages)), str(p.units), format_size(p.param_bytes),
                format_size(p.activation_bytes), format_size(p.transient_bytes)]
               + [format_size(p.gradient_bytes)] * lazy + [format_size(p.peak_bytes)]
               + [format_size(p.plain_peak_bytes), f"{p.extra_seconds:.3f}"] * policed
               + ([format_size(plan.host_bytes[p.position])] if plan.host_bytes else [])
               + ([format_size(plan.state_host_bytes[p.position]), _swap(plan, p)] if placed else [])
               + [f"{p.flops / 1e9:.1f}"] for p in plan.positions]),
        "",
        f"imbalance (max/mean {plan.balance_by} over positions): {plan.imbalance:.3f}",
    ]
    if plan.forward_bytes:
        need, position = plan.forward_worst(plan.batch_size)
        lines.append(f"forward-only steps (validation, prediction) of this batch: est. peak {format_size(need)} "
                     f"on position {position}")
    lines += _messages(plan)
    if plan.step_seconds is not None:
        without = f" with the policies, {plan.plain_step_seconds:.3f} s without" if policed else ""
        halos = " but for the tile groups' halos and gathers, inside a node" if plan.spatial_grid else ""
        host = ", host updates and copies back after the sync included" if placed else ""
        if any(p.state_placement == "host" for p in plan.policies):
            host = ", weight transfers and host updates included"
        lines.append(f"predicted step {plan.step_seconds:.3f} s{without} (at {plan.flops_per_second / 1e12:.2f} "
                     f"TFLOP/s sustained, network not counted{halos}{host})")
    besides = ""
    if plan.device_overhead:
        parts = ", ".join(f"{name} {format_size(n)}" for name, n in plan.device_overhead.items())
        lines.append(f"besides tensors, each rank holds {format_size(plan.overhead_bytes)} on its GPU: {parts} "
                     "(measured constants: gems.partition.overhead)")
        besides = f" plus {format_size(plan.overhead_bytes)} besides tensors"
    if plan.memory_budget is not None:
        worst = max(plan.positions, key=lambda p: p.peak_bytes)
        if plan.fits:
            on = f"{worst.position},{besides}" if besides else worst.position
            lines.append(f"fits: the largest peak, {format_size(worst.peak_bytes)} on position {on}, "
                         f"is within the budget of {format_size(plan.memory_budget)}")
        else:
            smallest = (f"; {plan.smallest_fitting_stages} stages would fit"
                        if plan.smallest_fitting_stages else "")
            lines.append(f"does not fit: position {worst.position} needs {format_size(worst.peak_bytes)}{besides}, "
                         f"over the budget of {format_size(plan.memory_budget)}{smallest}")
    lines += plan.notes
    return "\n".join(lines)


def _spatial(plan) -> list[str]:
    """The spatial part: its units, grid and the ranks it takes (world = groups x (K + (P - 1) x
    tile groups: the positions holding a stage with tiled units))."""
    if not plan.spatial_grid:
        return []
    rows, cols = plan.spatial_grid
    holders = [p.position for p in plan.positions if set(p.stages) & set(plan.tiled_stages)]
    world = plan.groups * (plan.stages + (plan.tiles - 1) * len(holders))
    names = plan.unit_names[:plan.spatial_end]
    n = len(plan.unit_names)
    suffix = (f" and the last stage's units [{plan.spatial_start}, {n}) "
              f"({_span(plan.unit_names[plan.spatial_start:])}, inputs scattered, output gathered)"
              if plan.spatial_start else "")
    return [f"spatial: stage 0's units [0, {plan.spatial_end}) ({_span(names)}){suffix} on a {rows}x{cols} tile grid: "
            f"{plan.tiles} ranks per tile group at position(s) {','.join(map(str, holders))} (estimates: the group's "
            f"first rank, which gathers the rest); world {world} ranks = {plan.groups} group(s) x ({plan.stages} + "
            f"{plan.tiles - 1} x {len(holders)})"]


def _messages(plan) -> list[str]:
    """The messages from stage to stage that carry several tensors or skip stages: a traced model's
    skip connections go straight from the stage that makes them to each stage that reads them."""
    edges = edge_tensors(plan.routes, [len(shapes) for shapes in plan.stage_output_shapes])
    shown = {e: [s for s, _, _ in items] for e, items in edges.items() if len(items) > 1 or e[1] > e[0] + 1}
    if not shown:
        return []
    lines = ["", "messages with more than one tensor or skipping stages (per micro-batch):"]
    rows = plan.micro_batch_size
    for (i, j), sources in shown.items():
        tensors = [(plan.stage_output_shapes[i][q], plan.stage_output_dtypes[i][q]) for q in sources]
        parts = [f"{'x'.join(map(str, [rows, *shape]))} {dtype} "
                 f"({format_size(rows * math.prod(shape) * _itemsize(dtype))})" for shape, dtype in tensors]
        lines.append(f"  stage {i} -> stage {j}{' (skip)' * (j > i + 1)}: " + ", ".join(parts))
    return lines


def _placement(policy) -> str:
    """Where a stage's model state lives; under "host", with its weight groups."""
    groups = len(policy.weight_groups)
    return f"host ({groups} group{'s' * (groups != 1)})" if policy.state_placement == "host" else policy.state_placement


def _swap(plan, position) -> str:
    """Model state a position moves per step, up / down (older plans: both ways together, per stage)."""
    if plan.swap_bytes:
        up, down = plan.swap_bytes[position.position]
        return f"{format_size(up)} / {format_size(down)}"
    return format_size(sum(plan.stage_estimates[s].swap_bytes for s in position.stages))


def _span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"


def _rows(header: list[str], rows: list[list[str]]) -> str:
    """Right-aligned columns (the first left-aligned)."""
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), *(line(r) for r in rows)])


def _itemsize(dtype: str) -> int:
    import torch  # noqa: PLC0415 - as in gems.plan.checks

    return getattr(torch, dtype).itemsize
