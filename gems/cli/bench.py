"""gems-bench: measure every schedule on the same model, data and ranks.

Two ranks, one thread each (the figures of the GEMS-MAST issue)::

    OMP_NUM_THREADS=1 mpiexec -n 2 gems-bench --model resnet18 --image-size 512 --batch-size 2 \\
        --schedules mp,gpipe,1f1b,mast --steps 10 --warmup 2 --json bench.json --trace-dir traces/

Prints images/s, the ratio to mp, efficiency against world x one unpartitioned rank, the bubble
fraction, the simulator's prediction from the measured stage times, and peak memory per rank
(measured and planned). See ``gems.bench`` for how each figure is defined.
"""
from __future__ import annotations

import argparse
import sys
import typing
from dataclasses import MISSING, fields

from gems.bench import BenchConfig
from gems.cli import USER_ERROR, parser
from gems.errors import GemsError


def _argument_parser() -> argparse.ArgumentParser:
    p = parser("gems-bench", "Benchmark pipeline schedules against each other and one unpartitioned rank.")
    hints = typing.get_type_hints(BenchConfig)
    for f in fields(BenchConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        if hints[f.name] is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"])
            continue
        base = next((t for t in typing.get_args(hints[f.name]) if t is not type(None)), hints[f.name])
        p.add_argument(flag, type=base, default=default, choices=f.metadata.get("choices"), help=f.metadata["help"])
    return p


def parse(argv: list[str] | None = None) -> BenchConfig:
    return BenchConfig(**vars(_argument_parser().parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)
    from gems import bench  # noqa: PLC0415
    from gems import comm as comm_lib  # noqa: PLC0415 - MPI starts only for a real run

    comm = comm_lib.create(cfg.comm, timeout=cfg.timeout)
    comm_lib.configure_threads(comm)
    # Input errors are found on every rank before any collective, so all ranks agree to stop.
    try:
        cfg.validate(comm.size)
        error = None
    except GemsError as e:
        error = str(e)
    if error is not None:
        if comm.rank == 0:
            print(f"gems-bench: error: {error}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR)
    with comm.guard():
        report = bench.run(cfg, comm)
        if report is not None:
            print(bench.table(report), flush=True)
            if cfg.json:
                print(f"gems-bench: results written to {cfg.json}", flush=True)


if __name__ == "__main__":
    main()
