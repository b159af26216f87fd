"""Fault injection: one rank of a real gems-train run is SIGKILLed at a chosen moment.

Each trial kills one rank (tests/distributed/fault_worker.py) in a forward, a backward, a
receive, a send, the gradient allreduce, the optimizer step, or halfway through writing a
checkpoint file, and checks the promises of a crash:

- the job fails and nothing hangs: mpiexec exits non-zero, no rank finishes, and the survivors end
  on their own within ``KILL_TIMEOUT`` (fault_worker makes it the communicator's timeout once the
  launch's first step is done; the longer ``--timeout`` only covers the start-up): through gems'
  CommTimeout and abort on the MPI backend, on gloo's "connection closed by peer" on the torch
  backend. The launcher is told not to clean up (``-disable-auto-cleanup``, like srun without
  --kill-on-bad-exit), and each rank runs under ``sh -c`` so that the launcher sees the killed rank
  as a process that failed (status 137): Hydra tears a job down itself when a rank dies of a
  signal, flag or not;
- no process of the launch is left behind (data-loading workers included);
- the newest complete checkpoint is the one of the step before the kill, and it loads;
- resuming from it reproduces the uninterrupted run's loss at every step, bit for bit.

Launches are the cost (each rank's interpreter imports torch: 3 s or more of one of the two cores),
so trials of one layout form a chain: the launch after trial i resumes from trial i's checkpoint --
checking the steps it replays, in fresh processes -- and is itself killed, one step later, for
trial i+1. What nobody kills needs no launch of its own: the resume of each chain's last trial to
the end and each layout's uninterrupted reference run (which serves all its trials) are runs, one
after another, in one last launch shared by the layouts of a world size (fault_worker's
GEMS_FAULT_THEN: the first of them runs in fresh processes, the later ones in the same ones).
Layouts run side by side (survivors spend part of a trial asleep in their timeout).

The default trials cover every kind of fault and every schedule, each kind in two schedules, on 2
and 4 ranks (K=2, D=1 and 2) and both backends: 14 trials in 16 launches (a launch of 4 ranks costs
twice one of 2, so one trial there). ``GEMS_FAULTS=all`` runs every
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

from conftest import DISTRIBUTED, REPO, _kill_tree, mpiexec, tagged
from gems.schedule import generators as sch
from gems.train import checkpoint

WORKER = DISTRIBUTED / "fault_worker.py"
BASE = ["--model", "tests/assets/tiny_model.py:tiny", "--image-size", "16", "--no-progress",
        "--lr", "0.05", "--lr-schedule", "constant", "--checkpoint-every", "1", "--keep-checkpoints", "2"]
KILL_TIMEOUT = 3      # how long the survivors of a launch that loses a rank wait for it: the communicator's
# timeout once the launch's first step is done, when a wait is for a peer's step or checkpoint (milliseconds)
CALM_TIMEOUT = 120    # --timeout until then, and of the launches nobody kills: start-up on loaded cores (the
# first stage's data workers' fork server, a fresh interpreter importing torch) must not fail them
SLACK = 30            # seconds past KILL_TIMEOUT the survivors may take to abort and be reaped
LAUNCH_LIMIT = 240    # a launch still running after this long hangs
LANES = 6             # layouts run side by side (survivors sleep in their timeout part of a trial)
FINAL_RUNS = 10       # runs nobody kills that one launch makes in turn (see last_launch)


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
                                      self.where, f"timeout={KILL_TIMEOUT}"]))

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
    *chains(Layout("gpipe", 2, 2, 2), [F("recv", 0), F("step", 1), F("save", 0)]),
    *chains(Layout("1f1b", 2, 2, 2), [F("backward", 1, 2), F("forward", 0, 2), F("step", 0)]),
    *chains(Layout("mp", 2, 2, workers=1), [F("forward", 1), F("send", 0)]),  # rank 0 has the workers
    *chains(Layout("mast", 2, 2, comm="torch"), [F("send", 0), F("backward", 1)]),
    *chains(Layout("gpipe", 4, 2), [F("allreduce", 3)]),
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
    leftovers: list[str] = field(default_factory=list)  # "pid command line" of each
    losses: list[tuple[int, float]] = field(default_factory=list)

    def tail(self) -> str:
        return f"--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-3000:]}"


def _command(pid: int) -> str:
    with contextlib.suppress(OSError):
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    return "(gone)"


def _lines(metrics: Path) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _losses(metrics: Path, skip: int = 0) -> list[tuple[int, float]]:
    """(step, loss) of the lines of a --metrics file after the first ``skip``."""
    if not metrics.exists():
        return []
    return [(line["step"], line["loss"]) for line in map(json.loads, metrics.read_text().splitlines()[skip:])]


def run_args(args: list[str], metrics: Path) -> list[str]:
    """A gems-train run's full arguments: ``args``, where its losses go, and the start-up timeout."""
    return [*args, "--metrics", str(metrics), "--timeout", str(CALM_TIMEOUT)]


def launch(ranks: int, args: list[str], metrics: Path, fault: str | None = None,
           then: list[list[str]] | None = None) -> Launch:
    """Run gems-train (``run_args(args, metrics)``) under fault_worker, killed as ``fault`` says, or
    followed in the same processes by the runs ``then`` (their full arguments) while they succeed;
    wait for every process of it. ``losses`` are those the first run wrote."""
    token = uuid.uuid4().hex
    records = metrics.parent / f"records-{token}"
    records.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "GEMS_FAULT_LAUNCH": token}
    for name in ("GEMS_FAULT", "GEMS_FAULT_THEN"):
        env.pop(name, None)
    if fault:
        env.update(GEMS_FAULT=fault, GEMS_FAULT_RECORD=str(records))
    if then:
        env["GEMS_FAULT_THEN"] = json.dumps(then)
    program = [sys.executable, str(WORKER), *run_args(args, metrics)]
    command = [mpiexec(), "-n", str(ranks), *program]
    if fault:  # leave the survivors to end themselves (see the module docstring)
        command = [mpiexec(), "-disable-auto-cleanup", "-n", str(ranks), "sh", "-c", '"$@"; exit $?', "sh",
                   *program]
    before = _lines(metrics)
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LAUNCH_LIMIT)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, err = proc.communicate()
        err += f"\n(test: still running after {LAUNCH_LIMIT}s, killed)"
    result = Launch(proc.returncode, out, err, ended=time.time())
    # The launcher may still be reaping ranks, and data workers end when their rank has (then their fork
    # server and resource tracker), which on loaded cores (the lanes, a second pytest worker) can take a
    # while: wait up to a minute for them.
    deadline = time.monotonic() + 60
    while (left := tagged("GEMS_FAULT_LAUNCH", token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    result.leftovers = [f"{pid} {_command(pid)}" for pid in left]
    for pid in left:  # this launch's: end them, the trial fails on them anyway
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if (records / "killed.json").exists():
        result.killed_at = json.loads((records / "killed.json").read_text())
    for file in records.glob("failed-rank-*.json"):
        failure = json.loads(file.read_text())
        result.failures[failure["rank"]] = failure["line"]
    result.losses = _losses(metrics, before)
    return result


@dataclass
class Outcome:
    """What one trial left: the killed launch, the newest complete checkpoint after it (and why
    it did not load, if it did not), and the launch that resumed from it."""
    killed: Launch
    newest: str | None = None
    resume_from: str = ""             # the newest complete checkpoint's path
    torn: list[str] | None = None     # the files of the killed step's checkpoint directory, if any
    load_error: str | None = None
    replay: Launch | None = None


@dataclass
class Run:
    """A run that no fault interrupts, for a last launch: a chain's resume to the end (``replays``:
    the outcome of the trial it replays) or a layout's reference run (``replays`` None)."""
    args: list[str]
    metrics: Path
    replays: Outcome | None = None


def run_chains(layout: Layout, trials: list[Trial], root: Path, stop) -> tuple[dict[str, Outcome], list[Run]]:
    """Every chain of ``layout`` up to its last launch; returns (outcome by trial name, what the last
    launches must still run: each chain's resume to the end, then the layout's reference run)."""
    steps = 2 + max(t.step for t in trials)  # the last kill leaves the final launch two steps to run
    outcomes: dict[str, Outcome] = {}
    runs = []
    for c in sorted({t.chain for t in trials}):
        ck, metrics = root / f"chain{c}", root / f"chain{c}.jsonl"
        args = [*layout.args(steps), "--checkpoint-dir", str(ck)]
        previous = None
        for trial in (t for t in trials if t.chain == c):
            if stop.is_set():
                return outcomes, []
            run = launch(layout.ranks, args + (["--resume"] if previous else []), metrics,
                         trial.fault.spec(trial.step))
            outcome = outcomes[trial.name] = Outcome(run)
            if previous is not None:
                previous.replay = run
            torn = ck / f"step-{trial.step:08d}"
            outcome.torn = sorted(p.name for p in torn.iterdir()) if torn.is_dir() else None
            found = checkpoint.complete(ck)
            if found:
                outcome.newest, outcome.resume_from = found[-1].name, str(found[-1])
                try:
                    checkpoint.load_stages(found[-1])
                except Exception as e:  # noqa: BLE001 - the trial reports it
                    outcome.load_error = f"{type(e).__name__}: {e}"
            previous = outcome
        runs.append(Run(args + ["--resume"], metrics, previous))
    reference = Run([*layout.args(steps), "--checkpoint-dir", str(root / "reference")], root / "reference.jsonl")
    return outcomes, [*runs, reference]


def last_launch(layouts: list[Layout], running: dict[Layout, Future], stop) -> dict[Layout, Launch]:
    """One launch for the runs that ``run_chains`` left to ``layouts`` (of one world size), in turn, once
    their chains are done: each replay is that launch, with the losses its run wrote. Returns the
    reference runs by layout, the same way."""
    runs = {layout: running[layout].result()[1] for layout in layouts}
    every = [run for layout in layouts for run in runs[layout]]
    if stop.is_set() or not all(runs.values()):
        return {}
    before = {run.metrics: _lines(run.metrics) for run in every}
    whole = launch(layouts[0].ranks, every[0].args, every[0].metrics,
                   then=[run_args(run.args, run.metrics) for run in every[1:]])

    def seen(run: Run) -> Launch:
        return Launch(whole.returncode, whole.stdout, whole.stderr, ended=whole.ended, leftovers=whole.leftovers,
                      losses=_losses(run.metrics, before[run.metrics]))
    for run in every:
        if run.replays is not None:
            run.replays.replay = seen(run)
    return {layout: seen(runs[layout][-1]) for layout in layouts}


def sharing(by_layout: dict[Layout, list[Trial]]) -> list[list[Layout]]:
    """The layouts whose runs ``last_launch`` makes one launch: of one world size, in start order, at
    most FINAL_RUNS runs (a resume per chain, a reference per layout) to a launch."""
    groups: list[list[Layout]] = []
    filling: dict[int, tuple[list[Layout], int]] = {}  # world size -> the group being filled, its runs
    for layout, trials in by_layout.items():
        count = len({t.chain for t in trials}) + 1
        group, total = filling.get(layout.ranks, ([], 0))
        if not group or total + count > FINAL_RUNS:
            group, total = [], 0
            groups.append(group)
        group.append(layout)
        filling[layout.ranks] = (group, total + count)
    return groups


@pytest.fixture(scope="module")
def outcome_of(request, tmp_path_factory):
    """``outcome_of(trial) -> (reference losses by step, Outcome, reference Launch)``, once the
    trial's layout ran. The layouts of the selected trials all start, ``LANES`` at a time; the last
    launches (``sharing``) start as soon as the chains of their layouts are done."""
    stop = threading.Event()
    selected = {getattr(item, "callspec", None) and item.callspec.params.get("trial")
                for item in request.session.items if item.path == request.path}
    by_layout: dict[Layout, list[Trial]] = {}
    for t in TRIALS:
        if t in selected:
            by_layout.setdefault(t.layout, []).append(t)
    pool = ThreadPoolExecutor(LANES)
    running: dict[Layout, Future] = {
        layout: pool.submit(run_chains, layout, trials, tmp_path_factory.mktemp(layout.name), stop)
        for layout, trials in by_layout.items()}
    groups = sharing(by_layout)
    last = ThreadPoolExecutor(max(1, len(groups)))  # each waits for its chains before it launches
    references: dict[Layout, Future] = {}
    for group in groups:
        future = last.submit(last_launch, group, running, stop)
        references.update({layout: future for layout in group})

    def get(trial: Trial) -> tuple[dict[int, float], Outcome | None, Launch | None]:
        outcomes, _ = running[trial.layout].result()
        reference = references[trial.layout].result().get(trial.layout)
        return dict(reference.losses) if reference else {}, outcomes.get(trial.name), reference

    yield get
    stop.set()
    pool.shutdown(wait=True, cancel_futures=True)
    last.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("trial", TRIALS, ids=lambda t: t.name)
def test_a_killed_rank_ends_the_job_and_the_run_resumes_bit_for_bit(trial, outcome_of):
    reference, outcome, ref_launch = outcome_of(trial)
    assert ref_launch is not None, "not run: a chain stopped early"
    assert ref_launch.returncode == 0, f"the last launch (last resumes, reference runs) failed\n{ref_launch.tail()}"
    assert outcome is not None, "not run: the chain stopped early"
    killed = outcome.killed
    assert killed.killed_at is not None, f"the fault never fired\n{killed.tail()}"
    assert (killed.killed_at["rank"], killed.killed_at["step"]) == (trial.fault.rank, trial.step)
    # The job failed, and the survivors ended it themselves, in time, leaving nothing behind.
    assert killed.returncode != 0 and "gems-train: done" not in killed.stdout, killed.tail()
    assert killed.failures and trial.fault.rank not in killed.failures, (killed.failures, killed.tail())
    took = killed.ended - killed.killed_at["time"]
    assert took < KILL_TIMEOUT + SLACK, f"the job ended {took:.0f}s after the kill\n{killed.tail()}"
    assert not killed.leftovers, f"processes outlived the launch: {killed.leftovers}"
    # The newest complete checkpoint is the step before the kill, and it loads.
    assert outcome.newest == f"step-{trial.step - 1:08d}", (outcome.newest, killed.tail())
    assert outcome.load_error is None, outcome.load_error
    if trial.fault.at == "save":  # the killed save left a half-written file and no manifest
        assert outcome.torn and "manifest.json" not in outcome.torn, outcome.torn
        assert any(name.endswith(".tmp") for name in outcome.torn), outcome.torn
    # The resumed launch starts there and redoes the killed step; every loss matches the reference.
    replay = outcome.replay
    assert replay is not None, "not run: the chain stopped early"
    assert f"resumed from {outcome.resume_from} at step {trial.step - 1}" in replay.stdout, replay.tail()
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
    # data workers outlive neither the killing of the rank that runs them (the first stage's) nor of another
    assert {0, 1} <= {t.fault.rank for t in DEFAULT if t.layout.workers}
