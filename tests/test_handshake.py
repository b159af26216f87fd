"""Ranks agree on what they run before any tensor moves: a different plan or model on one rank
stops the job with one line naming the field and the ranks (exit 2); a received tensor of the
wrong size is a clear error, never a silent reshape or a hang."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import DISTRIBUTED, REPO, _kill_tree, exit_status, mpiexec, run_mpi
from gems.cli import plan as gems_plan
from gems.train.handshake import FIELDS, disagreement, model_summary

TRAIN = Path(sys.executable).parent / "gems-train"
TINY = "tests/assets/tiny_model.py:tiny"
COMMON = ["--image-size", "32", "--workers", "0", "--no-progress", "--batch-size", "4", "--stages", "2",
          "--steps", "2"]


def test_equal_fingerprints_agree():
    same = {"gems": "0.1.0 (source abc)", "cuts": [0, 2, 5], "model": "5 units, 1 parameters, x"}
    assert disagreement([same, dict(same), dict(same)]) is None


def test_the_first_differing_field_is_named_with_who_holds_what():
    a = {"gems": "0.1.0", "cuts": [0, 3, 6], "boundaries": "1f2e"}
    b = {"gems": "0.1.0", "cuts": [0, 2, 6], "boundaries": "9c0d"}
    assert disagreement([a, b, a]) == (
        "ranks disagree on the plan's cut points: ranks 0,2 have [0, 3, 6], rank 1 has [0, 2, 6] (they also "
        "disagree on: stage boundary shapes and dtypes): give every rank the same --plan file and partitioning "
        "flags")


def test_versions_come_first_and_many_ranks_are_written_as_ranges():
    fingerprints = [{"gems": "0.1.0", "model": "m"} for _ in range(8)]
    fingerprints[5] = {"gems": "0.2.0", "model": "n"}
    message = disagreement(fingerprints)
    assert message.startswith("ranks disagree on the gems version: ranks 0-4,6,7 have 0.1.0, rank 5 has 0.2.0")
    assert message.endswith(f"(they also disagree on: model structure): {FIELDS['gems'][1]}")


def test_settings_held_as_dicts_show_only_the_entries_that_differ():
    a = {"optimizer": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}}
    b = {"optimizer": {"optimizer": "sgd", "lr": 0.2, "momentum": 0.9}}
    assert disagreement([a, b]).startswith("ranks disagree on the optimizer settings: rank 0 has {'lr': 0.1}, "
                                           "rank 1 has {'lr': 0.2}: ")


def test_model_summary_sees_structure_not_weights():
    sys.path.insert(0, str(REPO / "tests" / "assets"))
    from tiny_model import tiny  # noqa: PLC0415

    torch.manual_seed(0)
    first = tiny(num_classes=4)
    torch.manual_seed(1)
    assert model_summary(first) == model_summary(tiny(num_classes=4))
    assert model_summary(first) != model_summary(tiny(num_classes=5))
    wider = tiny(num_classes=4)
    wider[0][0] = torch.nn.Conv2d(3, 8, 5, 1, 2, bias=False)   # same parameter count, other kernel
    assert model_summary(first) != model_summary(wider)


def mpmd(first: list, second: list, timeout: float = 180) -> subprocess.CompletedProcess:
    """One job, two command lines: rank 0 runs gems-train with ``first``, rank 1 with ``second``."""
    command = [mpiexec(), "-n", "1", sys.executable, str(TRAIN), *map(str, first),
               ":", "-n", "1", sys.executable, str(TRAIN), *map(str, second)]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        pytest.fail("the mismatched job hung instead of stopping")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def expect_one_line(result: subprocess.CompletedProcess) -> str:
    print(result.stderr)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_two_ranks_with_different_plan_files_stop_before_training(tmp_path, monkeypatch):
    plans = []
    monkeypatch.chdir(REPO)   # gems-plan's main, in this process: the model's path is relative to the repository
    for balance in ("2,3", "3,2"):
        plans.append(tmp_path / f"plan-{balance}.json")
        assert exit_status(gems_plan.main, ["--model", TINY, "--image-size", "32", "--batch-size", "4", "--stages",
                                            "2", "--balance", balance, "--json", plans[-1]]) == 0
    result = mpmd(["--model", TINY, *COMMON, "--plan", plans[0], "--metrics", tmp_path / "m.jsonl"],
                  ["--model", TINY, *COMMON, "--plan", plans[1], "--metrics", tmp_path / "m.jsonl"])
    assert expect_one_line(result) == (
        "gems-train: error: ranks disagree on the plan's cut points: rank 0 has [0, 2, 5], rank 1 has [0, 3, 5]: "
        "give every rank the same --plan file and partitioning flags")
    assert not (tmp_path / "m.jsonl").exists()   # no step ran


def test_two_ranks_with_different_model_files_stop_before_training(tmp_path):
    files = []
    for width in (8, 12):
        files.append(tmp_path / f"net{width}.py")
        files[-1].write_text(
            "from torch import nn\n"
            "def net(num_classes=10):\n"
            f"    return nn.Sequential(nn.Conv2d(3, {width}, 3, padding=1), nn.ReLU(),\n"
            f"                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()), nn.Linear({width}, "
            "num_classes))\n")
    result = mpmd(["--model", f"{files[0]}:net", *COMMON], ["--model", f"{files[1]}:net", *COMMON])
    line = expect_one_line(result)
    assert line.startswith("gems-train: error: ranks disagree on the model structure: rank 0 has 4 units, 314 "
                           "parameters, "), line
    assert ", rank 1 has 4 units, 466 parameters, " in line and "(they also disagree on:" in line
    assert line.endswith("give every rank the same --model (the same factory file everywhere)")


@pytest.fixture(scope="module")
def mismatch_launch():
    """One launch per backend of tests/distributed/mismatch_worker.py (a buffer of 6, a strided one of 6,
    then one of 4, for 5 floats), made on first use: backend -> its result."""
    launches = {}

    def of(backend: str):
        if backend not in launches:
            launches[backend] = run_mpi(2, DISTRIBUTED / "mismatch_worker.py", backend, timeout=90, check=False)
        return launches[backend]
    return of


@pytest.mark.parametrize("backend, buffer, message", [
    ("mpi", "buffer of 4", "16 bytes received but buffer size is 20; the ranks disagree on the boundary shapes"),
    ("mpi", "buffer of 6", "tensor 0 brought 20 bytes for a 24-byte buffer; the ranks disagree on the boundary shapes"),
    ("mpi", "strided buffer of 6", "tensor 0 brought 20 bytes for a 24-byte buffer; the ranks disagree"),
    ("torch", "buffer of 4", "Received data size doesn't match expected size"),   # gloo aborts the receiving process
    ("torch", "buffer of 6", "tensor 0 from rank 0 brought 20 bytes for a 24-byte buffer; the ranks disagree"),
    ("torch", "strided buffer of 6", "tensor 0 from rank 0 brought 20 bytes for a 24-byte buffer; the ranks disagree"),
])
def test_a_received_tensor_of_the_wrong_size_is_an_error_not_a_hang(backend, buffer, message, mismatch_launch):
    result = mismatch_launch(backend)
    assert "without an error" not in result.stdout, result.tail()
    assert result.returncode != 0, result.tail()   # the buffer of 4, received last, ends the job
    if buffer != "buffer of 4":   # raised on the receiver, which caught it to go on to the buffer of 4
        assert any(line.startswith(f"{buffer}: ") and message in line for line in result.stderr.splitlines()), \
            result.tail()
    else:
        assert message in result.stderr, result.tail()
