"""Out-of-core training: how much larger an image trains in a fixed per-rank memory budget
with the planner's recompute/offload policies, at what cost in step time, and how close
the plan's memory estimate is to the measured peak.

    python benchmarks/out_of_core.py --model preact-resnet110 --budget 300MiB

1. For each policy mode (``none``, ``auto``), the largest image side (a multiple of
   ``--side-step``) whose plan fits the budget: ``gems.partition.plan`` on fake tensors,
   binary search.
2. Real runs, ``mpiexec -n K gems-train`` on CPU ranks (one thread each): ``none`` and
   ``--recompute all`` at the ``none`` side (at and below it, ``auto`` chooses ``none``);
   ``auto`` at ``--between`` sides between the two and at its largest side, each next to
   ``none`` at the same side without the budget (a time reference that needs more memory
   than the budget). Each run reports its step time (median, first and last steps
   excluded) and every rank's measured tensor peak over the last step next to the plan's
   estimate (gems-train's summary). ``--repeat N`` runs each pair N times, alternating, and
   keeps the median: step times on shared machines drift by 10-20% between launches.
3. A table: side, run, per-stage policies, step time, its ratio to ``none`` at the same
   side (the price of the policies; target <= 1.35), and the estimate errors (target within
   10%); and the side with policies / the side without (target >= 2).

Not part of the installed package, and not a test: timings belong here, not in pytest.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from gems import models
from gems.errors import GemsError
from gems.partition import plan
from gems.units import format_size, parse_size

MPIEXEC = os.environ.get("GEMS_MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
GEMS_TRAIN = str(Path(sys.executable).parent / "gems-train")


def planned(model, side: int, args, recompute: str, offload: str):
    """The plan gems-train makes for this run (the same call, on fake tensors), made once per side and
    policies (the search's plans serve the runs' labels)."""
    return _plan(model, side, recompute, offload, args.batch_size, args.stages, args.schedule, args.micro_batches,
                 args.budget, args.model)


@functools.lru_cache(maxsize=None)
def _plan(model, side, recompute, offload, batch_size, stages, schedule, micro_batches, budget, model_name):
    return plan(model, (3, side, side), batch_size, stages, schedule, micro_batches, memory_budget=budget,
                recompute=recompute, offload=offload, device="cpu", model_name=model_name)


def fits(model, side: int, args, mode: str) -> bool:
    try:
        return bool(planned(model, side, args, mode, mode).fits)
    except GemsError:
        return False


def largest_side(model, args, mode: str) -> int:
    """The largest multiple of ``side_step`` in [side_step, max_side] whose plan fits."""
    step = args.side_step
    lo, hi = 0, args.max_side // step            # in steps: lo fits (0 = nothing), hi + 1 does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(model, mid * step, args, mode):
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def train(model, args, side: int, recompute: str, budgeted: bool = True) -> dict:
    """One gems-train run; its summary parsed: step time, measured and estimated peaks.
    ``budgeted=False`` runs without --memory-budget (a reference over the budget: time only)."""
    offload = "auto" if recompute == "auto" else "none"
    labels = [p.label for p in planned(model, side, args, recompute, offload).policies]
    command = [MPIEXEC, "-n", str(args.stages), GEMS_TRAIN, "--model", args.model, "--num-classes", "10",
               "--image-size", str(side), "--batch-size", str(args.batch_size), "--stages", str(args.stages),
               "--schedule", args.schedule, "--micro-batches", str(args.micro_batches), "--steps", str(args.steps),
               "--recompute", recompute, "--offload", offload, "--workers", "0", "--no-progress"]
    if budgeted:
        command += ["--memory-budget", str(args.budget)]
    if args.enforce and budgeted:
        command.append("--enforce-memory-budget")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = {"side": side, "run": recompute if budgeted else f"{recompute}, no budget", "policies": labels}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    if result.returncode != 0:
        return {**run, "failed": (result.stderr or result.stdout).strip()[-300:]}
    out = result.stdout
    ranks = re.findall(r"rank (\d+) \(position \d+\): ([\d.]+ \w+) measured, ([\d.]+ \w+) estimated", out)
    return {**run, "step": float(re.search(r"step time\s+([\d.]+) s", out).group(1)),
            "measured": [parse_size(m.replace(" ", "")) for _, m, _ in ranks],
            "estimated": [parse_size(e.replace(" ", "")) for _, _, e in ranks]}


def _median_run(trials: list[dict]) -> dict:
    """The trial with the median step time (the first failure, if any failed)."""
    failed = [t for t in trials if "failed" in t]
    if failed:
        return failed[0]
    ordered = sorted(trials, key=lambda t: t["step"])
    return {**ordered[(len(ordered) - 1) // 2], "steps": [t["step"] for t in trials]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="preact-resnet110")
    p.add_argument("--budget", type=parse_size, default=parse_size("300MiB"), help="per-rank memory budget")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--schedule", default="mast")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--side-step", type=int, default=16)
    p.add_argument("--max-side", type=int, default=1024)
    p.add_argument("--between", type=int, default=2,
                   help="sides between the two largest at which auto also runs (evenly spaced)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each pair (alternating); the table shows the median, its row the spread")
    p.add_argument("--enforce", action="store_true", help="also make the budget a hard limit (--enforce-memory-budget)")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)

    with torch.device("meta"):
        model = models.build(args.model, num_classes=10)
    plain, policed = largest_side(model, args, "none"), largest_side(model, args, "auto")
    if plain == 0:
        sys.exit(f"out_of_core: {args.model} does not fit {format_size(args.budget)} per rank even at side "
                 f"{args.side_step} without policies; raise --budget or lower --side-step")
    print(f"{args.model}, {args.schedule} K={args.stages} m={args.micro_batches}, batch {args.batch_size}, "
          f"budget {format_size(args.budget)} per rank: largest side {plain} without policies, {policed} with "
          f"auto -> {policed / max(plain, 1):.2f}x the side, {(policed / max(plain, 1)) ** 2:.2f}x the pixels",
          flush=True)
    at_plain = [p.kind for p in planned(model, plain, args, "auto", "auto").policies]
    print(f"at side {plain} (and below) auto chooses {','.join(at_plain)}: the step time of the no-policy run")
    step = args.side_step
    sides = sorted({round((plain + (policed - plain) * i / (args.between + 1)) / step) * step
                    for i in range(1, args.between + 2)} - {plain})
    pairs = [(plain, ("none", True), ("all", True))] + [(side, ("auto", True), ("none", False)) for side in sides]
    runs = []
    for side, *pair in pairs:   # each pair alternates --repeat times: the machine's drift hits both
        trials = [[train(model, args, side, recompute, budgeted) for recompute, budgeted in pair]
                  for _ in range(args.repeat)]
        runs += [_median_run([t[i] for t in trials]) for i in range(2)]

    reference = {r["side"]: r["step"] for r in runs if r["run"].startswith("none") and "step" in r}
    print(f"\n{'side':>5}  {'run':17}  {'policies':44}  {'step (s)':>8}  {'/ none':>6}  "
          "per rank: measured / estimated (error)")
    for r in runs:
        if "failed" in r:
            print(f"{r['side']:>5}  {r['run']:17}  FAILED: {r['failed']}")
            continue
        ratio = f"{r['step'] / reference[r['side']]:.2f}x" if r["side"] in reference else "-"
        ranks = "; ".join(f"{format_size(m)} / {format_size(e)} ({e / m - 1:+.1%})"
                          for m, e in zip(r["measured"], r["estimated"])) if "no budget" not in r["run"] \
            else "(over the budget: time reference only)"
        spread = f"  (runs: {', '.join(f'{t:.3f}' for t in r['steps'])})" if len(r["steps"]) > 1 else ""
        print(f"{r['side']:>5}  {r['run']:17}  {' | '.join(r['policies']):44}  {r['step']:>8.3f}  {ratio:>6}  {ranks}"
              f"{spread}")
    over = [r for r in runs if "measured" in r and "no budget" not in r["run"] and max(r["measured"]) > args.budget]
    if over:
        print("measured peak above the budget in: " + ", ".join(f"{r['run']} at {r['side']}" for r in over))
    return 1 if any("failed" in r for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
