"""gems.obs.memory: the CPU peak meter sees known allocations, counts held storages once, returns
to its baseline between windows; gems-train's summary sets a well-formed measured peak beside
the plan's estimate (gems-bench's table: tests/test_bench.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from conftest import REPO, cli_cases
from gems.obs import memory
from gems.units import parse_size

MiB = 2**20
CPU = torch.device("cpu")


def test_meter_sees_an_allocation_inside_the_window():
    with memory.PeakMeter(CPU) as meter:
        block = torch.empty(64 * MiB, dtype=torch.uint8)
        block.fill_(1)
        del block
    assert 64 * MiB <= meter.peak <= 65 * MiB


def test_next_window_starts_from_baseline():
    with memory.PeakMeter(CPU) as first:
        kept = torch.empty(16 * MiB, dtype=torch.uint8)   # allocated in the window, alive after it
    with memory.PeakMeter(CPU) as second:
        small = torch.ones(1024)
        del small
    assert first.peak >= 16 * MiB
    assert second.peak < MiB
    del kept


def test_held_storages_count_once_and_add_to_the_window():
    held = torch.zeros(MiB // 4)                                  # 1 MiB of float32
    meter = memory.PeakMeter(CPU)
    meter.start([held, held[:10], held.view(16, -1)])             # views share the storage
    block = torch.empty(8 * MiB, dtype=torch.uint8)
    del block
    peak = meter.stop()
    assert meter.held == MiB
    assert 9 * MiB <= peak <= 10 * MiB


def test_since_measures_only_what_follows_but_counts_what_is_alive():
    meter = memory.PeakMeter(CPU)
    meter.start()
    before = torch.empty(32 * MiB, dtype=torch.uint8)       # transient before the measured part
    del before
    alive = torch.empty(4 * MiB, dtype=torch.uint8)         # allocated before, alive during it
    time.sleep(0.01)
    since = time.time()
    during = torch.empty(2 * MiB, dtype=torch.uint8)
    del during
    peak = meter.stop(since=since)
    assert 6 * MiB <= peak < 7 * MiB
    del alive


def test_close_turns_the_recorder_off():
    meter = memory.PeakMeter(CPU)
    meter.start()
    meter.close()
    with memory.PeakMeter(CPU) as again:   # a second recorder could not start if the first were on
        torch.empty(MiB, dtype=torch.uint8)
    assert again.peak >= MiB


def test_training_tensors_are_parameters_gradients_buffers_and_optimizer_state():
    model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    params = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    extra = torch.zeros(10)
    assert memory.storage_bytes(memory.training_tensors([model], optimizer, extra)) == 3 * params + buffers + 40


def test_estimate_error_kind_and_place():
    assert memory.estimate_error(100, 110) == "+10.0%"
    assert memory.estimate_error(0, 5) == "n/a"
    assert "allocator" in memory.kind(CPU)
    assert memory.place(1, 0) == "position 1"
    assert memory.place(0, 2) == "position 0, tile 2"   # a tile group's member, with its own estimate
    assert memory.place(0, 2, bound=True) == "position 0, tile 2; the leader's estimate, a bound"   # an older plan


SUMMARY = re.compile(r"rank (\d) \(position (\d)\): ([\d.]+) (KiB|MiB|GiB) measured, ([\d.]+) (KiB|MiB|GiB) "
                     r"estimated \(([+-][\d.]+)%\); process peak [\d.]+ (MiB|GiB)")


MADE = re.compile(r"that step was the optimizer's first: its update made the optimizer's state, up to "
                  r"([\d.]+ \w+) per rank on the device, at the step's end")


def test_train_summary_sets_measured_peak_beside_the_estimate():
    """Two runs in one process: the summary's measured peak of a second step is close to the plan's
    estimate; a run of one step meters the optimizer's first, whose state its update makes at the
    end, and says how much: the first step's peak plus that is the second step's peak."""
    args = ["--model", "tests/assets/tiny_model.py:tiny", "--image-size", "32", "--batch-size", "2", "--stages", "1",
            "--schedule", "mp", "--workers", "0", "--no-progress"]
    two, one = cli_cases("gems.cli.train", [[*args, "--steps", "2"], [*args, "--steps", "1"]])
    assert two["code"] == one["code"] == 0, (two["stderr"], one["stderr"])
    found = SUMMARY.findall(two["stdout"])
    assert len(found) == 1, two["stdout"]
    _, _, measured, unit, _, _, error, _ = found[0]
    assert float(measured) > 0
    assert abs(float(error)) < 25, two["stdout"]   # the plan's estimate is close to what was measured
    assert not MADE.search(two["stdout"]), two["stdout"]   # its state was there when the second step began
    (_, _, first, first_unit, *_), = SUMMARY.findall(one["stdout"])
    made = MADE.search(one["stdout"])
    assert made, one["stdout"]
    steady = parse_size(f"{first}{first_unit}") + parse_size(made.group(1).replace(" ", ""))
    assert abs(steady / parse_size(f"{measured}{unit}") - 1) < 0.01, (one["stdout"], two["stdout"])


HOST_TIER = re.compile(r"rank (\d) \(position (\d)\): ([\d.]+) (KiB|MiB|GiB) measured, ([\d.]+) (KiB|MiB|GiB) "
                       r"estimated \(([+-][\d.]+)%\)$", re.MULTILINE)


def test_train_summary_sets_the_host_tier_apart_from_the_device_tier():
    """--state-placement host-optimizer: the summary's device-tier peak leaves the host tier out,
    and the host tier (copies and AdamW's state) equals the plan's state_host_bytes."""
    train = Path(sys.executable).parent / "gems-train"
    result = subprocess.run([sys.executable, str(train), "--model", "tests/assets/tiny_model.py:tiny",
                             "--image-size", "32", "--batch-size", "2", "--stages", "1", "--schedule", "mp",
                             "--optimizer", "adamw", "--state-placement", "host-optimizer",
                             "--steps", "2", "--workers", "0", "--no-progress"],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    device, host = result.stdout.split("host memory of model state per rank")
    assert "peak device-tier memory per rank" in device and len(SUMMARY.findall(device)) == 1, result.stdout
    found = HOST_TIER.findall(host)
    assert len(found) == 1, result.stdout
    assert float(found[0][2]) > 0 and abs(float(found[0][6])) < 1, result.stdout
