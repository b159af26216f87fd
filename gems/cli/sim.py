"""gems-sim: simulate pipeline schedules without a model.

The utilization of one training step, every stage costing forward 1 and backward 2 (split:
input-gradient 1 + weight-gradient 1, the first stage included) per micro-batch, messages free,
optimizer left out: the sum over positions of compute time / (positions x step time)::

    gems-sim utilization --schedule mast --stages 8 --micro-batches 8 --split-backward
    gems-sim utilization --schedule zbv --stages 8 --micro-batches 16 --json zbv.json

K (--stages) counts positions (devices). M (--micro-batches) is micro-batches per replica for
mast, which runs two replicas (so 2M are in flight), and per pipeline for the others. ``zbv`` and
``dualpipev`` (other systems' schedules, ``gems.schedule.peers``: 2K stages in a V, always with
the backward split) are modelled in the same way for comparison.

Exit statuses: 0 printed, 2 bad input.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from gems.cli import parser, run
from gems.errors import GemsError
from gems.schedule import generators as sch, peers, simulate
from gems.schedule.search import memory_bound
from gems.schedule.validate import validate

PROG = "gems-sim"


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(PROG, "Simulate pipeline schedules without a model.")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    u = commands.add_parser("utilization", help="the utilization of one step with unit costs",
                            description="Utilization of one step: forward 1, backward 2 (split: input-gradient 1 + "
                                        "weight-gradient 1) per stage and micro-batch, messages free, optimizer "
                                        "left out.")
    u.add_argument("--schedule", required=True, choices=sch.SCHEDULES + peers.PEERS,
                   help="gems's schedules, or zbv / dualpipev for comparison")
    u.add_argument("--stages", type=int, required=True, metavar="K", help="positions (devices) per pipeline")
    u.add_argument("--micro-batches", type=int, default=1, metavar="M",
                   help="per replica for mast (2M in flight), per pipeline otherwise")
    u.add_argument("--split-backward", action="store_true",
                   help="split each backward into input- and weight-gradient actions (zbv and dualpipev always do)")
    u.add_argument("--json", metavar="FILE", help="also write the result as JSON (key 'utilization')")
    args = p.parse_args(argv)
    return run(PROG, lambda: _utilization(args))


def _utilization(args) -> None:
    name, K, M = args.schedule, args.stages, args.micro_batches
    if name in peers.PEERS:
        lists = peers.peer_schedule(name, K, M)
        split, variant, in_flight = True, "published order", None
    else:
        sch.check(name, K, M)
        split = args.split_backward
        lists = sch.schedule(name, K, M, split=split)
        validate(name, K, M, lists)
        variant = sch.variant(name, K, M, split)
        in_flight = [max(sum(live.values()) for _, live, *_ in sch.moments(actions)) for actions in lists]
    value = simulate.utilization(lists)
    result = {"schedule": name, "stages": K, "micro_batches": M, "split_backward": split,
              "utilization": round(value, 6), "order": variant,
              "peak_in_flight": in_flight}
    print(f"{name} K={K} M={M}{' split backward' if split else ''}: utilization {value:.4f} ({variant})")
    if in_flight is not None:
        bound = f", mast's bound {memory_bound(K, M)}" if name == "mast" else ""
        print(f"micro-batches in flight per position, at most: {in_flight}{bound}")
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        except OSError as error:
            raise GemsError(f"cannot write --json {args.json}: {error.strerror}; name a writable file") from None


if __name__ == "__main__":
    sys.exit(main())
