"""gems-plan: how a model splits into pipeline stages, and what each position will need.

    gems-plan --model resnet101 --image-size 2048 --batch-size 2 --stages 4 --schedule mast
    gems-plan --model resnet101 --image-size 2048 --batch-size 2 --stages 4 --memory-budget 40GiB
    gems-plan --model my_net.py:build --image-size 1024x768 --stages 3 --balance 4,6,5 --json plan.json
    gems-plan --model timm:convnext_small --model-arg drop_path_rate=0.1 --image-size 2048 --stages 4
    gems-plan --model resnet101 --image-size 2048 --batch-size 2 --stages 4 --memory-budget 16GiB \
              --recompute auto --offload auto
    gems-plan --model resnet101 --image-size 2048 --batch-size 2 --stages 4 --memory-budget 80GiB \
              --comm torch --amp bf16 --calibrate --simulate      # on the GPU machine itself
    gems-plan --model torchvision:resnet50 --image-size 16384 --batch-size 2 --stages 2 --schedule mast \
              --recompute auto --memory-budget 80GiB --spatial 4  # stage 0's first units on 4 tiles each
    gems-plan --model resnet18 --image-size 512 --batch-size 8 --stages 4 --split-backward auto
    gems-plan --model resnet50 --image-size 16384 --batch-size 2 --sweep 16 --memory-budget 80GiB \
              --recompute auto --json plan.json   # the fastest layout on 16 ranks, tile groups included

The model is profiled on fake tensors (nothing of its real size is allocated), so this runs
on a laptop for any image size. --json writes the plan that ``gems-train --plan`` can use.
Speeds default to a V100 on PCIe 3; --calibrate measures this machine's device instead
(``gems.partition.calibrate``). --comm adds what a rank holds on a GPU besides tensors
(``gems.partition.overhead``). --spatial runs stage 0's first units on tile groups of P ranks
(``gems.partition.spatial``); with --memory-budget and no --spatial, it is tried when nothing
else fits (``auto``). --split-backward auto plans with and without the split backward and keeps the
faster that fits (``gems.partition.backward``); the table's last lines say which and why.
--sweep RANKS plans every layout on that many ranks, tile groups included (``gems.partition.sweep``),
and prints the fastest that fits with its ``mpiexec -n`` and flags.
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Sequence

from gems.cli import checked, parser, run
from gems.errors import GemsError
from gems.plan import PLACEMENT_CHOICES
from gems.schedule.network import V100_CLUSTER
from gems.train.config import (HOST_BUDGET_HELP, MAX_CLASSES, MAX_INPUT_ELEMENTS, MODEL_ARG_HELP, MODEL_HELP,
                               PLACEMENT_HELP, Recipe, model_kwargs)
from gems.units import format_size, parse_size

PROG = "gems-plan"


def image_size(text: str) -> tuple[int, int]:
    """"2048" -> (2048, 2048); "1024x768" -> (1024, 768) (height x width)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?", text)
    if not match or int(match.group(1)) < 1 or (match.group(2) and int(match.group(2)) < 1):
        raise GemsError(f"image size {text!r} must be N or HxW with positive integers, e.g. 2048 or 1024x768")
    height = int(match.group(1))
    return height, int(match.group(2) or height)


def unit_counts(text: str) -> list[int]:
    """"3,5,4" -> [3, 5, 4]."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(c < 1 for c in counts):
        raise GemsError(f"balance {text!r} must be positive unit counts separated by commas, e.g. 3,5,4")
    return counts


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise GemsError(f"{text!r} is not a positive integer")
    return value


def whole(text: str) -> int:
    """A unit number, 0 included."""
    if not text.strip().isdecimal():
        raise GemsError(f"{text!r} is not a whole number: give a unit number, or 0")
    return int(text)


def class_count(text: str) -> int:
    value = positive(text)
    if value > MAX_CLASSES:
        raise GemsError(f"{text} classes are more than {MAX_CLASSES}, beyond which tensor sizes overflow")
    return value


def build_parser() -> argparse.ArgumentParser:
    from gems.partition import BALANCE_BY, OPTIMIZER_STATE
    from gems.partition.backward import SPLIT_MODES
    from gems.partition.options import MODES, parse_bandwidth
    from gems.partition.overhead import COMMS
    from gems.partition.planner import AMP
    from gems.partition.spatial import parse_spatial
    from gems.schedule.generators import SCHEDULES

    p = parser(PROG, "Profile a model at its real input size and cut it into pipeline stages.")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE", help=MODEL_ARG_HELP)
    p.add_argument("--image-size", required=True, type=checked(image_size), metavar="N|HxW",
                   help="input image size: N means 3xNxN")
    p.add_argument("--channels", type=checked(positive), default=3, help="image channels")
    p.add_argument("--batch-size", required=True, type=checked(positive),
                   help="images per optimizer step over the whole job")
    p.add_argument("--stages", type=checked(positive), help="K, stages per pipeline (required unless --sweep)")
    p.add_argument("--schedule", default="mast", choices=SCHEDULES)
    p.add_argument("--micro-batches", type=checked(positive), default=1, help="m, per replica per step")
    p.add_argument("--split-backward", nargs="?", const="on", default="off", choices=list(SPLIT_MODES),
                   help="split each backward into input- and weight-gradient actions, weight-gradients filling "
                        "bubbles: on (the flag alone), off, or auto (plan both ways, keep the faster that fits)")
    p.add_argument("--shard-optimizer", action="store_true",
                   help="each rank of a sync group updates a share of the parameters and keeps only their "
                        "optimizer state (priced so)")
    p.add_argument("--state-placement", default="device", choices=PLACEMENT_CHOICES, help=PLACEMENT_HELP)
    p.add_argument("--host-memory-budget", type=checked(parse_size), metavar="SIZE", help=HOST_BUDGET_HELP)
    p.add_argument("--groups", type=checked(positive), default=1, help="data-parallel groups")
    p.add_argument("--balance-by", default="memory", choices=BALANCE_BY)
    p.add_argument("--balance", type=checked(unit_counts), metavar="N0,N1,...",
                   help="units per stage, instead of solving")
    p.add_argument("--split-points", type=lambda text: [t.strip() for t in text.split(",") if t.strip()],
                   metavar="PATH,...", help="module paths where stages 2, 3, ... begin (e.g. encoder.layer3,"
                                            "decoder.blocks.1), instead of solving")
    p.add_argument("--leaf-module", action="append", default=[], metavar="NAME",
                   help="a module path or class name traced as one unit, never cut inside (repeatable)")
    p.add_argument("--memory-budget", type=checked(parse_size), metavar="SIZE",
                   help="memory per device, e.g. 40GiB (binary) or 40GB (decimal)")
    p.add_argument("--spatial", type=checked(parse_spatial), metavar="P|RxC|auto",
                   help="run stage 0's first units on a tile group of P ranks (the grid with the least halo traffic) "
                        "or of an RxC grid, at every position holding stage 0; auto tries P = 2, 4, 8, 16 when no "
                        "plan without tiles fits; none given: auto with --memory-budget")
    p.add_argument("--spatial-end", type=checked(positive), metavar="UNITS",
                   help="the spatial part is units [0, UNITS) (default: where the plan is best)")
    p.add_argument("--spatial-start", type=checked(whole), metavar="UNIT",
                   help="also tile the last stage's units from UNIT on (a U-Net's full-resolution decoder); under "
                        "gpipe, 1f1b or mp with 2+ stages the last position becomes a tile group too (P - 1 more "
                        "ranks); 0: no such suffix (default: with one stage or mast where the plan is best, else none)")
    p.add_argument("--recompute", default="none", choices=MODES,
                   help="recompute activations in backward instead of keeping them: on every stage (all), "
                        "or only where --memory-budget needs it (auto)")
    p.add_argument("--offload", default="none", choices=MODES,
                   help="keep saved activations in host memory until backward: all, or auto as --recompute")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="where the stages will run (offloading from a CPU device saves nothing)")
    p.add_argument("--host-bandwidth", type=checked(parse_bandwidth), metavar="RATE",
                   help="device-to-host copy rate for --offload, e.g. 25e9; none given: 12GB/s (PCIe 3 x16), or "
                        "the measured rate with --calibrate")
    p.add_argument("--optimizer", default="sgd", choices=list(OPTIMIZER_STATE))
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--amp", default="none", choices=list(AMP),
                   help="price activations as gems-train --amp keeps them (bf16: forwards under autocast)")
    p.add_argument("--compile", action="store_true",
                   help="plan for units compiled as gems-train --compile runs them: the backward is never split "
                        "(a compiled unit's backward is one autograd node)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="plan for stages in channels_last (NHWC) memory format, as gems-train --channels-last runs "
                        "them (default: yes for --device cuda, no for cpu)")
    p.add_argument("--comm", choices=COMMS,
                   help="the transport gems-train will use (its --comm): on a cuda device, adds what every rank "
                        "holds besides tensors (CUDA context; NCCL buffers for torch) and counts it against "
                        "--memory-budget")
    p.add_argument("--num-classes", type=checked(class_count), default=1000)
    p.add_argument("--measure-time", action="store_true",
                   help="time every unit on this machine (CUDA if present) at the real size, for --balance-by time; "
                        "without it, time is estimated from FLOPs")
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON")
    p.add_argument("--plan-png", metavar="FILE",
                   help="draw the plan as a PNG: per position, its estimated peak split into parameters, gradients, "
                        "optimizer state, activations, messages and working memory (with the budget), and one "
                        "simulated step per position (needs matplotlib: the 'plot' extra)")
    p.add_argument("--simulate", action="store_true",
                   help="predict step time, throughput and bubbles of this plan and of every schedule "
                        "at the same K and m (gems.schedule.simulate)")
    p.add_argument("--sweep", type=checked(positive), metavar="RANKS",
                   help="plan and simulate every schedule, K dividing RANKS, m in 1,2,4,8, tile groups of P = 2, 4, "
                        "8, 16 where no plan without fits or ranks would be idle (only --spatial's, if given), and "
                        "the most groups D with D x ranks per group <= RANKS over which --batch-size splits (under "
                        "--memory-budget, with --recompute/--offload as given); recommend the fastest that fits, "
                        "with its launch size and flags (--json writes its plan)")
    p.add_argument("--device-tflops", type=float,
                   help="device peak rate, for --simulate and the time of policies; none given: a V100's fp32 peak, "
                        "15.7, or the measured rate with --calibrate")
    p.add_argument("--efficiency", type=float,
                   help="fraction of the peak the kernels reach; none given: 0.4, or 1 with --calibrate, whose rate "
                        "is already sustained")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine's --device (sustained TFLOP/s of a convolution; host-link bandwidth "
                        "on CUDA) and its CPU's optimizer updates (for --state-placement host-optimizer and host), "
                        "and plan with the figures instead of the V100 / PCIe 3 defaults")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(PROG, lambda: _plan(args))


def _speeds(args: argparse.Namespace) -> None:
    """Fill in the device rate, efficiency and host bandwidth the user left out: measured with
    --calibrate (printing what was measured), else a V100 on PCIe 3."""
    import torch

    from gems.partition.calibrate import calibrate
    from gems.partition.options import HOST_BANDWIDTH
    from gems.partition.planner import AMP
    from gems.schedule.simulate import EFFICIENCY, V100_FLOPS

    rate, efficiency, bandwidth = V100_FLOPS, EFFICIENCY, HOST_BANDWIDTH
    args.host_update = None   # the planner's constants (gems.partition.placement.HOST_UPDATE)
    if args.calibrate:
        measured = calibrate(args.device, AMP[args.amp] or getattr(torch, args.dtype))
        print(measured.line())
        rate, efficiency, bandwidth = measured.flops_per_second, 1.0, measured.host_bandwidth or bandwidth
        args.host_update = measured.host_update or None
    args.device_tflops = rate / 1e12 if args.device_tflops is None else args.device_tflops
    args.efficiency = efficiency if args.efficiency is None else args.efficiency
    args.host_bandwidth = bandwidth if args.host_bandwidth is None else args.host_bandwidth


def _plan(args: argparse.Namespace) -> None:
    import torch

    from gems.models import build
    from gems.partition import measure_times, plan
    from gems.schedule.generators import replicas

    if args.stages is None and not args.sweep:
        raise GemsError("give --stages K (or --sweep RANKS to compare every K)")
    if args.plan_png:
        if args.sweep:
            raise GemsError("--plan-png draws one plan: drop it from --sweep, then plan the recommended layout")
        from gems.obs.trace import require_matplotlib

        require_matplotlib("--plan-png", "a plan")
    kwargs = model_kwargs(args.model_arg)
    _speeds(args)
    if args.measure_time:
        model = build(args.model, num_classes=args.num_classes, **kwargs)
    else:
        try:
            with torch.device("meta"):   # only shapes are needed: build without allocating weights
                model = build(args.model, num_classes=args.num_classes, **kwargs)
        except (RuntimeError, NotImplementedError):   # a factory that must touch real weights
            model = build(args.model, num_classes=args.num_classes, **kwargs)
    height, width = args.image_size
    shape = (args.channels, height, width)
    if args.batch_size * args.channels * height * width > MAX_INPUT_ELEMENTS:
        raise GemsError(f"a batch of {args.batch_size} inputs of {'x'.join(map(str, shape))} is beyond torch's "
                        "tensor sizes: use a smaller --batch-size, --image-size or --channels")
    options = dict(batch_size=args.batch_size, stages=args.stages, schedule=args.schedule,
                   micro_batches=args.micro_batches, balance_by=args.balance_by, memory_budget=args.memory_budget,
                   balance=args.balance, optimizer=args.optimizer, dtype=args.dtype, groups=args.groups,
                   model_name=args.model, recompute=args.recompute, offload=args.offload, device=args.device,
                   host_bandwidth=args.host_bandwidth, device_flops=args.device_tflops * 1e12,
                   efficiency=args.efficiency, amp=args.amp, comm=args.comm, split_points=args.split_points,
                   memory_format=Recipe(channels_last=args.channels_last).memory_format(args.device),
                   compile=args.compile,
                   leaf_modules=args.leaf_module, split_backward=args.split_backward,
                   shard_optimizer=args.shard_optimizer, state_placement=args.state_placement,
                   host_memory_budget=args.host_memory_budget, host_update=args.host_update,
                   profiles={},   # each micro-batch size profiled once
                   spatial=args.spatial, spatial_end=args.spatial_end, spatial_start=args.spatial_start)
    if args.sweep:
        print(_sweep(model, shape, options, args))
        return
    if args.measure_time:
        # Check the input on fake tensors first, so that a bad size fails cleanly, not mid-timing.
        plan(model, shape, **{**options, "stages": 1, "balance": None, "memory_budget": None, "split_points": None,
                              "spatial": None, "spatial_end": None, "spatial_start": None})
        micro_batch = args.batch_size // (args.groups * replicas(args.schedule) * args.micro_batches)
        options["unit_times"] = measure_times(model, shape, micro_batch, dtype=getattr(torch, args.dtype))
    # with a budget and no --spatial, a spatial part is tried where nothing else fits (not in sweeps: each plan would)
    auto = "auto" if args.spatial is None and args.memory_budget is not None else args.spatial
    result = plan(model, shape, **{**options, "spatial": auto})
    if args.json:
        result.to_json(args.json)
    print(result.table())
    if args.json:
        print(f"plan written to {args.json}")
    if args.plan_png:
        from gems.obs.plan_picture import write_plan_png

        write_plan_png(args.plan_png, result)
        print(f"plan drawn in {args.plan_png}")
    if args.simulate:
        print(_simulation(model, shape, options, result, args))


def _simulation(model, shape, options: dict, chosen, args: argparse.Namespace) -> str:
    """Predicted step of the chosen plan and of the other schedules at the same K (each with
    its own partition), so the table also recommends a schedule."""
    from gems.partition import plan
    from gems.schedule.simulate import costs_from_plan, simulate

    rate = args.device_tflops * 1e12
    lines = [f"\nsimulated at {args.device_tflops:g} TFLOP/s x {args.efficiency:g}, "
             f"network {V100_CLUSTER.intra_bandwidth / 1e9:.0f} GB/s in a node, "
             f"{V100_CLUSTER.bandwidth / 1e9:.1f} GB/s between nodes of {V100_CLUSTER.ranks_per_node}",
             f"{'schedule':10}{'m':>3}{'step (ms)':>11}{'images/s':>10}{'bubble':>8}{'est. peak':>12}"
             "  state placements"]
    for name in ("mp", "gpipe", "1f1b", "mast"):
        m = 1 if name == "mp" else args.micro_batches
        try:
            p = chosen if (name, m) == (chosen.schedule, chosen.micro_batches) else plan(
                model, shape, **{**options, "schedule": name, "micro_batches": m, "memory_budget": None,
                                 "batch_size": chosen.micro_batch_size * chosen.groups * m
                                 * (2 if name == "mast" else 1)})
        except GemsError:
            continue
        r = simulate(p.schedule, p.stages, p.micro_batches, costs_from_plan(p, rate, args.efficiency), V100_CLUSTER,
                     p.groups, split=p.split_backward, shard=p.shard_optimizer, order=p.order)
        mark = "  <- this plan" if p is chosen else ""
        step, images = r.step_time, r.throughput(p.micro_batch_size)   # host updates and weight transfers in
        where = ",".join(f"{w} x{n}" for w, n in _placements(p).items())
        lines.append(f"{name:10}{m:>3}{step * 1e3:>11.1f}{images:>10.2f}"
                     f"{r.bubble_fraction:>8.1%}{format_size(p.peak_bytes):>12}  {where}{mark}")
    if chosen.state_host_bytes:
        lines.append("(steps include the host updates and copies back of the stages whose state is in host memory, "
                     "and the weight transfers of those whose parameters are)")
    return "\n".join(lines)


def _sweep(model, shape, options: dict, args: argparse.Namespace) -> str:
    """Every layout on ``args.sweep`` ranks, with tile groups where they can pay (``gems.partition.sweep``):
    planned, simulated, filtered by the memory budget, fastest first; the recommendation with its
    launch size and flags, written with --json."""
    from gems.partition.sweep import sweep_plans, tile_counts

    world = args.sweep
    swept = sweep_plans(model, shape, options, world, tile_counts(args.spatial), V100_CLUSTER)
    budget = f" within {format_size(args.memory_budget)}" if args.memory_budget else ""
    tiled = sorted({p.tiles for p in swept.plans.values()} - {1})
    lines = [f"sweep: {world} ranks, batch {args.batch_size}, {args.device_tflops:g} TFLOP/s x {args.efficiency:g}, "
             f"network {V100_CLUSTER.intra_bandwidth / 1e9:.0f} GB/s in a node of {V100_CLUSTER.ranks_per_node}, "
             f"{V100_CLUSTER.bandwidth / 1e9:.1f} GB/s between nodes",
             f"{len(swept.plans)} configurations planned"
             + (f" (tile groups of {', '.join(map(str, tiled))})" if tiled else "")
             + f", {len(swept.found)} fit{budget}" + (f" ({swept.over} over the budget)" if swept.over else ""),
             f"{'schedule':10}{'K':>3}{'m':>3}{'P':>4}{'D':>4}{'ranks':>7}{'step (ms)':>11}{'images/s':>10}"
             f"{'est. peak':>12}  policies, state placements"]
    for c in swept.found[:12]:
        made = swept.plan_of(c)
        kinds = sorted({pol.kind for pol in made.policies} - {"none"}) + ["split backward"] * made.split_backward
        kinds += [f"{where} x{n}" for where, n in _placements(made).items() if where != "device"]
        lines.append(f"{c.schedule:10}{c.stages:>3}{c.micro_batches:>3}{c.tiles:>4}{c.groups:>4}"
                     f"{f'{c.ranks}/{world}':>7}{c.step_time * 1e3:>11.1f}{c.images_per_second:>10.2f}"
                     f"{format_size(c.peak_bytes):>12}  {','.join(kinds + _tiled_units(made)) or 'none'}")
    best = swept.best
    if best is None:
        lines.append("nothing fits: raise --memory-budget, allow --recompute auto / --offload auto, "
                     "or use more ranks" + (f" (no plan written to {args.json})" if args.json else ""))
        return "\n".join(lines)
    ranks = swept.found[0].ranks
    lines.append(f"recommended: {' '.join(_layout_flags(best))} on {ranks} of {world} ranks "
                 f"({best.groups} data-parallel group(s) of {ranks // best.groups} ranks)")
    height, width = args.image_size
    train = ["--model", args.model, *(x for a in args.model_arg for x in ("--model-arg", a)), "--num-classes",
             str(args.num_classes), "--image-size", str(height) if height == width else f"{height}x{width}",
             "--batch-size", str(args.batch_size), *_layout_flags(best, train=True), "--plan", args.json or "PLAN.json"]
    lines.append(f"launch: mpiexec -n {ranks} gems-train {shlex.join(train)}"
                 + ("" if args.json else "  (write PLAN.json with --json)"))
    if args.json:
        best.to_json(args.json)
        lines.append(f"plan written to {args.json}")
    return "\n".join(lines)


def _layout_flags(plan, train: bool = False) -> list[str]:
    """The flags that lay out ``plan``: gems-plan's (``train`` False: --groups and the spatial part's
    ends too) or gems-train's beside --plan (which takes the rest from the plan)."""
    flags = ["--stages", str(plan.stages), "--schedule", plan.schedule, "--micro-batches", str(plan.micro_batches)]
    if not train:
        flags += ["--groups", str(plan.groups)] + ["--split-backward"] * plan.split_backward
    if plan.spatial_grid:
        flags += ["--spatial", "x".join(map(str, plan.spatial_grid))]
        if not train:
            flags += ["--spatial-end", str(plan.spatial_end), "--spatial-start", str(plan.spatial_start)]
    return flags


def _placements(plan) -> dict[str, int]:
    """{state placement: stages with it} of a plan (--state-placement), for the tables of --sweep and --simulate."""
    counts: dict[str, int] = {}
    for policy in plan.policies:
        counts[policy.state_placement] = counts.get(policy.state_placement, 0) + 1
    return counts


def _tiled_units(plan) -> list[str]:
    """The spatial part of a plan for the sweep's table: its grid and tiled units."""
    if not plan.spatial_grid:
        return []
    suffix = f",[{plan.spatial_start},{len(plan.unit_names)})" if plan.spatial_start else ""
    return [f"tiles {'x'.join(map(str, plan.spatial_grid))} on [0,{plan.spatial_end}){suffix}"]


if __name__ == "__main__":
    sys.exit(main())
