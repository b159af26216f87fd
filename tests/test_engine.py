"""The engine under mpiexec: only what needs real processes.

Every schedule, layout, micro-batch count and memory policy is checked in process, one thread
per rank (tests/test_equivalence.py, tests/test_engine_contract.py). These launches check what
threads cannot: the MPI and torch.distributed transports themselves, and that a rank failing or
dying ends every process of the job.
"""
import pytest

from conftest import DISTRIBUTED, run_mpi

WORKER = DISTRIBUTED / "engine_worker.py"


def expect_ok(result, count):
    lines = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert len(lines) == count, result.tail()
    return lines


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_transparency_against_one_process(backend):
    # over MPI, channels_last too (parameters and gradients checked NHWC after the steps), D = 2, and
    # --state-placement host-optimizer bit for bit as device (the host copies summed by MPI)
    extra = (["--memory-formats", "contiguous,channels_last", "--stages", "2,1", "--placements"] if backend == "mpi"
             else [])
    lines = expect_ok(run_mpi(2, WORKER, "transparency", "--backend", backend, "--schedules", "mast,1f1b", *extra,
                              timeout=180), 20 if extra else 4)
    print("\n".join(lines))


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_rank_ends_the_whole_job(how):
    result = run_mpi(2, WORKER, how, timeout=90, check=False)
    assert result.returncode != 0, result.tail()
    assert "finished although" not in result.stdout, result.tail()
    if how == "raise":
        assert (result.stdout + result.stderr).count("rank 1 failed: RuntimeError: injected failure") == 1
