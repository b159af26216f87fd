"""benchmarks/gpu_check.py (``make gpu-check``) where it can be checked without a GPU: it refuses
a machine without CUDA in one line. (That it reads a real gems-train summary is checked in
tests/test_train.py, on a run that test makes anyway.)"""
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
