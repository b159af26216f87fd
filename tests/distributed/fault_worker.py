"""Runs gems-train in this process, and on one rank SIGKILLs the process at a chosen moment
(a real crash: no handler runs, nothing is flushed), for the fault-injection tests.

    GEMS_FAULT="rank=1,at=backward,step=3" mpiexec -n 2 python tests/distributed/fault_worker.py <gems-train args>

GEMS_FAULT holds comma-separated ``key=value`` pairs:

- ``at``: where the rank dies. ``forward`` / ``backward``: entering a compute action; ``recv``:
  entering a receive action, its message posted and awaited; ``send``: just after a send action
  started its message; ``allreduce``: just after starting the gradient allreduce (only ranks with
  a sync group have one); ``step``: entering the optimizer step, after all of the step's
  communication; ``save``: halfway through writing a file of the checkpoint of that step, leaving
  the half-written temporary file behind (a torn write).
- ``step``: the training step in which it dies, numbered as ``--metrics`` numbers them (a resumed
  run continues the count from its checkpoint); for ``save``, the step the checkpoint is of.
- ``rank``: the world rank that dies (default 0). ``nth``: die at the nth matching moment of that
  step (default 1). For ``save``, the nth file this rank writes: a rank of group 0 writes its
  stage shard, then its RNG file, and rank 0 then the manifest; other ranks only their RNG file.
- ``stage`` / ``replica``: count only actions of that stage or replica (forward, backward, recv,
  send).
- ``timeout``: seconds; once this process's first training step is done, the communicator's
  timeout becomes this (``--timeout`` then only bounds the start-up, which loaded cores and a data
  workers' fork server can make slow), so survivors waiting on the dead rank give up soon.

If GEMS_FAULT_RECORD names a directory, the dying rank writes ``killed.json`` there just before
dying (``{"rank", "at", "step", "what", "time"}``, ``time.time()``), and every rank that fails
through ``Comm.guard`` writes ``failed-rank-R.json`` (``{"rank", "line", "time"}``, its one-line
failure) before aborting: a test learns what happened from files, which an abort cannot lose the
way it can lose a line still in the launcher's pipes. Without GEMS_FAULT this is plain gems-train.

If GEMS_FAULT_THEN holds a JSON list of gems-train argument lists, a run that ends with status 0 is
followed by gems-train runs with each of them in turn, as long as they end with status 0, in the same
processes (one communicator per backend, made by the first run that uses it): runs nobody kills, such as
resumes to the end and uninterrupted reference runs, that cost no launch (no interpreter start, no
torch import) of their own.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

from gems.train import checkpoint, trainer
from gems.cli import train
from gems.comm.base import Comm, failure_line
from gems.pipeline.engine import Engine
from gems.pipeline.executor import Executor
from gems.pipeline.gradsync import GradSync
from gems.pipeline.p2p import Messenger

KINDS = ("forward", "backward", "recv", "send", "allreduce", "step", "save")


def parse(spec: str) -> dict[str, int | str]:
    fault: dict[str, int | str] = {"rank": 0, "nth": 1}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        key = key.strip()
        fault[key] = value.strip() if key == "at" else float(value) if key == "timeout" else int(value)
    if fault.get("at") not in KINDS or "step" not in fault or set(fault) - {"at", "step", "rank", "nth",
                                                                          "stage", "replica", "timeout"}:
        sys.exit(f"fault_worker: GEMS_FAULT={spec!r}: want at={'|'.join(KINDS)},step=N"
                 "[,rank=R][,nth=N][,stage=S][,replica=R][,timeout=SECONDS]")
    return fault


def record(name: str, data: dict) -> None:
    """Write ``data`` plus the time as JSON to ``name`` in $GEMS_FAULT_RECORD, if set, whole or not at all."""
    folder = os.environ.get("GEMS_FAULT_RECORD")
    if folder:  # write then rename: another rank's abort may kill this one mid-write
        part = os.path.join(folder, f".{name}.{os.getpid()}")
        with open(part, "w", encoding="utf-8") as f:
            json.dump({**data, "time": time.time()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, os.path.join(folder, name))


class Fault:
    """Counts the moments that match the fault and kills this process at the chosen one."""

    def __init__(self, fault: dict) -> None:
        self.fault = fault
        self.step = 0          # the training step in progress (or the checkpoint being written)
        self.seen = 0          # matching moments so far in that step

    def begin(self, step: int) -> None:
        self.step, self.seen = step, 0

    def hit(self, at: str, rank: int, action=None) -> bool:
        """True when this is the moment; the caller then does what must precede ``die``."""
        f = self.fault
        if at != f["at"] or rank != f["rank"] or self.step != f["step"]:
            return False
        if action is not None and any(k in f and getattr(action, k) != f[k] for k in ("stage", "replica")):
            return False
        self.seen += 1
        return self.seen == f["nth"]

    def die(self, rank: int, what: object = "") -> None:
        record("killed.json", {"rank": rank, "at": self.fault["at"], "step": self.step, "what": str(what)})
        print(f"fault_worker: rank {rank} SIGKILLs itself at {self.fault['at']} {what} of step {self.step}",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def install(fault: Fault) -> None:
    """Wrap the places a rank can die in; the wrappers behave as the originals on other ranks."""
    real_run, real_step = trainer.run, Engine.step

    def run(job):
        fault.step = job.resume_state[0]["step"] if job.resume_state is not None else 0
        return real_run(job)

    def step(self, images, labels):
        fault.begin(fault.step + 1)
        loss = real_step(self, images, labels)
        if "timeout" in fault.fault:  # every rank is past its start-up: waits are short from here on
            self.comm.timeout = fault.fault["timeout"]
        return loss

    trainer.run, Engine.step = run, step

    def before(name: str, at: str) -> None:  # die on entering the action
        real = getattr(Executor, name)

        def wrapped(self, a):
            if fault.hit(at, self.messenger.comm.rank, a):
                fault.die(self.messenger.comm.rank, a)
            return real(self, a)
        setattr(Executor, name, wrapped)

    for name, at in (("_forward", "forward"), ("_backward", "backward"), ("_receive", "recv")):
        before(name, at)

    real_send, real_apply = Messenger.send, GradSync.apply

    def send(self, a, tensors):  # die with the message started
        real_send(self, a, tensors)
        if fault.hit("send", self.comm.rank, a):
            fault.die(self.comm.rank, a)

    def apply(self, optimizer):
        if fault.hit("step", self.comm.rank):
            fault.die(self.comm.rank, "optimizer step")
        return real_apply(self, optimizer)

    Messenger.send, GradSync.apply = send, apply

    real_issue = GradSync._issue

    def issue(self, stage):  # die with this rank's part of a stage's gradient allreduce started
        req = real_issue(self, stage)
        if fault.hit("allreduce", self.comm.rank):
            self.comm.test(req)
            fault.die(self.comm.rank, f"the gradient allreduce of stage {stage}")
        return req

    GradSync._issue = issue

    real_fail = Comm.fail

    def fail(self, exc, code=1):  # on every rank: note how a survivor ended
        record(f"failed-rank-{self.rank}.json", {"rank": self.rank, "line": failure_line(self.rank, exc)})
        real_fail(self, exc, code)

    Comm.fail = fail

    real_save, real_write = checkpoint.save, checkpoint._write_atomic
    saving = {"rank": -1}

    def save(engine, directory, step, *args, **kwargs):
        saving["rank"] = engine.comm.rank
        fault.begin(step)  # the same step as training's: a checkpoint is saved after its step
        return real_save(engine, directory, step, *args, **kwargs)

    def write_atomic(path, write):
        if not fault.hit("save", saving["rank"]):
            return real_write(path, write)

        def torn(f):
            write(f)
            f.flush()
            f.truncate(f.tell() // 2)
            os.fsync(f.fileno())
            fault.die(saving["rank"], path.name)
        return real_write(path, torn)

    checkpoint.save, checkpoint._write_atomic = save, write_atomic


def in_turn(runs: list[list[str]]) -> None:
    """Run gems-train with each argument list of ``runs`` while they end with status 0; a job makes one
    communicator (per backend), so each backend's is made once and kept for the later runs."""
    made = {}
    real_communicator = train.communicator

    def communicator(prog, backend, *args):
        if backend not in made:
            made[backend] = real_communicator(prog, backend, *args)
        return made[backend]

    train.communicator = communicator
    for argv in runs:
        try:
            train.main(argv)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise


if __name__ == "__main__":
    spec = os.environ.get("GEMS_FAULT")
    if spec:
        install(Fault(parse(spec)))
    if os.environ.get("GEMS_FAULT_THEN"):
        if spec:  # the fault would strike the later runs too
            sys.exit("fault_worker: GEMS_FAULT_THEN is for launches without GEMS_FAULT")
        in_turn([sys.argv[1:], *json.loads(os.environ["GEMS_FAULT_THEN"])])
    else:
        train.main(sys.argv[1:])
