"""benchmarks/spatial.py on two loopback ranks (threads: its figures mean nothing here, only that it
runs and reports): the ratio line, and ``--instant`` keeping the tile group's messages off the
communicator."""
from __future__ import annotations

import argparse
import importlib.util

import pytest

from conftest import REPO
from gems.comm import loopback
from gems.spatial.tiles import TILE_TAG


def benchmark():
    spec = importlib.util.spec_from_file_location("spatial_bench", REPO / "benchmarks" / "spatial.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("instant", [None, "all"])
def test_the_benchmark_reports_its_ratio_and_instant_keeps_the_tiles_off_the_wire(instant, capsys):
    bench = benchmark()
    args = argparse.Namespace(model="resnet18", image_size=64, batch_size=1, grid=None, end=None, steps=2, warmup=1,
                              layers=0, one_rank=False, mp=False, spin=False, instant=instant, shard_optimizer=False)
    received = loopback.run(2, lambda comm: bench.run(args, comm) or dict(comm.received), timeout=120)
    line = next(line for line in capsys.readouterr().out.splitlines() if "of the ceiling" in line)
    tiles = [sum(n for tag, n in r.items() if tag >= TILE_TAG) for r in received]
    if instant is None:
        assert "(gradient allreduce counted;" in line and all(n > 0 for n in tiles), (line, tiles)
    else:
        assert "(all communication instant: the tiles' compute alone;" in line and tiles == [0, 0], (line, tiles)
