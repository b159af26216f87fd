"""benchmarks/gpu_check.py (``make gpu-check``) where it can be checked without a GPU: it refuses
a machine without CUDA in one line, and it reads the host tier of a summary apart. (That it reads a
real gems-train summary is checked in tests/test_train.py, on a run that test makes anyway.)"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import REPO
from gems import partition
from gems.cli import bench, plan, train


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_2():
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--report", "/dev/null"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "gpu-check: torch sees no CUDA device on this machine; run it where a GPU is"


HOST_SUMMARY = """gems-train: summary
  throughput       8.97 images/s
  peak device-tier memory per rank over the last step (tensors: held at the start + CPU allocator high-water mark) vs plan estimate:
    rank 0 (position 0): 96.38 MiB measured, 105.15 MiB estimated (+9.1%); process peak 1.03 GiB
    rank 1 (position 1): 96.40 MiB measured, 105.15 MiB estimated (+9.1%); process peak 1.04 GiB
  host memory of model state per rank (--state-placement; tensors: the host tier's copies and optimizer state) vs plan estimate:
    rank 0 (position 0): 170.66 MiB measured, 170.66 MiB estimated (-0.0%)
    rank 1 (position 1): 170.66 MiB measured, 170.66 MiB estimated (-0.0%)
gems-train: done
"""


def test_a_summary_s_host_tier_is_read_apart_from_the_device_tier():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check  # noqa: PLC0415

    summary = gpu_check.train_summary(HOST_SUMMARY)
    assert summary["images_per_s"] == 8.97
    assert [m["measured"] for m in summary["memory"]] == ["96.38 MiB", "96.40 MiB"]
    assert [m["estimated"] for m in summary["host_tier"]] == ["170.66 MiB", "170.66 MiB"]
    assert gpu_check._bytes("1.5 GiB") == 1.5 * 2**30


def test_every_command_it_launches_is_one_its_program_accepts(monkeypatch, tmp_path):
    """The parts' command lines, checked here as each program parses and validates its flags before it
    touches a device: a gpu-check part whose command a program refuses costs a GPU session the part."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check  # noqa: PLC0415

    # the program a command runs, by its console script or by ``python -m`` its module
    programs = {**{name: name for name in gpu_check.MODULES}, **{m: name for name, m in gpu_check.MODULES.items()}}

    def program(cmd: list[str]) -> tuple[str, list[str]]:
        at = next(i for i, word in enumerate(cmd) if Path(word).name in programs)
        return programs[Path(cmd[at]).name], cmd[at + 1:]

    launched = []

    def run(cmd, timeout, env=None):
        launched.append(cmd)
        if program(cmd)[0] == "gems-plan" and "--json" in cmd:
            # a plan for a later --plan to read (a tiny model's: only the flags are checked here)
            tiny = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()), nn.Sequential(nn.Linear(144, 2)))
            partition.plan(tiny, (3, 8, 8), batch_size=2, stages=1).to_json(cmd[cmd.index("--json") + 1])
        return {"command": " ".join(cmd), "code": 0, "seconds": 0.0, "stdout": "", "stderr": ""}

    monkeypatch.setattr(gpu_check, "run", run)
    gpu_check.pipelines("mpiexec", 2, tmp_path, 60.0, lambda parts: None)
    checked = {"gems-train": 0, "gems-bench": 0, "gems-plan": 0}
    for cmd in launched:
        name, argv = program(cmd)
        if name == "gems-plan":
            plan.build_parser().parse_args(argv)
        elif name == "gems-bench":
            bench.parse(argv).validate(world=int(cmd[cmd.index("-n") + 1]))
        else:
            train.parse(argv).validate()
        checked[name] += 1
    assert checked["gems-train"] >= 10 and checked["gems-bench"] >= 3 and checked["gems-plan"] >= 1, checked
