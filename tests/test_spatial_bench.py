"""benchmarks/spatial.py on two loopback ranks (threads: its figures mean nothing here, only that it
runs and reports): the ratio line, ``--ops`` rank 0's operations, ``--lockstep``'s line, and ``--instant``
keeping the tile group's messages off the communicator."""
from __future__ import annotations

import argparse
import importlib.util
import re

import pytest

from conftest import REPO
from gems.comm import loopback
from gems.spatial.tiles import TILE_TAG

TILES_OWN = {"_Window", "_WindowBackward", "_AllReduce", "_BatchNorm", "_BatchNormBackward"}


def benchmark():
    spec = importlib.util.spec_from_file_location("spatial_bench", REPO / "benchmarks" / "spatial.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("instant", [None, "all"])
def test_the_benchmark_reports_its_ratio_and_instant_keeps_the_tiles_off_the_wire(instant, capsys):
    bench = benchmark()
    args = argparse.Namespace(model="resnet18", image_size=64, batch_size=1, grid=None, end=None, steps=2, warmup=1,
                              layers=0, one_rank=False, mp=False, spin=False, instant=instant, shard_optimizer=False,
                              ops=0 if instant else 4, lockstep=instant is None)
    received = loopback.run(2, lambda comm: bench.run(args, comm) or dict(comm.received), timeout=120)
    out = capsys.readouterr().out.splitlines()
    line = next(line for line in out if "of the ceiling" in line)
    tiles = [sum(n for tag, n in r.items() if tag >= TILE_TAG) for r in received]
    if instant is None:
        assert "(gradient allreduce counted;" in line and all(n > 0 for n in tiles), (line, tiles)
        # --lockstep: its step and both ratios, on the line after spatial's
        locked = out[out.index(line) + 1]
        assert locked.startswith("  ceiling in lockstep: every normalisation a barrier") and \
            re.search(r" ms +\d\.\d{3} of the ceiling; spatial \d\.\d{3} of it$", locked), locked
        # --ops: four operations, tiles' own among them (autograd Functions of gems.spatial: the ceiling has
        # none), then the totals
        at = next(i for i, text in enumerate(out) if "rank 0's operations" in text)
        rows = [text.split() for text in out[at + 2:at + 7]]
        assert len(rows) == 5 and rows[-1][3:] == ["all", "operations"], out[at:]
        assert any(r[3] in TILES_OWN and float(r[1]) == 0 < float(r[0]) for r in rows[:4]), out[at:]
        assert all(float(a) - float(b) == pytest.approx(float(d), abs=0.02) for a, b, d, *_ in rows), out[at:]
        assert not any("rank 0's operations" in text for text in out[at + 1:])
    else:
        assert "(all communication instant: the tiles' compute alone;" in line and tiles == [0, 0], (line, tiles)
