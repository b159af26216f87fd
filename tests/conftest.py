"""Shared test helpers. ``run_mpi`` launches a script on N MPI ranks with a hard timeout.

    def test_ring(run_mpi):                                   # as a fixture ...
        result = run_mpi(3, DISTRIBUTED / "comm_worker.py", "mpi", "features", timeout=60)
        assert result.stdout.count(": ok") == 3

    from conftest import run_mpi                              # ... or imported, same function

A script run this way should wrap its work in ``with comm.guard():`` so that a failing rank
aborts the whole job at once (one line on stderr) instead of leaving the others waiting.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DISTRIBUTED = REPO / "tests" / "distributed"


def mpiexec() -> str:
    """The launcher: $GEMS_MPIEXEC, else the one beside this Python (the venv's mpich), else PATH's."""
    for candidate in (os.environ.get("GEMS_MPIEXEC"), Path(sys.executable).parent / "mpiexec"):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    found = shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec found (install the 'mpich' extra or set GEMS_MPIEXEC)")
    return found


@dataclass
class MpiResult:
    """What a launch left behind: exit code of mpiexec, all ranks' output, wall time in seconds."""

    returncode: int
    stdout: str
    stderr: str
    elapsed: float

    def tail(self, chars: int = 4000) -> str:
        return f"--- stdout ---\n{self.stdout[-chars:]}\n--- stderr ---\n{self.stderr[-chars:]}"


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc). Needed because hydra puts its proxies and the
    ranks in sessions of their own, out of reach of a process-group kill."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def tagged(variable: str, token: str) -> list[int]:
    """Processes whose environment sets ``variable`` to ``token``: those of one launch, wherever they
    were re-parented (Linux /proc)."""
    needle = f"{variable}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """End mpiexec and every process below it (ranks included).

    SIGTERM first, so hydra stops and reaps its ranks itself; after 3 s, SIGKILL whatever is left,
    deepest first, so each parent can still reap its children."""
    tree = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=3)
    for pid in reversed(tree):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_mpi(n: int, script: str | os.PathLike, *args: str, timeout: float = 60.0,
            env: dict[str, str] | None = None, check: bool = True) -> MpiResult:
    """Run ``mpiexec -n n python script *args`` from the repository root and return its result.

    * ``timeout``: hard limit in seconds; past it every process of the launch is SIGKILLed and
      the test fails with the output so far (a hang never outlives its test).
    * ``env``: variables added to the environment. OMP_NUM_THREADS defaults to 1 (many ranks
      share few cores in tests) and PYTHONUNBUFFERED to 1 (ranks' output arrives as printed).
    * ``check``: fail the test, showing the output, unless mpiexec exits with 0. Pass
      ``check=False`` to inspect a launch that is meant to fail.
    """
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    command = [mpiexec(), "-n", str(n), sys.executable, str(script), *map(str, args)]
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process that escaped the kill still holds the pipes
            stdout, stderr = "", "(output lost: some process of the launch survived SIGKILL)"
        result = MpiResult(proc.returncode, stdout, stderr, time.monotonic() - start)
        pytest.fail(f"{' '.join(command)} still ran after {timeout}s and was killed\n{result.tail()}")
    result = MpiResult(proc.returncode, stdout, stderr, time.monotonic() - start)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited with {result.returncode}\n{result.tail()}")
    return result


def exit_status(main, argv: list) -> int:
    """The exit status of a gems command's ``main(argv)`` run in this process, whether it returns it or
    raises SystemExit (as the console script would exit)."""
    try:
        status = main([str(a) for a in argv])
    except SystemExit as exit_:
        status = exit_.code
    return status if isinstance(status, int) else (0 if status is None else 1)


def cli_cases(cli: str, argvs: list[list], timeout: float = 120, env: dict | None = None) -> list[dict]:
    """Run the ``main`` of module ``cli`` (e.g. "gems.cli.train") on each command line in turn, all in one
    fresh process (tests/distributed/cli_cases.py, an MPI singleton): per command line, ``{"code",
    "stdout", "stderr"}``. For what needs no process of its own: one interpreter and torch import instead
    of one per command line. ``env``: variables set for that process besides the test's own."""
    argvs = [[str(a) for a in argv] for argv in argvs]
    result = subprocess.run([sys.executable, str(DISTRIBUTED / "cli_cases.py"), cli, json.dumps(argvs)], cwd=REPO,
                            capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def without_mpi4py(folder: Path) -> str:
    """A folder to put first on PYTHONPATH where importing mpi4py must fail (a machine without MPI)."""
    blocker = folder / "no-mpi" / "mpi4py"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('mpi4py is blocked: this run is without MPI')\n")
    return str(blocker.parent)


@pytest.fixture(name="run_mpi")
def _run_mpi_fixture():
    """The ``run_mpi`` function, as a fixture."""
    return run_mpi


@pytest.fixture(scope="module")
def one_torch_thread():
    """Many loopback rank threads share few cores: one intra-op thread each (module-wide)."""
    import torch  # noqa: PLC0415 - conftest stays cheap for tests that never touch torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# `make test` runs two pytest workers, each given whole files in turn (pytest-xdist --dist loadfile
# --no-loadscope-reorder). The longest files (launches, mostly) start first, so that neither worker is
# left running one of them alone at the end; the rest follow in collection order. Longest first, by the
# sum of their tests' durations in `make test` (--durations=0, 2026-11-27):
LONGEST_FILES = ("test_spatial_engine.py", "test_equivalence.py", "test_tasks.py", "test_compile.py", "test_train.py",
                 "test_out_of_core.py", "test_comm.py", "test_partition_spatial.py", "test_any_model.py",
                 "test_engine.py", "test_host_weights.py", "test_cli_plan.py", "test_spatial.py", "test_oom.py",
                 "test_spatial_memory.py", "test_bench.py",
                 "test_launchers.py", "test_wheel.py", "test_checkpoint_safety.py", "test_handshake.py",
                 "test_batchnorm.py", "test_fuzz.py", "test_split_backward.py", "test_trace.py")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        first = {name: i for i, name in enumerate(LONGEST_FILES)}
        items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: each file keeps its order


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; run by `make gpu-check` (skipped without a GPU)")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test`: two workers share the cores, one intra-op thread each
        import torch  # noqa: PLC0415

        torch.set_num_threads(1)
