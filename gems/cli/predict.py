"""gems-predict: predict with a gems-train checkpoint on the same kind of launch, model never gathered.

Masks (and class probabilities) for a folder of images, 2048x2048 or whole slides by sliding
windows::

    mpiexec -n 2 gems-predict --checkpoint-dir ckpt --data scans/ --out masks/ --stages 2

Exit statuses: 0 done, 1 failure, 2 bad input.
"""
from __future__ import annotations

import sys

from gems.cli import communicator, dataclass_parser, setup_on_every_rank


def main(argv: list[str] | None = None) -> None:
    from gems.train.predictor import PredictConfig  # noqa: PLC0415

    p = dataclass_parser("gems-predict", "Predict with a checkpoint of gems-train, pipelined across MPI ranks.",
                         PredictConfig)
    args = p.parse_args(argv)
    if not args.timeout > 0:
        p.error(f"argument --timeout: {args.timeout:g} is not a positive number of seconds")
    cfg = PredictConfig(**vars(args))
    from gems import comm as comm_lib  # noqa: PLC0415
    from gems.train import predictor  # noqa: PLC0415

    comm = communicator("gems-predict", cfg.comm, cfg.timeout, cfg.allow_shared_gpu)
    comm_lib.configure_threads(comm)
    job = setup_on_every_rank("gems-predict", comm, lambda: predictor.prepare(cfg, comm))
    with comm.guard():
        status = predictor.run(job)
    sys.exit(status)


if __name__ == "__main__":
    main()
