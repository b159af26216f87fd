"""benchmarks/out_of_core.py runs end to end on a small model (pre-activation ResNet-20) and prints
well-formed figures (the figures themselves belong to the benchmark, not to a test). Its ``main``
runs in this process (its planning on fake tensors too); its gems-train runs are real launches."""
from __future__ import annotations

import importlib.util
import re

import pytest

from conftest import REPO, mpiexec

SCRIPT = REPO / "benchmarks" / "out_of_core.py"
ROW = re.compile(r"^\s*(\d+)  (none, no budget|none|all|auto)\s+(.+?)\s+([\d.]+)\s+([\d.]+)x  (.*)$", re.M)


def benchmark():
    spec = importlib.util.spec_from_file_location("out_of_core", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(420)
def test_out_of_core_benchmark_reports_sides_policies_times_and_estimates(capsys, monkeypatch):
    ooc = benchmark()
    monkeypatch.setattr(ooc, "MPIEXEC", mpiexec())
    status = ooc.main(["--model", "tests/assets/tiny_model.py:small_preact", "--budget", "8MiB", "--side-step", "8",
                       "--max-side", "64", "--steps", "2", "--between", "0", "--timeout", "120"])
    out = capsys.readouterr().out
    assert status == 0, out
    plain, policed = map(int, re.search(r"largest side (\d+) without policies, (\d+) with auto", out).groups())
    assert 0 < plain < policed
    assert f"at side {plain} (and below) auto chooses none,none" in out
    rows = ROW.findall(out)
    sides = sorted({int(side) for side, run, *_ in rows if run == "auto"})
    assert [(int(side), run) for side, run, *_ in rows] == \
        [(plain, "none"), (plain, "all")] + [(s, r) for s in sides for r in ("auto", "none, no budget")]
    assert sides[-1] == policed and all(plain < s for s in sides)
    for side, run, policies, step, ratio, ranks in rows:
        assert float(step) > 0 and len(policies.split(" | ")) == 2
        assert float(ratio) == 1.0 if run.startswith("none") else float(ratio) > 0
        if run == "auto":
            assert "recompute" in policies
        if "no budget" not in run:
            errors = [float(e) for e in re.findall(r"\(([+-][\d.]+)%\)", ranks)]
            assert len(errors) == 2 and all(abs(e) < 50 for e in errors), ranks
