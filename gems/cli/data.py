"""gems-data: make datasets for gems-train.

A synthetic segmentation set (shapes on textured backgrounds; masks hold class indices), 2048 x 2048,
with a validation split, written by 4 processes::

    gems-data synth --task segmentation --size 2048 --count 1000 --val-count 100 --workers 4 data/shapes
    gems-train --task segmentation --data data/shapes/train --num-classes 3 ...

A classification set (one folder per class, readable as an ImageFolder)::

    gems-data synth --task classification --size 512 --count 3000 --val-count 300 data/shapes-cls

Exit statuses: 0 written, 2 bad input (a non-empty DIR/train, a bad size or count).
"""
from __future__ import annotations

import argparse
import sys

from gems.cli import parser, run
from gems.train import synth


def main(argv: list[str] | None = None) -> None:
    p = parser("gems-data", "Make datasets for gems-train.")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = commands.add_parser("synth", help="write a synthetic, learnable dataset of coloured shapes",
                            description="Write DIR/train (and DIR/val): segmentation as images/ + masks/ "
                                        "(mask pixel = class index, 0 = background), classification as "
                                        "one folder per class.",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--task", choices=("segmentation", "classification"), default="segmentation",
                   help="what the labels are")
    s.add_argument("--size", type=int, default=2048, help="side of the square images, in pixels")
    s.add_argument("--count", type=int, required=True, help="training samples to write")
    s.add_argument("--val-count", type=int, default=0, help="validation samples to write to DIR/val")
    s.add_argument("--classes", type=int, default=None,
                   help="classes, background included for segmentation (unset: 3)")
    s.add_argument("--seed", type=int, default=0, help="the dataset is a pure function of this seed")
    s.add_argument("--workers", type=int, default=0, help="processes writing files (0 = this one)")
    s.add_argument("dir", metavar="DIR", help="folder to write into; DIR/train must be new or empty")
    args = p.parse_args(argv)

    def body() -> None:
        line = synth.write(args.dir, args.task, args.size, args.count, args.val_count, args.classes,
                           args.seed, args.workers)
        print(f"gems-data: {line}")

    sys.exit(run("gems-data", body))


if __name__ == "__main__":
    main()
