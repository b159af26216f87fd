"""The batch scripts in jobs/ under a real Slurm: submitted with sbatch as a user does, shrunk
to two CPU ranks on this machine through sbatch options and GEMS_* variables.

Needs a running cluster (as root: ``bash .ci/start-slurm``); skipped without one. Until
gems-train is installed (or with GEMS_TEST_STAND_IN=1), the jobs run
tests/distributed/slurm_hello.py in its place through the scripts' GEMS_TRAIN: it takes
gems-train's flags and keeps its exit codes, so the scripts' launch, argument and requeue
logic is tested all the same.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import without_mpi4py

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "jobs"
HELLO = REPO / "tests" / "distributed" / "slurm_hello.py"
VENV_BIN = Path(sys.executable).parent
GEMS_TRAIN = VENV_BIN / "gems-train"
FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
            "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
JOB_TIMEOUT = 240  # seconds; a job still running then is cancelled and the test fails

# Two ranks, one CPU each, no GPU, a few minutes: how every job here is shrunk.
SMALL = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0", "--time=5"]
TINY = {"GEMS_MODEL": "resnet18", "GEMS_NUM_CLASSES": "10", "GEMS_IMAGE_SIZE": "64",
        "GEMS_STAGES": "2", "GEMS_MICRO_BATCHES": "1", "GEMS_STEPS": "2"}


def _ask_sinfo() -> subprocess.Popen | None:
    """sinfo, started as the module is collected: where no controller answers it takes Slurm's message
    timeout (about 10 s) to fail, and ``make test`` collects this module with tests/test_faults.py, which
    runs first, so the wait passes beside it. None without Slurm."""
    if shutil.which("sbatch") is None:
        return None
    return subprocess.Popen(["sinfo", "-h", "-o", "%T"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


_SINFO = _ask_sinfo()


def _cluster_problem() -> str | None:
    if _SINFO is None:
        return "Slurm is not installed (no sbatch on PATH); start one with `sudo bash .ci/start-slurm`"
    try:
        stdout, stderr = _SINFO.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        _SINFO.kill()
        _SINFO.communicate()
        return "sinfo timed out: slurmctld is not answering; restart it with `sudo bash .ci/start-slurm`"
    if _SINFO.returncode != 0 or not re.search(r"^(idle|mix|alloc|completing)", stdout, re.M):
        return f"the Slurm cluster is not up (sinfo: {(stdout + stderr).strip()[:200]!r}); " \
               "start it with `sudo bash .ci/start-slurm`"
    return None


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster():
    """Skip the module, saying why, unless a Slurm cluster answers (``_ask_sinfo``)."""
    problem = _cluster_problem()
    if problem is not None:
        pytest.skip(problem)


def _trainer() -> tuple[dict[str, str], str]:
    """GEMS_TRAIN for the jobs, and the line rank 0 prints when training finished."""
    if GEMS_TRAIN.exists() and os.environ.get("GEMS_TEST_STAND_IN", "0") != "1":
        return {}, "gems-train: done"
    return {"GEMS_TRAIN": f"{sys.executable} {HELLO}"}, "slurm_hello: done"


def submit(script: str, tmp_path: Path, env: dict[str, str], *options: str) -> str:
    """sbatch a script from jobs/ as a user does (from the repository root), shrunk to SMALL;
    returns the job id. Output and run directory go to tmp_path."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GEMS_", "SBATCH_", "SLURM_"))}
    clean.update(GEMS_VENV=str(VENV_BIN.parent), GEMS_RUN_DIR=str(tmp_path / "run"), **env)
    cmd = ["sbatch", "--parsable", *SMALL, f"--output={tmp_path}/%x-%j.out", *options, str(JOBS / script)]
    out = subprocess.run(cmd, cwd=REPO, env=clean, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"sbatch failed: {out.stderr}"
    return out.stdout.strip().split(";")[0]


def job_info(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=15)
    return dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)


def wait(job_id: str, tmp_path: Path, until=lambda info: info.get("JobState") in FINISHED,
         timeout: float = JOB_TIMEOUT) -> dict[str, str]:
    """Poll the job until ``until(info)``; cancel it and fail on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        info = job_info(job_id)
        if until(info):
            return info
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], timeout=15)
            pytest.fail(f"job {job_id} still {info.get('JobState')} after {timeout:.0f} s; cancelled.\n"
                        + output(tmp_path))
        time.sleep(0.5)


def output(tmp_path: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(tmp_path.glob("*.out")))


@pytest.mark.timeout(60)
def test_srun_starts_mpi_ranks_with_pmi2() -> None:
    out = subprocess.run(["srun", "--mpi=pmi2", "-n", "2", "--cpus-per-task=1", "--time=1",
                          sys.executable, str(HELLO)], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert "rank 1/2" in out.stdout and "slurm_hello: done" in out.stdout, out.stdout + out.stderr


@pytest.mark.timeout(JOB_TIMEOUT + 30)
@pytest.mark.parametrize("script", ["single-node.sbatch", "multi-node-resnet.sbatch",
                                    "multi-node-amoebanet.sbatch", "torch-launch.sbatch"])
def test_job_script_trains(script: str, tmp_path: Path) -> None:
    # resnet18 in place of each script's model: what is under test is the script's launch.
    env, done = _trainer()
    if script == "torch-launch.sbatch":  # launched without MPI: prove that no rank loads it
        env["PYTHONPATH"] = without_mpi4py(tmp_path)
    job = submit(script, tmp_path, {**TINY, **env})
    info = wait(job, tmp_path)
    log = output(tmp_path)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert done in log and "--batch-size 2 --stages 2" in log, log


@pytest.mark.timeout(60)
def test_bad_sizes_fail_with_exit_code_2(tmp_path: Path) -> None:
    job = submit("single-node.sbatch", tmp_path, {**TINY, "GEMS_STAGES": "3"})
    info = wait(job, tmp_path, timeout=50)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), output(tmp_path)
    assert "2 ranks do not split into groups of GEMS_STAGES=3" in output(tmp_path)


@pytest.mark.timeout(JOB_TIMEOUT + 30)
def test_preemptible_requeues_and_resumes(tmp_path: Path) -> None:
    """SIGUSR1 to the ranks (what --signal=USR1@120 sends near the time limit): they save and
    exit 3, the script requeues the job, and the second start resumes and finishes; nothing prints a
    traceback on the way."""
    env, done = _trainer()
    job = submit("preemptible.sbatch", tmp_path, {**TINY, **env, "GEMS_STEPS": "20"})
    metrics = tmp_path / "run" / "metrics.jsonl"

    def metrics_written(info: dict[str, str]) -> bool:
        assert info.get("JobState") not in FINISHED, f"job ended before it could be signalled:\n{output(tmp_path)}"
        return metrics.exists() and metrics.stat().st_size > 0
    wait(job, tmp_path, until=metrics_written, timeout=120)  # training runs: signal handlers are in
    subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=15)

    # Slurm holds a requeued job back for the job credential's lifetime, which .ci/start-slurm
    # sets to 10 s (forcing an earlier start fails the job with "Job credential revoked").
    info = wait(job, tmp_path)
    log = output(tmp_path)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), log
    first, second = log.split("(start 2 of this job)")
    assert "requeueing job" in first and "--resume" not in first, log
    assert "--resume" in second and done in second, log
    assert "Traceback" not in log, log   # the data workers' helpers outlive the signal (gems.train.workers)


@pytest.mark.timeout(JOB_TIMEOUT + 30)
def test_segmentation_job_trains_validates_and_predicts(tmp_path: Path) -> None:
    """No GEMS_DATA: the script generates a synthetic set, trains with validation and --keep-best,
    then predicts masks with the best checkpoint."""
    if not GEMS_TRAIN.exists():
        pytest.skip("gems is not installed in this interpreter's environment")
    env = {"GEMS_MODEL": "unet", "GEMS_EXTRA_ARGS": "--model-arg width=4 --model-arg depth=3 --workers 0",
           "GEMS_IMAGE_SIZE": "32", "GEMS_STEPS": "4", "GEMS_VAL_EVERY": "2", "GEMS_SYNTH_COUNT": "8"}
    job = submit("segmentation.sbatch", tmp_path, env)
    info = wait(job, tmp_path)
    log = output(tmp_path)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert "gems-train: done" in log and "gems-predict: 2 image(s) predicted" in log, log
    assert len(list((tmp_path / "run" / "predictions").glob("*.png"))) == 2, log


def test_scripts_are_complete() -> None:
    """Each script parses, asks for GPUs, one task per GPU, and launches through srun: --mpi=pmi2
    for MPI, or --mpi=none --kill-on-bad-exit=1 with the torch backend."""
    launch = {"torch-launch.sbatch":
              'srun --mpi=none --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}"'}
    for script in ("single-node.sbatch", "multi-node-resnet.sbatch", "multi-node-amoebanet.sbatch",
                   "preemptible.sbatch", "segmentation.sbatch", "torch-launch.sbatch"):
        text = (JOBS / script).read_text()
        assert subprocess.run(["bash", "-n", str(JOBS / script)]).returncode == 0, script
        for directive in ("--nodes=", "--ntasks-per-node=", "--gpus-per-node=", "--cpus-per-task=",
                          "--time=", "--output="):
            assert f"#SBATCH {directive}" in text, (script, directive)
        assert launch.get(script, 'srun --mpi=pmi2 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}"') in text, script
