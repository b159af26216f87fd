"""gems-train: train a model too large for one device, on very large images.

One node, two ranks (K = 2 stages, the mirrored GEMS-MAST schedule)::

    mpiexec -n 2 gems-train --model resnet50 --image-size 2048 --batch-size 2 --stages 2 --steps 100

Several groups (D = ranks / K data-parallel pipelines)::

    mpiexec -n 8 gems-train --model resnet101 --image-size 2048 --batch-size 8 --stages 4 --steps 100

Slurm: ``srun --mpi=pmi2 gems-train ...`` (see jobs/README.md). Exit statuses: 0 done,
1 failure, 2 bad input, 3 stopped by SIGTERM/SIGUSR1 after saving a checkpoint.
"""
from __future__ import annotations

import argparse
import sys
import typing
from dataclasses import MISSING

from gems.cli import USER_ERROR, parser
from gems.config import TrainConfig, config_fields
from gems.errors import GemsError


def _argument_parser():
    p = parser("gems-train", "Train a CNN split into pipeline stages across MPI ranks.")
    hints = typing.get_type_hints(TrainConfig)
    for f in config_fields():
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        default = f.default if f.default is not MISSING else None
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=f.metadata["help"])
            continue
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        p.add_argument(flag, type=base, default=default, choices=f.metadata.get("choices"),
                       help=f.metadata["help"])
    return p


def parse(argv: list[str] | None = None) -> TrainConfig:
    args = _argument_parser().parse_args(argv)
    return TrainConfig(**vars(args))


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)  # argparse reports bad flags itself (exit 2)
    from gems import comm as comm_lib  # noqa: PLC0415 - MPI starts only for a real run
    from gems import trainer  # noqa: PLC0415

    comm = comm_lib.create(cfg.comm, timeout=cfg.timeout)
    comm_lib.configure_threads(comm)
    # Setup has no collectives, so every rank finishes it; then all agree on the outcome
    # and a user error is reported once, by rank 0, with exit status 2 on every rank.
    try:
        job, error = trainer.prepare(cfg, comm), None
    except GemsError as e:
        job, error = None, str(e)
    errors = comm.allgather_object(error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        if comm.rank == 0:
            rank, message = failed[0]
            where = "" if len(failed) == comm.size else f" (rank {rank})"
            print(f"gems-train: error{where}: {message}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR)
    if job is None:  # --dry-run
        sys.exit(0)
    with comm.guard():
        status = trainer.run(job)
    sys.exit(status)


if __name__ == "__main__":
    main()
