"""gems-bench: measure every schedule on the same model, data and ranks.

Two ranks, one thread each (the figures of the GEMS-MAST issue)::

    OMP_NUM_THREADS=1 mpiexec -n 2 gems-bench --model resnet18 --image-size 512 --batch-size 2 \\
        --schedules mp,gpipe,1f1b,mast --steps 10 --warmup 2 --json bench.json --trace-dir traces/

Spatial parallelism: ``--spatial 2`` runs every schedule with stage 0's first units on tile groups
of 2 ranks (world = groups x (stages + (P-1) x positions holding stage 0); K defaults to 1)::

    OMP_NUM_THREADS=1 mpiexec -n 2 gems-bench --model resnet18 --image-size 512 --schedules mp --spatial 2

Prints images/s, the ratio to mp, efficiency against world x one unpartitioned rank, the bubble
fraction, the simulator's prediction from the measured stage times, and peak memory per rank
(measured and planned). See ``gems.bench.runner`` for how each figure is defined.
"""
from __future__ import annotations


from gems.bench import BenchConfig
from gems.cli import communicator, dataclass_parser, setup_on_every_rank


def parse(argv: list[str] | None = None) -> BenchConfig:
    p = dataclass_parser("gems-bench", "Benchmark pipeline schedules against each other and one "
                                       "unpartitioned rank.", BenchConfig)
    args = p.parse_args(argv)
    if not args.timeout > 0:  # the communicator needs it, before the ranks can report errors together
        p.error(f"argument --timeout: {args.timeout:g} is not a positive number of seconds")
    return BenchConfig(**vars(args))


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)
    from gems import bench  # noqa: PLC0415
    from gems.obs import bench_report  # noqa: PLC0415
    from gems import comm as comm_lib  # noqa: PLC0415 - MPI starts only for a real run
    from gems.train import handshake  # noqa: PLC0415

    comm = communicator("gems-bench", cfg.comm, cfg.timeout, cfg.allow_shared_gpu)
    comm_lib.configure_threads(comm)
    setup_on_every_rank("gems-bench", comm, lambda: (cfg.validate(comm.size), cfg.compiler(comm.device.type)))
    handshake.agree("gems-bench", comm, handshake.benchmark(cfg))
    with comm.guard():
        report = bench.run(cfg, comm)
        if report is not None:
            print(bench_report.table(report), flush=True)
            if cfg.json:
                print(f"gems-bench: results written to {cfg.json}", flush=True)


if __name__ == "__main__":
    main()
