"""Out of memory: a rank whose allocator fails (a real CPU allocation under an enforced limit, or
CUDA's OutOfMemoryError) stops the whole job with one line naming the rank, the action, the
plan's estimate and what to change; --enforce-memory-budget lets a run that fits train."""
from __future__ import annotations

import re
import resource
import sys
from pathlib import Path

import pytest
import torch

from conftest import DISTRIBUTED, REPO, run_mpi
from gems import partition
from gems.errors import GemsError
from gems.pipeline.oom import OutOfMemory, is_out_of_memory
from gems.schedule.generators import Action
from gems.schedule.ir import describe_action

WORKER = DISTRIBUTED / "oom_worker.py"
TRAIN = Path(sys.executable).parent / "gems-train"
TINY = "tests/assets/tiny_model.py:tiny"
FIXES = "use --stages 3 on a multiple of 3 ranks, --recompute auto or more --micro-batches (now 1 of 32 images)"


def failure_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("gems:")]


@pytest.mark.parametrize("mode, what", [
    ("cpu", r"allocating [\d.]+ MiB in forward of stage 0, replica 1, micro-batch 0"),
    ("cuda", r"allocating 2\.00 GiB in backward of stage 1, replica 0, micro-batch 0"),
])
def test_out_of_memory_ends_every_rank_with_the_fix(mode, what):
    result = run_mpi(2, WORKER, mode, timeout=90, check=False)
    assert result.returncode != 0, result.tail()
    assert "finished although" not in result.stdout, result.tail()
    assert "Traceback" not in result.stderr, result.tail()
    lines = failure_lines(result.stderr)
    assert len(lines) == 1, result.tail()
    assert re.fullmatch(rf"gems: rank 1 failed: OutOfMemory: rank 1 ran out of CPU memory {what}; the plan "
                        rf"estimates a peak of [\d.]+ MiB for its position 1 and the budget is 1\.00 GiB: "
                        rf"{re.escape(FIXES)}", lines[0]), lines[0]


def test_allocator_failures_are_recognised():
    with pytest.raises(RuntimeError) as failed:
        torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the CPU allocator refuses
    assert is_out_of_memory(failed.value)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory.")) and is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError("memory"))
    onednn = RuntimeError("could not create a primitive")
    assert not is_out_of_memory(onednn)  # without a limit, not a memory problem as far as we know
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    far = 1 << 50 if hard == resource.RLIM_INFINITY else hard  # a limit far above anything used
    resource.setrlimit(resource.RLIMIT_DATA, (far, hard))
    try:
        assert is_out_of_memory(onednn)  # under --enforce-memory-budget, oneDNN failing to get memory
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def test_the_fixes_follow_the_plan():
    sys.path.insert(0, str(REPO / "tests" / "assets"))
    from tiny_model import tiny  # noqa: PLC0415
    plan = partition.plan(tiny(), input_shape=(3, 32, 32), batch_size=4, stages=2, schedule="1f1b",
                          micro_batches=2, groups=2)  # 4 ranks: 1 image per micro-batch
    cause = RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 3221225472 bytes.")
    error = OutOfMemory(0, "CPU", describe_action(Action("sync")), plan, 0, cause)
    assert isinstance(error, GemsError)
    assert str(error).startswith("rank 0 ran out of CPU memory allocating 3.00 GiB in the gradient sync; "
                                 "the plan estimates a peak of ")
    assert str(error).endswith("for its position 0 and no memory budget was given: use --stages 4, "
                               "--recompute auto or a smaller --image-size")  # 4 stages on the 4 ranks
    plan.policies[0].recompute = [[0, 1]]
    assert "--recompute" not in str(OutOfMemory(0, "CPU", "forward", plan, 0, cause))  # all its stages do


# --enforce-memory-budget without a budget is one of test_train.py's BAD_INPUT.


def test_a_run_within_an_enforced_budget_trains():
    result = run_mpi(2, TRAIN, "--model", TINY, "--image-size", "32", "--workers", "1", "--no-progress",
                     "--batch-size", "4", "--stages", "2", "--steps", "3", "--memory-budget", "256MiB",
                     "--enforce-memory-budget", timeout=120)
    assert "gems-train: done" in result.stdout
