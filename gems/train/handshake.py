"""The start-up handshake: every rank agrees on what it is about to run before any tensor moves.

Ranks of one job are started from separate command lines (``mpiexec ... : ...``, Slurm array
scripts, a node with an older install), so nothing but this check guarantees that they read
the same plan file, built the same model and run the same gems. Ranks that disagree would
exchange tensors of the wrong shape, wait for messages that never come, or silently train
different things. Each rank therefore computes a *fingerprint* -- a small ordered dict of
field -> short summary (a value, or a hash of something large such as the model) -- and
:func:`agree` gathers them once: on any difference the job stops with one line naming the
field, which ranks hold which value, and the fix, e.g.::

    gems-train: error: ranks disagree on the plan's cut points: rank 0 has [0, 2, 5], rank 1 has
    [0, 3, 5]: give every rank the same --plan file and partitioning flags

It is a user error: rank 0 prints it once and every rank exits with status 2.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

import gems
from gems import models, partition
from gems.errors import USER_ERROR, one_line

# field -> (what it is called in the message, how to fix a difference); also the order in
# which differences are reported (the most likely cause first).
FIELDS: dict[str, tuple[str, str]] = {
    "gems": ("gems version", "install the same gems on every node"),
    "torch": ("torch version", "install the same torch on every node"),
    "comm": ("communication backend", "give every rank the same --comm"),
    "model": ("model structure", "give every rank the same --model (the same factory file everywhere)"),
    "classes": ("number of classes", "give every rank the same --num-classes and --data"),
    "stages": ("number of stages K", "give every rank the same --stages"),
    "schedule": ("schedule", "give every rank the same --schedule"),
    "micro_batches": ("micro-batches per replica m", "give every rank the same --micro-batches"),
    "batch": ("batch size", "give every rank the same --batch-size"),
    "input": ("input shape", "give every rank the same --image-size"),
    "cuts": ("plan's cut points", "give every rank the same --plan file and partitioning flags"),
    "policies": ("plan's memory policies", "give every rank the same --plan file, --recompute, --offload and "
                 "--state-placement"),
    "boundaries": ("stage boundary shapes and dtypes", "give every rank the same --plan file and --image-size"),
    "precision": ("mixed precision", "give every rank the same --amp"),
    "recipe": ("speed recipe", "give every rank the same --channels-last, --compile, --cudnn-benchmark and --tf32"),
    "batch_norm": ("BatchNorm mode", "give every rank the same --batch-norm"),
    "optimizer": ("optimizer settings", "give every rank the same --optimizer, --lr, --momentum, "
                  "--weight-decay, --warmup-steps, --lr-schedule, --clip-grad-norm and --skip-nonfinite"),
    "data": ("data", "give every rank the same --data (the same files on every node) and --seed"),
    "steps": ("number of steps", "give every rank the same --steps or --epochs"),
    "checkpoints": ("checkpoint settings", "give every rank the same --checkpoint-dir, --checkpoint-every "
                    "and --keep-checkpoints"),
    "resume": ("checkpoint to resume from", "give every rank --resume and the same shared --checkpoint-dir"),
    "trace": ("tracing", "give every rank the same --trace and --trace-png"),
    "bench": ("benchmark settings", "give every rank the same gems-bench flags"),
}


def _digest(*parts: object) -> str:
    """A short stable hash of the parts' text."""
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:12]


def _source_digest() -> str:
    """Hash of gems' own Python files, so two installs of the same version number but different
    code (a patched copy on one node) still disagree."""
    h = hashlib.sha256()
    for package in (gems, partition, models):
        root = Path(package.__file__).parent
        for file in sorted(root.rglob("*.py")):
            h.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes())
    return h.hexdigest()[:12]


def model_summary(model: nn.Module) -> str:
    """Units, parameter count and a hash of the architecture (every module's repr, every
    parameter's and buffer's name, shape and dtype): equal iff the models have the same structure."""
    tensors = [(name, tuple(t.shape), str(t.dtype))
               for name, t in [*model.named_parameters(), *model.named_buffers()]]
    count = sum(p.numel() for p in model.parameters())
    units = f"{len(model)} units, " if isinstance(model, nn.Sequential) else ""
    return f"{units}{count:,} parameters, {_digest(repr(model), tensors)}"


def versions() -> dict[str, str]:
    """The fields every gems command agrees on: gems (number and source hash) and torch."""
    return {"gems": f"{gems.__version__} (source {_source_digest()})", "torch": torch.__version__}


def training(job) -> dict[str, object]:
    """The fingerprint of a prepared ``gems.train.trainer.Job``."""
    cfg, plan, data = job.cfg, job.plan, job.data
    classes = getattr(data, "classes", None)  # an image folder's class names
    return {
        **versions(),
        "comm": cfg.comm,
        "model": model_summary(job.model),
        "classes": data.num_classes,
        "stages": plan.stages,
        "schedule": plan.schedule,
        "micro_batches": plan.micro_batches,
        "batch": plan.batch_size,
        "input": list(plan.input_shape),
        "cuts": list(plan.cuts),
        "policies": [asdict(p) for p in plan.policies],
        "boundaries": _digest(plan.stage_output_shapes, plan.stage_output_dtypes),
        "precision": cfg.amp,
        "recipe": {"memory_format": plan.memory_format, "compile": cfg.compile, "cudnn_benchmark": cfg.cudnn_benchmark,
                   "tf32": cfg.tf32},
        "batch_norm": cfg.batch_norm,
        "optimizer": {k: getattr(cfg, k) for k in ("optimizer", "lr", "momentum", "weight_decay", "warmup_steps",
                                                  "lr_schedule", "clip_grad_norm", "skip_nonfinite")},
        "data": {"source": "synthetic" if classes is None else "folder", "samples": data.num_samples,
                 "seed": cfg.seed, **({} if classes is None else {"classes": _digest(classes)})},
        "steps": {"steps": cfg.steps, "epochs": cfg.epochs},
        "checkpoints": {"saved": cfg.checkpoint_dir is not None, "every": cfg.checkpoint_every,
                        "keep": cfg.keep_checkpoints},
        "resume": None if job.resume_from is None else job.resume_from.name,
        "trace": [bool(cfg.trace), bool(cfg.trace_png)],
    }


def benchmark(cfg) -> dict[str, object]:
    """The fingerprint of a ``gems.bench.BenchConfig`` (the model is built later, identically
    from these settings)."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("json", "trace_dir", "timeout")}
    return {**versions(), "comm": cfg.comm, "bench": settings}


def _ranks(ranks: list[int]) -> str:
    """"rank 3", "ranks 0,2" or "ranks 0-5,7"."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ",".join(f"{a}" if a == b else f"{a},{b}" if b == a + 1 else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _shown(value: object, limit: int = 80) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def disagreement(fingerprints: list[dict[str, object]]) -> str | None:
    """None when every rank's fingerprint equals rank 0's; otherwise the message naming the
    first differing field (in FIELDS order), who holds what, and the fix."""
    differing = [key for key in FIELDS if len({repr(f.get(key)) for f in fingerprints}) > 1]
    if not differing:
        return None
    key = differing[0]
    label, fix = FIELDS[key]
    holders: dict[str, list[int]] = {}
    for rank, fingerprint in enumerate(fingerprints):
        holders.setdefault(repr(fingerprint.get(key)), []).append(rank)
    values = {repr(f.get(key)): f.get(key) for f in fingerprints}
    if all(isinstance(v, dict) for v in values.values()):  # show only the entries that differ
        keys = {k for v in values.values() for k in v if len({repr(w.get(k)) for w in values.values()}) > 1}
        values = {r: {k: v.get(k) for k in sorted(keys)} for r, v in values.items()}
    who = ", ".join(f"{_ranks(ranks)} {'have' if len(ranks) > 1 else 'has'} {_shown(values[v])}"
                    for v, ranks in holders.items())
    also = f" (they also disagree on: {', '.join(FIELDS[k][0] for k in differing[1:])})" if differing[1:] else ""
    return f"ranks disagree on the {label}: {who}{also}: {fix}"


def agree(prog: str, comm, fingerprint: dict[str, object]) -> None:
    """COLLECTIVE: gather every rank's fingerprint; if any differs from rank 0's, rank 0 prints
    one line and every rank exits with status 2 (the same decision everywhere, from the same
    gathered list). Call it after setup succeeded on every rank and before the first step."""
    message = disagreement(comm.allgather_object(fingerprint))
    if message is None:
        return
    if comm.rank == 0:
        print(f"{prog}: error: {one_line(message)}", file=sys.stderr, flush=True)
    sys.exit(USER_ERROR)
