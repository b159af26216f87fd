"""Fault injection: one rank of a real gems-train run is SIGKILLed at a chosen moment.

Each trial kills one rank (tests/distributed/fault_worker.py) in a forward, a backward, a
receive, a send, the gradient allreduce, the optimizer step, or halfway through writing a
checkpoint file, and checks the promises of a crash:

- the job fails and nothing hangs: mpiexec exits non-zero, no rank finishes, and the survivors end
  on their own within ``--timeout``: through gems' CommTimeout and abort on the MPI backend, on
  gloo's "connection closed by peer" on the torch backend. The launcher is told not to clean up
  (``-disable-auto-cleanup``, like srun without --kill-on-bad-exit), and each rank runs under
  ``sh -c`` so that the launcher sees the killed rank as a process that failed (status 137):
  Hydra tears a job down itself when a rank dies of a signal, flag or not;
- no process of the launch is left behind (data-loading workers included);
- the newest complete checkpoint is the one of the step before the kill, and it loads;
- resuming from it reproduces the uninterrupted run's loss at every step, bit for bit.

Launches are the cost (a few seconds each), so trials of one layout form a chain: the launch
after trial i resumes from trial i's checkpoint -- checking the steps it replays -- and is itself
killed, one step later, for trial i+1; a last launch resumes to the end. One uninterrupted
reference run per layout serves all its trials, and layouts run side by side (survivors spend
most of a trial asleep in their timeout).

The default trials cover every kind of fault and every schedule, each kind in two or more
schedules, on 2 and 4 ranks (K=2, D=1 and 2) and both backends, in chains of three or fewer (a
launch of a chain costs seconds of the suite); ``GEMS_FAULTS=all`` runs every
kind x schedule x layout (K=2 D=1, K=2 D=2, K=4 D=1) x killed rank (260+ trials, some tens of
minutes).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import DISTRIBUTED, REPO, _kill_tree, mpiexec
from gems.train import checkpoint
from gems.pipeline import schedule as sch

TRAIN = Path(sys.executable).parent / "gems-train"
WORKER = DISTRIBUTED / "fault_worker.py"
BASE = ["--model", "tests/assets/tiny_model.py:tiny", "--image-size", "16", "--no-progress",
        "--lr", "0.05", "--lr-schedule", "constant", "--checkpoint-every", "1", "--keep-checkpoints", "2"]
KILL_TIMEOUT = 6      # --timeout of a launch that loses a rank: how long its survivors wait for it
# ... where the first stage's rank starts data-loading workers: their fork server (a fresh interpreter
# importing torch, on cores the other lanes load) can delay that rank's first batch past 6 s
WORKERS_KILL_TIMEOUT = 15
CALM_TIMEOUT = 120    # --timeout of the launches nobody kills (a loaded machine must not fail them)
SLACK = 30            # seconds past KILL_TIMEOUT the survivors may take to abort and be reaped
LAUNCH_LIMIT = 240    # a launch still running after this long hangs
LANES = 6             # layouts run side by side (survivors mostly sleep in their timeout)


@dataclass(frozen=True)
class Layout:
    schedule: str
    ranks: int
    stages: int
    micro_batches: int = 1
    workers: int = 0      # data loading processes: they must not outlive a killed rank either
    comm: str = "mpi"     # the torch backend (gloo) sees a dead peer's connection close at once

    @property
    def name(self) -> str:
        return (f"{self.schedule}-K{self.stages}-D{self.ranks // self.stages}-m{self.micro_batches}"
                + (f"-w{self.workers}" if self.workers else "") + (f"-{self.comm}" if self.comm != "mpi" else ""))

    def args(self, steps: int) -> list[str]:
        parts = self.ranks // self.stages * sch.replicas(self.schedule) * self.micro_batches
        return [*BASE, "--schedule", self.schedule, "--stages", str(self.stages), "--micro-batches",
                str(self.micro_batches), "--batch-size", str(2 * parts), "--steps", str(steps),
                "--workers", str(self.workers), "--comm", self.comm]


@dataclass(frozen=True)
class Fault:
    """Kill ``rank`` at the ``nth`` moment of kind ``at`` (see fault_worker.py); ``where`` adds
    filters such as ``replica=1``."""
    at: str
    rank: int
    nth: int = 1
    where: str = ""

    def spec(self, step: int) -> str:
        return ",".join(filter(None, [f"at={self.at}", f"rank={self.rank}", f"step={step}", f"nth={self.nth}",
                                      self.where]))

    @property
    def name(self) -> str:
        nth = f"#{self.nth}" if self.nth > 1 else ""
        return "-".join(filter(None, [self.at + nth, self.where, f"rank{self.rank}"]))


@dataclass(frozen=True)
class Trial:
    layout: Layout
    chain: int       # chains of one layout share its reference run
    step: int        # the training step the fault strikes in
    fault: Fault

    @property
    def name(self) -> str:
        return f"{self.layout.name}-{self.fault.name}-step{self.step}"


def chains(layout: Layout, *faults: list[Fault]) -> list[Trial]:
    """Trials of ``layout``: each list of faults is one chain striking at steps 2, 3, ..."""
    return [Trial(layout, c, 2 + i, f) for c, chain in enumerate(faults) for i, f in enumerate(chain)]


F = Fault
DEFAULT = [  # longest chains first: layouts start in this order, LANES at a time
    *chains(Layout("mast", 2, 2), [F("allreduce", 0), F("recv", 1, where="replica=1"), F("save", 0, 3)]),
    *chains(Layout("mp", 2, 2, workers=1), [F("forward", 1), F("backward", 0), F("send", 0)]),
    *chains(Layout("gpipe", 2, 2, 2), [F("recv", 0), F("step", 1), F("save", 0)]),
    *chains(Layout("1f1b", 2, 2, 2), [F("backward", 1, 2), F("forward", 0, 2), F("step", 0)]),
    *chains(Layout("gpipe", 4, 2), [F("allreduce", 3), F("step", 1)]),
    *chains(Layout("mast", 2, 2, comm="torch"), [F("send", 0)]),
]


def everything() -> list[Trial]:
    """Every kind x schedule x layout x killed rank: one chain per (layout, rank)."""
    layouts = [Layout(s, 2, 2, 1 if s in ("mp", "mast") else 2) for s in sch.SCHEDULES]
    layouts += [Layout(s, 4, 2, 1 if s in ("mp", "mast") else 2) for s in sch.SCHEDULES]
    layouts += [Layout(s, 4, 4, 1 if s in ("mp", "mast") else 4) for s in ("gpipe", "1f1b", "mast")]
    layouts += [Layout("mast", 2, 2, comm="torch"), Layout("gpipe", 4, 2, comm="torch")]
    trials = []
    for layout in layouts:
        syncs = layout.ranks > layout.stages or layout.schedule == "mast"
        kinds = [k for k in ("forward", "backward", "recv", "send", "allreduce", "step", "save")
                 if k != "allreduce" or syncs]
        per_rank = [[F(k, r, layout.micro_batches if k in ("forward", "backward", "send", "recv") else 1)
                     for k in kinds] + ([F("save", 0, 2), F("save", 0, 3)] if r == 0 else [])
                    for r in range(layout.ranks)]
        trials += chains(layout, *per_rank)
    return trials


TRIALS = everything() if os.environ.get("GEMS_FAULTS") == "all" else DEFAULT


@dataclass
class Launch:
    """One mpiexec launch: its exit, output, the fault it fired, the losses it wrote."""
    returncode: int
    stdout: str
    stderr: str
    killed_at: dict | None = None     # what fault_worker's dying rank wrote just before dying
    failures: dict[int, str] = field(default_factory=dict)  # rank -> the failure line it aborted with
    ended: float = 0.0                # time.time() when mpiexec had exited
    leftovers: list[int] = field(default_factory=list)
    losses: list[tuple[int, float]] = field(default_factory=list)

    def tail(self) -> str:
        return f"--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-3000:]}"


def _tagged(token: str) -> list[int]:
    """Processes whose environment carries ``token`` (those of one launch, wherever re-parented)."""
    needle = f"GEMS_FAULT_LAUNCH={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def launch(ranks: int, args: list[str], metrics: Path, fault: str | None = None) -> Launch:
    """Run gems-train (under fault_worker when ``fault``) and wait for every process of it."""
    token = uuid.uuid4().hex
    records = metrics.parent / f"records-{token}"
    records.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GEMS_FAULT_LAUNCH": token}
    env.pop("GEMS_FAULT", None)
    if fault:
        env.update(GEMS_FAULT=fault, GEMS_FAULT_RECORD=str(records))
    program = [sys.executable, str(WORKER if fault else TRAIN), *args, "--metrics", str(metrics),
               "--timeout", str(CALM_TIMEOUT if not fault else
                                WORKERS_KILL_TIMEOUT if args[args.index("--workers") + 1] != "0" else KILL_TIMEOUT)]
    command = [mpiexec(), "-n", str(ranks), *program]
    if fault:  # leave the survivors to end themselves (see the module docstring)
        command = [mpiexec(), "-disable-auto-cleanup", "-n", str(ranks), "sh", "-c", '"$@"; exit $?', "sh",
                   *program]
    before = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LAUNCH_LIMIT)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, err = proc.communicate()
        err += f"\n(test: still running after {LAUNCH_LIMIT}s, killed)"
    result = Launch(proc.returncode, out, err, ended=time.time())
    deadline = time.monotonic() + 15  # the launcher may still be reaping ranks; data workers poll their parent every 5 s
    while (left := _tagged(token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    result.leftovers = left
    for pid in left:  # this launch's: end them, the trial fails on them anyway
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if (records / "killed.json").exists():
        result.killed_at = json.loads((records / "killed.json").read_text())
    for file in records.glob("failed-rank-*.json"):
        failure = json.loads(file.read_text())
        result.failures[failure["rank"]] = failure["line"]
    if metrics.exists():
        lines = [json.loads(line) for line in metrics.read_text().splitlines()[before:]]
        result.losses = [(line["step"], line["loss"]) for line in lines]
    return result


@dataclass
class Outcome:
    """What one trial left: the killed launch, the newest complete checkpoint after it (and why
    it did not load, if it did not), and the launch that resumed from it."""
    killed: Launch
    newest: str | None = None
    torn: list[str] | None = None     # the files of the killed step's checkpoint directory, if any
    load_error: str | None = None
    replay: Launch | None = None


def run_layout(layout: Layout, trials: list[Trial], root: Path, stop) -> tuple[Launch, dict[str, Outcome]]:
    """The reference run, then every chain of ``layout``; returns (reference, outcome by trial name)."""
    steps = 2 + max(t.step for t in trials)  # the last kill leaves the final launch two steps to run
    reference = launch(layout.ranks, [*layout.args(steps), "--checkpoint-dir", str(root / "reference")],
                       root / "reference.jsonl")
    outcomes: dict[str, Outcome] = {}
    for c in sorted({t.chain for t in trials}):
        ck, metrics = root / f"chain{c}", root / f"chain{c}.jsonl"
        args = [*layout.args(steps), "--checkpoint-dir", str(ck)]
        previous = None
        for trial in (t for t in trials if t.chain == c):
            if stop.is_set():
                return reference, outcomes
            run = launch(layout.ranks, args + (["--resume"] if previous else []), metrics,
                         trial.fault.spec(trial.step))
            outcome = outcomes[trial.name] = Outcome(run)
            if previous is not None:
                previous.replay = run
            torn = ck / f"step-{trial.step:08d}"
            outcome.torn = sorted(p.name for p in torn.iterdir()) if torn.is_dir() else None
            found = checkpoint.complete(ck)
            if found:
                outcome.newest = found[-1].name
                try:
                    checkpoint.load_stages(found[-1])
                except Exception as e:  # noqa: BLE001 - the trial reports it
                    outcome.load_error = f"{type(e).__name__}: {e}"
            previous = outcome
        if previous is not None:
            previous.replay = launch(layout.ranks, args + ["--resume"], metrics)
    return reference, outcomes


@pytest.fixture(scope="module")
def outcome_of(request, tmp_path_factory):
    """``outcome_of(trial) -> (reference losses by step, Outcome, reference Launch)``, once the
    trial's layout ran. The layouts of the selected trials all start, ``LANES`` at a time."""
    stop = threading.Event()
    selected = {getattr(item, "callspec", None) and item.callspec.params.get("trial")
                for item in request.session.items if item.path == request.path}
    by_layout: dict[Layout, list[Trial]] = {}
    for t in TRIALS:
        if t in selected:
            by_layout.setdefault(t.layout, []).append(t)
    pool = ThreadPoolExecutor(LANES)
    futures: dict[Layout, Future] = {
        layout: pool.submit(run_layout, layout, trials, tmp_path_factory.mktemp(layout.name), stop)
        for layout, trials in by_layout.items()}

    def get(trial: Trial) -> tuple[dict[int, float], Outcome | None, Launch]:
        reference, outcomes = futures[trial.layout].result()
        return dict(reference.losses), outcomes.get(trial.name), reference

    yield get
    stop.set()
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("trial", TRIALS, ids=lambda t: t.name)
def test_a_killed_rank_ends_the_job_and_the_run_resumes_bit_for_bit(trial, outcome_of):
    reference, outcome, ref_launch = outcome_of(trial)
    assert ref_launch.returncode == 0, f"the reference run failed\n{ref_launch.tail()}"
    assert outcome is not None, "not run: the chain stopped early"
    killed = outcome.killed
    assert killed.killed_at is not None, f"the fault never fired\n{killed.tail()}"
    assert (killed.killed_at["rank"], killed.killed_at["step"]) == (trial.fault.rank, trial.step)
    # The job failed, and the survivors ended it themselves, in time, leaving nothing behind.
    assert killed.returncode != 0 and "gems-train: done" not in killed.stdout, killed.tail()
    assert killed.failures and trial.fault.rank not in killed.failures, (killed.failures, killed.tail())
    took = killed.ended - killed.killed_at["time"]
    assert took < KILL_TIMEOUT + SLACK, f"the job ended {took:.0f}s after the kill\n{killed.tail()}"
    assert not killed.leftovers, f"processes {killed.leftovers} outlived the launch"
    # The newest complete checkpoint is the step before the kill, and it loads.
    assert outcome.newest == f"step-{trial.step - 1:08d}", (outcome.newest, killed.tail())
    assert outcome.load_error is None, outcome.load_error
    if trial.fault.at == "save":  # the killed save left a half-written file and no manifest
        assert outcome.torn and "manifest.json" not in outcome.torn, outcome.torn
        assert any(name.endswith(".tmp") for name in outcome.torn), outcome.torn
    # The resumed launch starts there and redoes the killed step; every loss matches the reference.
    replay = outcome.replay
    assert replay is not None, "not run: the chain stopped early"
    assert f"{outcome.newest} at step {trial.step - 1}" in replay.stdout, replay.tail()
    assert trial.step in [s for s, _ in replay.losses], replay.tail()
    for s, loss in killed.losses + replay.losses:
        assert loss == reference[s], (s, loss, reference[s])


def test_the_default_trials_cover_every_kind_in_two_schedules_both_backends_and_four_ranks():
    kinds = {"forward", "backward", "recv", "send", "allreduce", "step", "save"}
    for kind in kinds:
        schedules = {t.layout.schedule for t in DEFAULT if t.fault.at == kind}
        assert len(schedules) >= 2, (kind, schedules)
    assert {t.layout.comm for t in DEFAULT} == {"mpi", "torch"}
    assert {t.layout.ranks for t in DEFAULT} == {2, 4} and set(sch.SCHEDULES) <= {t.layout.schedule for t in DEFAULT}
