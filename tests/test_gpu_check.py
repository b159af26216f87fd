"""benchmarks/gpu_check.py (``make gpu-check``) where it can be checked without a GPU: it refuses
a machine without CUDA in one line, and it reads the host tier of a summary apart. (That it reads a
real gems-train summary is checked in tests/test_train.py, on a run that test makes anyway.)"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import REPO


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
