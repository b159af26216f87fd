"""Per-step progress (tqdm on rank 0), JSON-lines metrics and the end-of-run summary.

Each step, one small world allreduce gathers what rank 0 reports: whether any rank caught
a stop signal, corrupt images skipped, and every rank's process peak memory (CUDA: max
allocated; CPU: peak resident set size) for the JSON lines.

The summary sets each rank's measured tensor peak beside the plan's estimate for its
position: a ``gems.obs.memory.PeakMeter`` opens at the end of the step before the last one
(before the first step when only one is run) and closes at the last step's report, taking
the peak over that step alone (what it holds from its start, the batch included); the
memory of the data loading and checkpointing before it does not count. Where that step is the
optimizer's first (a run of one step), torch's optimizer makes its state in the step's update, at
its end, so the step's peak does not hold it while later steps' do (and the plan's estimate counts
it): the summary says how much it made per rank. Where model state lives in host memory
(``--state-placement``), that is the device tier (what a GPU would hold); the host tier's bytes
(``memory.host_tier_bytes``) are set beside the plan's ``state_host_bytes`` apart.
"""
from __future__ import annotations

import json
import statistics
import time

import torch
from tqdm import tqdm

from gems.obs import memory
from gems.units import format_size


class Progress:
    def __init__(self, cfg, comm, engine, plan, start: int, total: int, board=None) -> None:
        self.board = board
        self.cfg, self.comm, self.engine, self.plan = cfg, comm, engine, plan
        self.rank0 = comm.rank == 0
        self.times: list[float] = []
        self.losses: list[float] = []
        self.peaks = [0] * comm.size       # process peak per rank (JSON lines)
        self.measured = [0] * comm.size    # tensor peak of the last step per rank (summary)
        self.host_tier = [0] * comm.size   # host memory of model state per rank after the last step (summary)
        self.state_made = [0] * comm.size  # device bytes of optimizer state made during the last step (summary)
        self._state_held = 0               # ... held when it started
        self.val_measured: list[int] = []  # ... and of the last validation (forward-only), if any
        self.val_batch = 0
        self.skipped = 0
        self.total = total
        self._vec = torch.zeros(2 + 4 * comm.size, dtype=torch.float64)
        self.meter = memory.PeakMeter(engine.device)
        if start + 1 == total:
            self._meter_last_step()
        self.bar = tqdm(total=total, initial=start, desc="gems-train", unit="step", dynamic_ncols=True,
                        disable=not (self.rank0 and cfg.progress))
        self.file = None
        if self.rank0 and cfg.metrics:
            self.file = open(cfg.metrics, "a" if cfg.resume else "w", encoding="utf-8")

    def record(self, step: int, loss: float, seconds: float, skipped: int, caught: int, epoch: int = 0) -> bool:
        """Report one step; returns True when some rank was asked to stop."""
        v = self._vec
        v.zero_()
        v[0] = 1.0 if caught else 0.0
        v[1] = skipped if self.engine.needs_images and self.engine.position == min(self.engine.stages) else 0
        W = self.comm.size
        if step == self.total:
            v[2 + W + self.comm.rank] = self.meter.stop(since=time.time() - seconds)
            v[2 + 2 * W + self.comm.rank] = memory.host_tier_bytes(self.engine)
            v[2 + 3 * W + self.comm.rank] = memory.device_state_bytes(self.engine) - self._state_held
        v[2 + self.comm.rank] = memory.process_peak_bytes(self.engine.device)
        self.comm.allreduce(v, None, "the metrics allreduce")
        self.skipped = int(v[1])
        self.peaks = [int(x) for x in v[2:2 + W]]
        if step == self.total:
            self.measured = [int(x) for x in v[2 + W:2 + 2 * W]]
            self.host_tier = [int(x) for x in v[2 + 2 * W:2 + 3 * W]]
            self.state_made = [int(x) for x in v[2 + 3 * W:]]
        self.times.append(seconds)
        self.losses.append(loss)
        images_per_s = self.cfg.batch_size / seconds
        if self.file:
            self.file.write(json.dumps({
                "step": step, "loss": loss, "images_per_s": images_per_s, "step_time": seconds,
                "lr": self.engine.optimizer.param_groups[0]["lr"], "applied": self.engine.last_step_applied,
                "peak_memory": self.peaks, "skipped_images": self.skipped}) + "\n")
            self.file.flush()
        if self.board is not None:
            self.board.step(step, loss, self.engine.optimizer.param_groups[0]["lr"], images_per_s, self.peaks)
        self.bar.set_postfix(epoch=epoch, loss=f"{loss:.4f}", img_s=f"{images_per_s:.2f}", step_s=f"{seconds:.2f}")
        self.bar.update(1)
        if step + 1 == self.total:
            self._meter_last_step()
        return bool(v[0])

    def _meter_last_step(self) -> None:
        self.meter.start(memory.engine_tensors(self.engine))
        self._state_held = memory.device_state_bytes(self.engine)

    def validation(self, step: int, scores: dict) -> None:
        """Report a validation: one line on the bar, one JSON line in the metrics file."""
        if not self.rank0:
            return
        numbers = {k: v for k, v in scores.items() if isinstance(v, (int, float))}
        self.note(f"validation after step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in numbers.items()))
        if self.file:
            self.file.write(json.dumps({"step": step, "validation": _finite(scores)}) + "\n")
            self.file.flush()

    def validation_memory(self, measured: int, batch_size: int) -> None:
        """Every rank's measured tensor peak over the last validation, for the summary. COLLECTIVE."""
        v = torch.zeros(self.comm.size, dtype=torch.float64)
        v[self.comm.rank] = measured
        self.comm.allreduce(v, None, "the validation memory allreduce")
        self.val_measured, self.val_batch = [int(x) for x in v], batch_size

    def note(self, text: str) -> None:
        if self.rank0:
            (self.bar.write if not self.bar.disable else print)(f"gems-train: {text}")

    def close(self) -> None:
        self.meter.close()
        self.bar.close()
        if self.file:
            self.file.close()
            self.file = None

    def summary(self) -> None:
        if not self.rank0:
            return
        # The first step pays for warm-up, the last for the memory meter (~10% on small ops).
        few = len(self.times) <= 2
        steady = self.times[-1:] if few else self.times[1:-1]
        median = statistics.median(steady) if steady else float("nan")
        lines = [
            "gems-train: summary",
            f"  steps run        {len(self.times)}  (final loss {self.losses[-1]:.4f})" if self.losses else
            "  steps run        0",
            f"  step time        {median:.3f} s " + ("(the last step)" if few else
                                                   "median (first and last, memory-metered, steps left out)"),
            f"  throughput       {self.cfg.batch_size / median:.2f} images/s",
            f"  skipped images   {self.skipped}",
            *([f"  recompiles       {self.engine.compiled.recompiles} after the warm-up (rank 0's compiled units)"]
              if getattr(self.engine, "compiled", None) is not None else []),
            f"  peak {'device-tier ' if self.plan.state_host_bytes else ''}memory per rank over the last step "
            f"({memory.kind(self.engine.device)}) vs plan estimate:",
        ]
        for rank, (measured, process) in enumerate(zip(self.measured, self.peaks)):
            estimate = memory.rank_estimate(self.plan.positions[self._position(rank)], self._tile(rank))
            lines.append(f"    rank {rank} ({self._where(rank)}): {format_size(measured)} measured, "
                         f"{format_size(estimate)} estimated ({memory.estimate_error(measured, estimate)}); "
                         f"process peak {format_size(process)}")
        if any(self.state_made):   # torch's optimizers make their state in their first step's update
            lines.append(f"    (that step was the optimizer's first: its update made the optimizer's state, up to "
                         f"{format_size(max(self.state_made))} per rank on the device, at the step's end; later "
                         "steps hold it throughout, as the estimates count it)")
        if self.plan.state_host_bytes:
            lines.append("  host memory of model state per rank (--state-placement; tensors: the host tier's copies "
                         "and optimizer state) vs plan estimate:")
            for rank, held in enumerate(self.host_tier):
                estimate = self.plan.state_host_bytes[self._position(rank)]
                lines.append(f"    rank {rank} ({self._where(rank)}): {format_size(held)} measured, "
                             f"{format_size(estimate)} estimated ({memory.estimate_error(held, estimate)})")
        if self.val_measured:
            lines.append(f"  peak memory per rank over the last validation (forward-only, batches of {self.val_batch}) "
                         "vs plan estimate:")
            for rank, measured in enumerate(self.val_measured):
                estimate = self.plan.forward_peak_bytes(self._position(rank), self.val_batch)
                said = ("not estimated (the plan predates forward-only pricing)" if estimate is None else
                        f"{format_size(estimate)} estimated ({memory.estimate_error(measured, estimate)})")
                lines.append(f"    rank {rank} ({self._where(rank)}): {format_size(measured)} measured, {said}")
        lines.append("gems-train: done")
        print("\n".join(lines), flush=True)

    def _position(self, rank: int) -> int:
        return self.engine.topology.place(rank)[1]

    def _tile(self, rank: int) -> int:
        return self.engine.topology.place(rank)[2]

    def _where(self, rank: int) -> str:
        position, tile = self.engine.topology.place(rank)[1:]
        return memory.place(position, tile, not self.plan.positions[position].member_peak_bytes)


def _finite(value):
    """``value`` with NaN (a class absent from the whole validation set) as None: JSON has no NaN."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return None if isinstance(value, float) and value != value else value
