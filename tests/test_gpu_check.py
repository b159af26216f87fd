"""benchmarks/gpu_check.py (``make gpu-check``) where it can be checked without a GPU: it refuses
a machine without CUDA in one line, and it reads the figures of a real gems-train summary."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_2():
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--report", "/dev/null"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "gpu-check: torch sees no CUDA device on this machine; run it where a GPU is"


def test_it_reads_a_real_gems_train_summary():
    result = subprocess.run([*gpu_check.command("gems-train"), "--model", "tests/assets/tiny_model.py:tiny",
                             "--image-size", "16", "--batch-size", "2", "--stages", "1", "--steps", "3",
                             "--workers", "0", "--no-progress"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    figures = gpu_check.train_summary(result.stdout)
    assert figures["images_per_s"] > 0
    assert [m["rank"] for m in figures["memory"]] == [0] and "%" in figures["memory"][0]["error"]
