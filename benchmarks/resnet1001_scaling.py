"""Weak-scaling prediction of pre-activation ResNet-1001 under mast on a V100 cluster (the GEMS
paper's headline experiment), from a real plan replayed by the simulator:

    python benchmarks/resnet1001_scaling.py [--image-size S] [--stages K] [--efficiency E]
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gems import models
from gems.partition import plan
from gems.schedule.network import V100_CLUSTER
from gems.schedule.simulate import EFFICIENCY, V100_FLOPS, costs_from_plan, simulate
from gems.schedule.sweep import scaling
from gems.units import format_size


def main(argv: Sequence[str]) -> None:
    """Print a weak-scaling prediction of pre-activation ResNet-1001 under mast on a V100 cluster."""
    parser = argparse.ArgumentParser(prog="python -m gems.schedule.simulate resnet1001")
    parser.add_argument("--image-size", type=int, default=384, help="square images (384: fits a 16 GB V100 at K=4)")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--efficiency", type=float, default=EFFICIENCY, help="fraction of fp32 peak sustained")
    args = parser.parse_args(argv)
    S, K = args.image_size, args.stages
    p = plan(models.build("preact-resnet1001", num_classes=1000), input_shape=(3, S, S), batch_size=2, stages=K,
             schedule="mast", model_name="preact-resnet1001")
    costs, net = costs_from_plan(p, V100_FLOPS, args.efficiency), V100_CLUSTER
    one = simulate("mast", K, 1, costs, net)
    print(f"preact-resnet1001, {S}x{S}, schedule mast, K={K}, 1 image per replica (2 per group per step), fp32\n"
          f"device {V100_FLOPS / 1e12:.1f} TFLOP/s x {args.efficiency} efficiency; {net.ranks_per_node} GPUs/node, "
          f"NVLink {net.intra_bandwidth / 1e9:.0f} GB/s, InfiniBand EDR {net.bandwidth / 1e9:.1f} GB/s, "
          f"{net.allreduce} allreduce per stage, started when its last backward is done (overlapped)\n"
          f"per group: bubble {one.bubble_fraction:.1%}, est. peak memory {format_size(max(one.peak_bytes))}/GPU\n")
    print(f"{'GPUs':>6}  {'groups':>6}  {'step (ms)':>9}  {'images/s':>9}  {'efficiency':>10}")
    for point in scaling("mast", K, 1, costs, net, [2 ** i for i in range(11) if K * 2 ** i <= 1024]):
        print(f"{K * point.groups:>6}  {point.groups:>6}  {point.step_time * 1e3:>9.1f}  "
              f"{2 * point.groups / point.step_time:>9.1f}  {point.efficiency:>10.2%}")
    print("\nGEMS (Jain et al., SC 2020) report 97.32% weak-scaling efficiency for ResNet-1k on 1,024 V100 GPUs.")


if __name__ == "__main__":
    main(sys.argv[1:])
