"""The plain PyTorch training loop a user compares gems against, under the published recipes:
images per second of one unpartitioned model on one device, per recipe, in one run.

    python benchmarks/plain_loop.py --model resnet50 --image-size 2048 --batch-size 2

Recipes (each a fresh copy of the same model, SGD with momentum, the batch's mean cross-entropy):
``fp32`` (NCHW, eager; on CUDA TF32 off), ``tf32`` (CUDA), ``channels_last``, ``bf16`` (autocast),
``channels_last+bf16``, and with ``--compile`` the last one compiled (``torch.compile``, its first
steps excluded as warm-up like every recipe's). cuDNN's autotuner (``cudnn.benchmark``) is on for
every CUDA recipe. Each recipe reports the median step of ``--steps`` after ``--warmup``, with the
spread, and the peak memory. This is the ceiling issue 35 measures gems's stages against.

Not part of the installed package, and not a test: timings belong here, not in pytest.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch import nn

from gems import models


def recipes(device: torch.device, compile_: bool) -> list[str]:
    names = ["fp32"] + (["tf32"] if device.type == "cuda" else []) + ["channels_last", "bf16", "channels_last+bf16"]
    return names + (["channels_last+bf16+compile"] if compile_ else [])


def measure(name: str, args, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = models.build(args.model, num_classes=args.num_classes).to(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = name == "tf32"
    layout = torch.channels_last if "channels_last" in name else torch.contiguous_format
    model = model.to(memory_format=layout)
    step_model = torch.compile(model) if "compile" in name else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device).to(memory_format=layout)
    y = torch.randint(0, args.num_classes, (args.batch_size,), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if "bf16" in name else contextlib.nullcontext()
    loss_fn = nn.CrossEntropyLoss()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn(step_model(x), y)
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    kept = times[args.warmup:]
    step = statistics.median(kept)
    return {"recipe": name, "step_ms": step * 1e3, "spread_ms": (max(kept) - min(kept)) * 1e3,
            "images_per_s": args.batch_size / step, "first_step_s": times[0],
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--image-size", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="add channels_last+bf16 compiled with torch.compile")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.model} {args.image_size}^2 batch {args.batch_size} on {name}, torch {torch.__version__}; "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'recipe':28} {'step ms':>9} {'spread':>8} {'images/s':>9} {'first s':>8} {'peak GiB':>9}")
    for recipe in recipes(device, args.compile):
        r = measure(recipe, args, device)
        print(f"{r['recipe']:28} {r['step_ms']:9.1f} {r['spread_ms']:8.1f} {r['images_per_s']:9.2f} "
              f"{r['first_step_s']:8.1f} {r['peak_gib']:9.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
