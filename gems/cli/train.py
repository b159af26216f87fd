"""gems-train: train a model too large for one device, on very large images.

One node, two ranks (K = 2 stages, the mirrored GEMS-MAST schedule)::

    mpiexec -n 2 gems-train --model resnet50 --image-size 2048 --batch-size 2 --stages 2 --steps 100

Several groups (D = ranks / K data-parallel pipelines)::

    mpiexec -n 8 gems-train --model resnet101 --image-size 2048 --batch-size 8 --stages 4 --steps 100

A library's model, fine-tuned from its published weights with a new head::

    mpiexec -n 2 gems-train --model timm:convnext_small --model-arg drop_path_rate=0.1 \
        --init-from convnext_small.safetensors --init-exclude 'head.fc.*' --num-classes 5 ...

Slurm: ``srun --mpi=pmi2 gems-train ...`` (see jobs/README.md). Exit statuses: 0 done,
1 failure, 2 bad input, 3 stopped by SIGTERM/SIGUSR1 after saving a checkpoint.
"""
from __future__ import annotations

import sys

from gems.cli import communicator, dataclass_parser, setup_on_every_rank
from gems.train.config import TrainConfig


def parse(argv: list[str] | None = None) -> TrainConfig:
    p = dataclass_parser("gems-train", "Train a CNN split into pipeline stages across MPI ranks.", TrainConfig)
    args = p.parse_args(argv)
    if not args.timeout > 0:  # the communicator needs it, before the ranks can report errors together
        p.error(f"argument --timeout: {args.timeout:g} is not a positive number of seconds")
    return TrainConfig(**vars(args))


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)  # argparse reports bad flags itself (exit 2)
    from gems import comm as comm_lib  # noqa: PLC0415 - MPI starts only for a real run
    from gems.train import handshake, trainer  # noqa: PLC0415

    comm = communicator("gems-train", cfg.comm, cfg.timeout, cfg.allow_shared_gpu)
    comm_lib.configure_threads(comm)
    job = setup_on_every_rank("gems-train", comm, lambda: trainer.prepare(cfg, comm))
    if job is None:  # --dry-run
        sys.exit(0)
    handshake.agree("gems-train", comm, handshake.training(job))  # same plan, model, gems everywhere?
    with comm.guard():
        status = trainer.run(job)
    sys.exit(status)


if __name__ == "__main__":
    main()
