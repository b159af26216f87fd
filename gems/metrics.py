"""Per-step progress (tqdm on rank 0), JSON-lines metrics and the end-of-run summary.

Each step, one small world allreduce gathers what rank 0 reports: whether any rank caught
a stop signal, corrupt images skipped, and every rank's peak memory.
"""
from __future__ import annotations

import json
import statistics

import torch
from tqdm import tqdm

from gems import memory
from gems.units import format_size


class Metrics:
    def __init__(self, cfg, comm, engine, plan, start: int, total: int) -> None:
        self.cfg, self.comm, self.engine, self.plan = cfg, comm, engine, plan
        self.rank0 = comm.rank == 0
        self.times: list[float] = []
        self.losses: list[float] = []
        self.peaks = [0] * comm.size
        self.skipped = 0
        self._vec = torch.zeros(2 + 2 * comm.size, dtype=torch.float64)
        self._base = memory.current_bytes(engine.device)  # in use before the first step
        self.bases = [0] * comm.size
        self.bar = tqdm(total=total, initial=start, desc="gems-train", unit="step", dynamic_ncols=True,
                        disable=not (self.rank0 and cfg.progress))
        self.file = None
        if self.rank0 and cfg.metrics:
            self.file = open(cfg.metrics, "a" if cfg.resume else "w", encoding="utf-8")

    def record(self, step: int, loss: float, seconds: float, skipped: int, caught: int) -> bool:
        """Report one step; returns True when some rank was asked to stop."""
        v = self._vec
        v.zero_()
        v[0] = 1.0 if caught else 0.0
        v[1] = skipped if self.engine.needs_images and self.engine.position == min(self.engine.stages) else 0
        W = self.comm.size
        v[2 + self.comm.rank] = memory.peak_bytes(self.engine.device)
        v[2 + W + self.comm.rank] = self._base
        self.comm.allreduce(v, None, "the metrics allreduce")
        self.skipped = int(v[1])
        self.peaks = [int(x) for x in v[2:2 + W]]
        self.bases = [int(x) for x in v[2 + W:]]
        self.times.append(seconds)
        self.losses.append(loss)
        images_per_s = self.cfg.batch_size / seconds
        if self.file:
            self.file.write(json.dumps({
                "step": step, "loss": loss, "images_per_s": images_per_s, "step_time": seconds,
                "lr": self.engine.optimizer.param_groups[0]["lr"], "applied": self.engine.last_step_applied,
                "peak_memory": self.peaks, "skipped_images": self.skipped}) + "\n")
            self.file.flush()
        self.bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{images_per_s:.2f}", step_s=f"{seconds:.2f}")
        self.bar.update(1)
        return bool(v[0])

    def note(self, text: str) -> None:
        if self.rank0:
            (self.bar.write if not self.bar.disable else print)(f"gems-train: {text}")

    def close(self) -> None:
        self.bar.close()
        if self.file:
            self.file.close()
            self.file = None

    def summary(self) -> None:
        if not self.rank0:
            return
        steady = self.times[1:] or self.times  # the first step pays for warm-up
        median = statistics.median(steady) if steady else float("nan")
        lines = [
            "gems-train: summary",
            f"  steps run        {len(self.times)}  (final loss {self.losses[-1]:.4f})" if self.losses else
            "  steps run        0",
            f"  step time        {median:.3f} s median (first step excluded)",
            f"  throughput       {self.cfg.batch_size / median:.2f} images/s",
            f"  skipped images   {self.skipped}",
            f"  peak memory per rank ({memory.kind(self.engine.device)}) vs plan estimate:",
        ]
        K = self.plan.stages
        for rank, peak in enumerate(self.peaks):
            estimate = self.plan.positions[rank % K].peak_bytes
            lines.append(f"    rank {rank} (position {rank % K}): {format_size(peak)} measured "
                         f"({format_size(max(0, peak - self.bases[rank]))} above the start of training), "
                         f"{format_size(estimate)} estimated")
        lines.append("gems-train: done")
        print("\n".join(lines), flush=True)
