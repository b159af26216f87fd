"""The split backward's cost: input-gradient + weight-gradient halves against one full backward.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/split_backward.py --model resnet18 --image-size 256

Runs a middle stage of the model (every unit but the first ``--skip-units`` and the head, its
input a leaf that needs a gradient, as a received activation is) on one batch: forward + full
backward (``torch.autograd.backward``) against forward + ``gems.pipeline.splitgrad.input_half`` +
``weight_half``, alternating, ``--repeats`` times each after a warm-up; prints the medians of the
backward parts and their ratio, and checks that both give the same gradients. The issue's figure:
input-gradient + weight-gradient within 10% of a full backward. Not part of the installed package.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gems import models
from gems.graph import graph_units
from gems.pipeline.splitgrad import input_half, weight_half


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--skip-units", type=int, default=4, help="leading units left out (the stem)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()

    torch.manual_seed(0)
    model = models.build(args.model, num_classes=10)
    units = graph_units(model, (3, args.image_size, args.image_size), args.batch_size)
    stem, stage = units[:args.skip_units], units[args.skip_units:len(units) - 1]
    with torch.no_grad():
        x = stem(torch.randn(args.batch_size, 3, args.image_size, args.image_size))
    x = x[0] if isinstance(x, tuple) else x
    params = [q for q in stage.parameters() if q.requires_grad]

    def once(split: bool) -> tuple[float, float, float, list[torch.Tensor]]:
        stage.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_()
        out = stage(leaf)
        out = out[0] if isinstance(out, tuple) else out
        grad = torch.ones_like(out)
        t0 = time.perf_counter()
        if split:
            pending = input_half([out], [grad], [leaf], params)
            t1 = time.perf_counter()
            weight_half(pending)
        else:
            torch.autograd.backward([out], [grad])
            t1 = time.perf_counter()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, t2 - t0, [leaf.grad] + [q.grad for q in params]

    once(False), once(True)   # warm-up
    full, halves, inputs, weights = [], [], [], []
    for _ in range(args.repeats):
        full.append(once(False)[2])
        i, w, total, _ = once(True)
        inputs.append(i), weights.append(w), halves.append(total)
    a, b = once(False)[3], once(True)[3]
    same = all(torch.allclose(u, v, rtol=1e-5, atol=1e-6) for u, v in zip(a, b))
    med = statistics.median
    print(f"{args.model} {args.image_size}^2 batch {args.batch_size}, units {args.skip_units}..{len(units) - 2}, "
          f"{torch.get_num_threads()} threads, medians of {args.repeats}:")
    print(f"full backward {med(full) * 1e3:.1f} ms; input half {med(inputs) * 1e3:.1f} ms + weight half "
          f"{med(weights) * 1e3:.1f} ms = {med(halves) * 1e3:.1f} ms ({med(halves) / med(full):.3f}x); "
          f"gradients {'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
