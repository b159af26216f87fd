"""gems-bench's main on several command lines, one after the other, in one launch (one interpreter
and one torch import per rank for all of them), for tests/test_bench.py:

    mpiexec -n N python tests/distributed/bench_runs.py '[["--model", "x", ...], ...]'

Before each run rank 0 prints the line ``SEPARATOR`` followed by the run's index, so that the test
splits stdout into what each run printed (gems-bench prints on rank 0 only). A run that exits (a
bad-input status, an abort) ends the launch, and so the runs after it.
"""
from __future__ import annotations

import json
import sys

from gems.cli import bench
from gems.comm import world_rank

SEPARATOR = "=== bench_runs.py: run"


def main() -> None:
    for i, argv in enumerate(json.loads(sys.argv[1])):
        if world_rank() == 0:
            print(f"{SEPARATOR} {i}", flush=True)
        bench.main([str(a) for a in argv])


if __name__ == "__main__":
    main()
