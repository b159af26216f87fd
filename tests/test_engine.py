"""The engine is transparent: every schedule, layout and m trains exactly like one process.

Each launch loops over all schedules and m in {1, 2} inside one mpiexec job (starting
Python and torch per configuration would dominate the suite's time).
"""
import pytest

from conftest import DISTRIBUTED, run_mpi

WORKER = DISTRIBUTED / "engine_worker.py"


def expect_ok(result, count):
    lines = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert len(lines) == count, result.tail()
    return lines


@pytest.mark.parametrize("ranks,stages,configs", [
    (2, "2", 7),          # K=2 D=1
    (3, "3", 7),          # K=3 D=1 (odd K: shared middle stage under mast)
    (4, "2,4", 14),       # K=2 D=2 and K=4 D=1
])
def test_transparency_against_one_process(ranks, stages, configs):
    lines = expect_ok(run_mpi(ranks, WORKER, "transparency", "--stages", stages, timeout=180), configs)
    print("\n".join(lines))


def test_transparency_six_ranks_odd_k_with_data_parallelism():
    expect_ok(run_mpi(6, WORKER, "transparency", "--stages", "3", "--schedules", "mast,1f1b",
                      "--micro-batches", "1", timeout=180), 2)


def test_gradient_clipping_uses_the_global_norm():
    expect_ok(run_mpi(4, WORKER, "transparency", "--stages", "2,4", "--schedules", "mast,1f1b",
                      "--micro-batches", "2", "--clip", "0.05", timeout=180), 4)


def test_batchnorm_copies_stay_identical():
    expect_ok(run_mpi(4, WORKER, "batchnorm", "--stages", "2,4", timeout=180), 14)


def test_tuple_boundaries_amoebanet():
    expect_ok(run_mpi(2, WORKER, "tuples", "--stages", "2", "--schedules", "mp,gpipe,mast", timeout=180), 5)


def test_torch_distributed_backend():
    expect_ok(run_mpi(2, WORKER, "transparency", "--backend", "torch", "--schedules", "mast,1f1b",
                      timeout=180), 4)


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_rank_ends_the_whole_job(how):
    result = run_mpi(2, WORKER, how, timeout=90, check=False)
    assert result.returncode != 0, result.tail()
    assert "finished although" not in result.stdout, result.tail()
    if how == "raise":
        assert (result.stdout + result.stderr).count("rank 1 failed: RuntimeError: injected failure") == 1
