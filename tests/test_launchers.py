"""Launching without MPI: torchrun's and a Slurm step's variables name the rank (gems.comm.launcher),
the torch backend starts on them with mpi4py never imported, and trains exactly as under mpiexec.
A broken launcher environment, or --comm mpi where no MPI library loads, is one sentence, exit 2.
(The srun job script is tests/test_slurm.py's.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, exit_status, mpiexec, without_mpi4py
from gems.cli import train as gems_train
from gems.comm import launcher, world_rank
from gems.errors import GemsError

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
SLURM = {"SLURM_STEP_ID": "3", "SLURM_JOB_ID": "4711", "SLURM_PROCID": "2", "SLURM_NTASKS": "4",
         "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "gpu[07-09,12],cpu1"}


def test_torchrun_variables_name_the_rank_and_the_rendezvous():
    assert launcher.identity(TORCHRUN) == launcher.Identity(1, 2, "127.0.0.1", 29511, "torchrun")


def test_a_slurm_step_without_mpi_names_the_rank_host_and_a_port_from_its_ids():
    me = launcher.identity(SLURM)
    assert me == launcher.Identity(2, 4, "gpu07", launcher.SLURM_PORT_BASE + 4711 % 2000 * 16 + 3, "slurm")
    assert launcher.identity({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "4000"}).master_port == 4000
    assert launcher.first_host("vm") == "vm" and launcher.first_host("a[1-2],b") == "a1"


def test_mpi_launchers_and_no_launcher_leave_it_to_mpi():
    for variable in launcher.MPI_VARIABLES:   # srun --mpi=pmi2 sets PMI_RANK inside a step too
        assert launcher.identity({**SLURM, **TORCHRUN, variable: "0"}) is None
    assert launcher.identity({}) is None
    assert launcher.identity({"SLURM_JOB_ID": "1", "SLURM_PROCID": "0"}) is None   # sbatch's shell, no step


@pytest.mark.parametrize("env, missing", [
    ({"RANK": "0"}, "WORLD_SIZE is not set"),
    ({"WORLD_SIZE": "2"}, "RANK is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "MASTER_ADDR is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT is not set"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "is not a rank of that world"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not a whole number"),
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}, "SLURM_NTASKS is not set"),
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_STEP_NODELIST is not set"),
])
def test_an_incomplete_launcher_environment_names_the_missing_variable(env, missing):
    with pytest.raises(GemsError, match=missing):
        launcher.identity(env)


def _clear_launchers(monkeypatch):
    for name in (*launcher.MPI_VARIABLES, "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_ID",
                 "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


def test_a_broken_launcher_environment_is_one_sentence_and_exit_2(monkeypatch, capsys):
    _clear_launchers(monkeypatch)
    monkeypatch.setenv("RANK", "0")
    assert world_rank() == 0
    assert exit_status(gems_train.main, ["--model", "resnet18", "--comm", "torch"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "gems-train: error:" in err and "WORLD_SIZE is not set" in err, err


def test_comm_mpi_without_an_mpi_library_says_what_to_do(monkeypatch, capsys):
    _clear_launchers(monkeypatch)
    monkeypatch.setitem(sys.modules, "mpi4py", None)   # import mpi4py now fails, as where none is installed
    assert exit_status(gems_train.main, ["--model", "resnet18", "--comm", "mpi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no MPI library loads here" in err, err
    assert "launch with torchrun and --comm torch" in err, err


def test_torchrun_trains_like_mpiexec_without_mpi4py(tmp_path):
    """3 steps of mast K=2 on two CPU ranks: the same per-step losses under torchrun (mpi4py made
    unimportable) as under mpiexec, both with the torch backend."""
    args = ["--model", "tests/assets/tiny_model.py:tiny", "--image-size", "16", "--batch-size", "4", "--stages", "2",
            "--schedule", "mast", "--steps", "3", "--lr", "0.05", "--workers", "0", "--no-progress", "--comm", "torch"]
    env = {**{k: v for k, v in os.environ.items() if k not in launcher.MPI_VARIABLES}, "OMP_NUM_THREADS": "1"}
    losses = {}
    for name, command, extra in (
            ("torchrun", [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2",
                          "--standalone", "-m", "gems.cli.train"], {"PYTHONPATH": without_mpi4py(tmp_path)}),
            ("mpiexec", [mpiexec(), "-n", "2", sys.executable, "-m", "gems.cli.train"], {})):
        metrics = tmp_path / f"{name}.jsonl"
        done = subprocess.run([*command, *args, "--metrics", str(metrics)], cwd=REPO, env={**env, **extra},
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, f"{name}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        assert "gems-train: done" in done.stdout, done.stdout[-3000:]
        losses[name] = [(line["step"], line["loss"]) for line in map(json.loads, metrics.read_text().splitlines())]
    assert [s for s, _ in losses["torchrun"]] == [1, 2, 3]
    assert losses["torchrun"] == losses["mpiexec"]
