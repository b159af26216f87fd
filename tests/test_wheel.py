"""A normal (non-editable) install works: the wheel holds every package, and gems runs from it.

The suite's own environment is an editable install, whose finder would fill any gap in the
wheel. Here the wheel is built from a clean copy of the source tree (the tracked files: a stale
build/ cannot leak in), installed with --no-deps into a throwaway environment that sees the test
environment's site-packages (torch, mpi4py) as a plain path -- so the editable hook there, a
``.pth`` file, is never run -- and gems-plan and a 2-rank gems-train run from that environment.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, mpiexec

SOURCES = {"gems": "gems", "partition": "gems.partition", "models": "gems.models"}


def source_files() -> list[str]:
    """The tree's files as git tracks them (plus new files not yet committed), else every file
    outside build outputs and environments."""
    if (REPO / ".git").exists() and shutil.which("git"):
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                capture_output=True, text=True, check=True).stdout.split("\n")
        return [name for name in listed if name and (REPO / name).is_file()]
    skip = {".venv", "build", "dist", ".git", "__pycache__", ".pytest_cache"}
    return [str(p.relative_to(REPO)) for p in REPO.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(REPO).parts) and ".egg-info" not in str(p)]


def packages_in_tree() -> set[str]:
    """Every folder holding an ``__init__.py`` under the source folders, named as installed."""
    return {".".join([SOURCES[top], *init.parent.relative_to(REPO / top).parts])
            for top in SOURCES for init in (REPO / top).rglob("__init__.py")}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The throwaway environment with the wheel installed; the wheel file beside it."""
    root = tmp_path_factory.mktemp("wheel")
    copy = root / "source"
    for name in source_files():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, copy / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(root / "dist"), str(copy)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    env = root / "env"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "-q", *map(str, (root / "dist").glob("gems-*.whl"))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # the test environment's packages, as a path after the throwaway's own (its .pth files stay unread)
    (Path(purelib) / "test-environment.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return env


def run(env: Path, *command: str, timeout: float = 180) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # mpi4py looks for an mpich wheel's library under its own environment's prefix: name the test
    # environment's (as `make gpu-check` does for wheels installed under a private prefix)
    libmpi = sorted(Path(sys.prefix, "lib").glob("libmpi.so.[0-9]*"))
    if libmpi and "MPI4PY_LIBMPI" not in environ:
        environ["MPI4PY_LIBMPI"] = str(libmpi[0])
    return subprocess.run(command, cwd=env.parent, capture_output=True, text=True, timeout=timeout,
                          env={**environ, "OMP_NUM_THREADS": "1", "PATH": f"{env / 'bin'}:{environ['PATH']}"})


def test_the_wheel_holds_every_package_of_the_tree(installed):
    wheel = next((installed.parent / "dist").glob("gems-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        shipped = {str(Path(name).parent).replace("/", ".") for name in z.namelist() if name.endswith("/__init__.py")}
    assert packages_in_tree() - shipped == set(), f"folders with an __init__.py missing from the wheel: " \
                                                  f"{sorted(packages_in_tree() - shipped)}"


def test_gems_runs_from_the_installed_wheel(installed):
    where = run(installed, str(installed / "bin" / "python"), "-c",
                "import gems, gems.spatial, gems.schedule, gems.partition; print(gems.__file__)")
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).resolve().is_relative_to(installed.resolve()), where.stdout
    unet = ["--model", "unet", "--model-arg", "width=4", "--model-arg", "depth=3", "--model-arg", "groups=2",
            "--num-classes", "3", "--image-size", "32", "--batch-size", "2"]
    plan = run(installed, str(installed / "bin" / "gems-plan"), *unet, "--stages", "2", "--schedule", "mast",
               "--spatial", "2")
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "on a 2x1 tile grid: 2 ranks per tile group" in plan.stdout, plan.stdout
    train = run(installed, mpiexec(), "-n", "2", str(installed / "bin" / "gems-train"), *unet, "--task",
                "segmentation", "--stages", "1", "--schedule", "mp", "--spatial", "2", "--steps", "1", "--workers",
                "0", "--no-progress")
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert "gems-train: done" in train.stdout, train.stdout[-3000:]
