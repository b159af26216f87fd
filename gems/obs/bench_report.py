"""gems-bench's report as text: throughput per schedule, the simulator's check, memory per rank.

Reads the report dict ``gems.bench.run`` returns (and writes as JSON), nothing else."""
from __future__ import annotations

from gems.obs import memory
from gems.units import format_size


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def table(report: dict) -> str:
    """The human-readable report: throughput, simulator and memory tables."""
    cfg, ref = report["config"], report["reference"]
    K, W = report["stages"], report["world"]
    net, task = report["network"], report["task"]
    targets = "per-pixel masks" if task["name"] == "segmentation" else "labels"
    lines = [f"gems-bench: {cfg['model']} {cfg['image_size']}x{cfg['image_size']}, batch {cfg['batch_size']}, "
             f"{task['name']} ({task['classes']} classes, synthetic {targets}, cross-entropy), "
             f"K={K}, {W} ranks x {report['threads']} thread(s), {report['device']}, "
             f"{cfg['steps']} steps after {cfg['warmup']} warm-up, medians; balance by {cfg['balance_by']}"
             + _split(cfg.get("split_backward"), report["schedules"])
             + (f"; --spatial {cfg['spatial']}: stage 0's first units on tile groups of {report['tiles']} ranks, "
                f"all {W} ranks counted in the physical limit" if cfg.get("spatial") else "")
             + ("" if report.get("load_average") is None else f"; load average at start {report['load_average']:.2f}")
             + f"; recipe (schedules and reference): {report.get('recipe', 'default')}"]
    if ref:
        lines.append(f"reference (1 rank, unpartitioned, batch {cfg['batch_size']}, {ref['threads']} thread(s)): "
                     f"{_ms(ref['step_time'])} ms/step, {ref['images_per_s']:.3f} images/s -> physical limit "
                     f"{W} x {ref['images_per_s']:.3f} = {W * ref['images_per_s']:.3f} images/s")
    top = report.get("ceiling")
    if top:
        grid = "x".join(map(str, top["grid"]))
        lines.append(f"no-communication ceiling (every rank the whole model on its own {grid} tile, plain "
                     f"PyTorch, all {W} at once): {_ms(top['step_time'])} ms/step, {top['images_per_s']:.3f} images/s")
    rows = [["schedule", "D", "m", "images/mb", "cuts", "tiles, units", "step ms", "images/s", "vs mp", "efficiency",
             *(["vs ceiling"] if top else []), "bubble (unequal busy)"]]
    for r in report["schedules"].values():
        rows.append([r["schedule"], str(r["groups"]), str(r["micro_batches"]), str(r["micro_batch_size"]),
                     ",".join(map(str, r["cuts"])), _tiles(r), _ms(r["step_time"]), f"{r['images_per_s']:.3f}",
                     "-" if r["ratio_to_mp"] is None else f"{r['ratio_to_mp']:.2f}x",
                     "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}",
                     *([f"{r['vs_ceiling']:.2f}" if r.get("vs_ceiling") else "-"] if top else []),
                     f"{r['bubble']:.1%} ({r.get('unequal_busy', 0.0):.1%})"])
    lines += ["", *_grid(rows)]
    lines += ["", f"simulator (gems.schedule.simulate) with per-stage times measured from the timelines; network by "
                  f"ping-pong: latency {net['latency'] * 1e6:.0f} us, bandwidth {net['bandwidth'] / 1e9:.2f} GB/s; "
                  + ("" if net.get("collective_bandwidth") is None else
                     f"collectives move {net['collective_bandwidth'] / 1e9:.2f} GB/s; ")
                  + ("allreduce additions free" if net.get("reduce_bandwidth") is None else
                     f"allreduce adds at {net['reduce_bandwidth'] / 1e9:.2f} GB/s")]
    rows = [["schedule", "forward ms/stage", "backward ms/stage", "optimizer ms (update)", "predicted ms",
             "measured ms", "error"]]
    for r in report["schedules"].values():
        rows.append([r["schedule"], "/".join(map(_ms, r["stage_forward"])), "/".join(map(_ms, r["stage_backward"])),
                     f"{_ms(r['optimizer_time'])} ({_ms(r.get('update_time', r['optimizer_time']))})",
                     _ms(r["predicted_step_time"]), _ms(r["step_time"]),
                     f"{r['simulator_error']:+.1%}"])
    lines += _grid(rows)
    where = "; under a spatial run, where each rank sits" if cfg.get("spatial") else ""
    lines += ["", f"peak memory per rank over one more step, measured ({report['memory_kind']}) / plan estimate "
                  f"(the estimate's error){where}"]
    rows = [["schedule", *(f"rank {i}" for i in range(W))]]
    for r in report["schedules"].values():
        rows.append([r["schedule"], *(_memory_cell(a, b) for a, b in zip(r["peak_memory"], r["plan_memory"]))])
        if r["spatial_grid"]:
            rows.append(["", *(memory.place(position, tile) for _, position, tile in r["placement"])])
    if ref:
        rows.append(["reference", _memory_cell(ref["peak_memory"], ref["plan_memory"]), *(["-"] * (W - 1))])
    lines += _grid(rows)
    return "\n".join(lines)


def _split(mode, schedules: dict) -> str:
    """The header's word on the split backward: forced, or which schedules the planner split (auto).
    ``mode`` is "auto", "on", "off" (a report written before auto: True or False)."""
    if mode == "auto":
        split = [r["schedule"] for r in schedules.values() if r.get("split_backward")]
        return f"; backward split where the planner predicts it faster (auto): {', '.join(split) or 'nowhere'}"
    return "; backward split" if mode in (True, "on") else ""


def _tiles(result: dict) -> str:
    """"2x1 [0,5)": the tile grid and the units it runs, "-" without a spatial part."""
    if not result["spatial_grid"]:
        return "-"
    rows, cols = result["spatial_grid"]
    return f"{rows}x{cols} [0,{result['spatial_end']})"


def _memory_cell(measured: int, estimated: int) -> str:
    return f"{format_size(measured)} / {format_size(estimated)} ({memory.estimate_error(measured, estimated)})"


def _grid(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            for row in rows]
