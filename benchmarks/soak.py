"""Soak test: the gems-train loop for 1,000+ steps, watching for leaks and slowdowns per rank.

    OMP_NUM_THREADS=1 mpiexec -n 4 .venv/bin/python benchmarks/soak.py --steps 1000 \\
        --checkpoint-dir /tmp/soak-ck --checkpoint-every 100 --keep-checkpoints 2 --metrics /tmp/soak.jsonl

Runs ``gems.train.trainer.run`` itself (data loading with worker processes, the engine, metrics,
checkpoints: every gems-train flag is accepted; the defaults train tests/assets/tiny_model.py:tiny
on 32 px synthetic images, K = 2) on a synthetic dataset of ``--epoch-images`` images (or the
``--data`` folder), so epochs and with them the data-loading workers turn over many times. After every step it notes the time;
every ``--sample-every`` steps, this rank's resident memory (VmRSS), open file descriptors
(/proc/self/fd), Python threads (threading.active_count) and OS threads (/proc/self/task).

At the end rank 0 prints, per rank, each quantity after ``--baseline-step`` steps (warm-up done:
allocator pools, JIT kernels and optimizer state exist) and at the last step, and the steps/s of
the first and the last ``--window`` steps after the baseline. It exits with 1 when a rank's RSS
grew by ``--max-rss-growth`` percent or more, its descriptors or threads grew (a descriptor or
thread count counts as grown when even the smallest of the last window's samples exceeds the
largest of the first window's, so a worker still shutting down is not a leak), or its throughput
fell by more than ``--max-slowdown`` percent. ``--json`` keeps every sample.

Known non-leaks in the figures: on CPU the last step runs under gems.train.progress' PeakMeter (the
PyTorch profiler's memory records), ~1.5 MiB more RSS in the final sample; and the loop keeps
a few floats per step (these step times, Metrics' step times and losses), ~0.1 KiB per step.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field

from gems import comm as comm_lib
from gems.train import trainer
from gems.cli import dataclass_parser, setup_on_every_rank
from gems.train.config import TrainConfig
from gems.train.data import TrainData
from gems.pipeline.engine import Engine
from gems.units import format_size

DEFAULTS = {"model": "tests/assets/tiny_model.py:tiny", "image_size": 32, "batch_size": 8, "stages": 2,
            "num_classes": 4, "steps": 1000, "workers": 1, "progress": False, "lr": 0.02}
QUANTITIES = ("rss", "fds", "py_threads", "os_threads")


def rss_bytes() -> int:
    """This process's resident set size (VmRSS), the memory a leak would grow."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@dataclass
class Probe:
    """What one rank recorded: the wall clock after each step, and samples every ``every`` steps."""

    every: int
    step_ends: list[float] = field(default_factory=list)
    samples: dict[int, dict[str, int]] = field(default_factory=dict)

    def after_step(self) -> None:
        self.step_ends.append(time.perf_counter())
        step = len(self.step_ends)
        if step % self.every == 0:
            self.samples[step] = {"rss": rss_bytes(), "fds": len(os.listdir("/proc/self/fd")),
                                  "py_threads": threading.active_count(),
                                  "os_threads": len(os.listdir("/proc/self/task"))}

    def throughput(self, first: int, last: int) -> float:
        """Steps per second over steps first+1 .. last (1-based step numbers)."""
        return (last - first) / (self.step_ends[last - 1] - self.step_ends[first - 1])


def verdict(rank: int, probe: Probe, base: int, window: int, max_growth: float, max_slowdown: float) -> dict:
    """One rank's figures and the reasons it fails the soak (none: it passes)."""
    end = len(probe.step_ends)
    steps = sorted(probe.samples)
    first = [probe.samples[s] for s in steps if base <= s <= base + window]
    last = [probe.samples[s] for s in steps if s >= end - window]
    at_base, at_end = probe.samples[base], probe.samples[steps[-1]]
    row = {"rank": rank, "base": at_base, "end": at_end,
           "growth": 100.0 * (at_end["rss"] - at_base["rss"]) / at_base["rss"],
           "first_rate": probe.throughput(base, base + window), "last_rate": probe.throughput(end - window, end)}
    row["slowdown"] = 100.0 * (1 - row["last_rate"] / row["first_rate"])
    problems = []
    if row["growth"] >= max_growth:
        problems.append(f"RSS grew {row['growth']:.1f}% (limit {max_growth:g}%)")
    for q in QUANTITIES[1:]:
        if min(s[q] for s in last) > max(s[q] for s in first):
            problems.append(f"{q} grew from {at_base[q]} to {at_end[q]}")
    if row["slowdown"] > max_slowdown:
        problems.append(f"throughput fell {row['slowdown']:.1f}% (limit {max_slowdown:g}%)")
    row["problems"] = problems
    return row


def report(rows: list[dict], args, world: int) -> str:
    cfg = args.cfg
    lines = [f"soak: {args.total} steps on {world} ranks ({cfg.model}, {cfg.image_size} px, batch {cfg.batch_size}, "
             f"K={cfg.stages}, {cfg.workers} loader worker(s), {args.epoch_images} images/epoch); baseline after "
             f"step {args.baseline_step}, windows of {args.window} steps",
             f"{'rank':>4}  {'RSS@base':>10}  {'RSS@end':>10}  {'growth':>7}  {'fds':>9}  {'threads py':>10}  "
             f"{'threads os':>10}  {'steps/s first':>13}  {'steps/s last':>12}  {'change':>7}"]
    for r in rows:
        b, e = r["base"], r["end"]
        lines.append(f"{r['rank']:>4}  {format_size(b['rss']):>10}  {format_size(e['rss']):>10}  "
                     f"{r['growth']:>+6.2f}%  {b['fds']:>4}->{e['fds']:<4}  "
                     f"{b['py_threads']:>4}->{e['py_threads']:<5}  {b['os_threads']:>4}->{e['os_threads']:<5}  "
                     f"{r['first_rate']:>13.2f}  {r['last_rate']:>12.2f}  {-r['slowdown']:>+6.1f}%")
    problems = [f"rank {r['rank']}: {p}" for r in rows for p in r["problems"]]
    lines.append("soak: ok" if not problems else "soak: FAILED: " + "; ".join(problems))
    return "\n".join(lines)


def parse(argv: list[str] | None = None):
    p = dataclass_parser("soak", "Run the gems-train loop for many steps and check for leaks.", TrainConfig)
    p.set_defaults(**DEFAULTS)
    p.add_argument("--sample-every", type=int, default=50, help="steps between memory/descriptor/thread samples")
    p.add_argument("--baseline-step", type=int, default=100, help="the step after which warm-up is over")
    p.add_argument("--window", type=int, default=100, help="steps in the first and last throughput windows")
    p.add_argument("--epoch-images", type=int, default=400, help="synthetic images per epoch")
    p.add_argument("--max-rss-growth", type=float, default=5.0, help="failing RSS growth, percent")
    p.add_argument("--max-slowdown", type=float, default=20.0, help="failing throughput drop, percent")
    p.add_argument("--json", help="write every rank's samples and step times here")
    args = p.parse_args(argv)
    soak = {k: vars(args).pop(k) for k in ("sample_every", "baseline_step", "window", "epoch_images",
                                           "max_rss_growth", "max_slowdown", "json")}
    cfg = TrainConfig(**vars(args))
    if cfg.steps is None or soak["baseline_step"] + 2 * soak["window"] > cfg.steps or \
            soak["baseline_step"] % soak["sample_every"] or soak["window"] % soak["sample_every"]:
        p.error("--steps must be at least --baseline-step + 2 x --window, and --baseline-step and --window "
                "multiples of --sample-every")
    return argparse.Namespace(cfg=cfg, total=cfg.steps, **soak)


def main() -> None:
    args = parse()
    cfg = args.cfg
    comm = comm_lib.create(cfg.comm, timeout=cfg.timeout)
    comm_lib.configure_threads(comm)
    job = setup_on_every_rank("soak", comm, lambda: trainer.prepare(cfg, comm))
    if job is None:  # --dry-run
        sys.exit(0)
    d = job.data
    if cfg.data == "synthetic":  # a short epoch, so that the data-loading workers turn over
        job.data = TrainData("synthetic", d.image_size, d.batch_size, d.groups, d.group, num_classes=d.num_classes,
                             seed=d.seed, workers=d.workers, need_images=d.need_images,
                             need_labels=d.need_labels, synthetic_size=args.epoch_images)
    probe = Probe(args.sample_every)
    step = Engine.step

    def probed_step(self, images, labels):
        loss = step(self, images, labels)
        probe.after_step()
        return loss
    Engine.step = probed_step
    with comm.guard():
        status = trainer.run(job)
        probes = comm.allgather_object(probe)
        rows = [verdict(r, p, args.baseline_step, args.window, args.max_rss_growth, args.max_slowdown)
                for r, p in enumerate(probes)]
        if comm.rank == 0:
            print(report(rows, args, comm.size), flush=True)
            if args.json:
                with open(args.json, "w", encoding="utf-8") as f:
                    json.dump({"rows": rows, "probes": [vars(p) for p in probes]}, f)
    sys.exit(status or (1 if any(r["problems"] for r in rows) else 0))


if __name__ == "__main__":
    main()
