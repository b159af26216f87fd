"""gems.comm: the waiting loop, tags and failure handling in-process; every operation of both
backends under mpiexec (tests/distributed/comm_worker.py), and what happens when a rank fails."""
from __future__ import annotations

import re

import pytest
import torch

import gems.comm
from gems.comm import base
from gems.comm.base import Backoff, Comm, CommTimeout, Request, message_tag, poll_until
from gems.errors import GemsError

from conftest import DISTRIBUTED

WORKER = DISTRIBUTED / "comm_worker.py"


# -- in-process: no MPI needed -----------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_poll_backs_off_from_first_to_longest_then_times_out(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(base.time, "monotonic", lambda: clock.now)
    monkeypatch.setattr(base.time, "sleep", clock.sleep)
    with pytest.raises(CommTimeout, match="waited 0.1s for x"):
        poll_until(lambda: False, 0.1, Backoff(50e-6, 2e-3), lambda t: f"waited {t:.1f}s for x")
    assert clock.sleeps[:7] == pytest.approx([50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 2e-3])
    assert max(clock.sleeps) == 2e-3


@pytest.mark.parametrize("yield_takes, polls", [(0.0, True), (1e-3, False)])
def test_poll_spins_first_unless_another_process_takes_the_core(monkeypatch, yield_takes, polls):
    """Backoff.spin: polls (each yielding the core) with no sleep until done -- unless a yield came back
    late (another process ran: the core is not this rank's alone), then the sleeping back-off."""
    clock = FakeClock()
    monkeypatch.setattr(base.time, "monotonic", lambda: clock.now)
    monkeypatch.setattr(base.time, "sleep", clock.sleep)
    monkeypatch.setattr(base, "_yield", lambda: setattr(clock, "now", clock.now + yield_takes + 1e-6))
    tests = iter([False] * 50 + [True])
    poll_until(lambda: next(tests), 10.0, Backoff(50e-6, 2e-3, spin=1.0), str)
    assert (clock.sleeps == []) is polls
    assert clock.sleeps[:1] == ([] if polls else [50e-6])


def test_poll_returns_without_sleeping_when_done():
    calls = iter([False, False, True])
    poll_until(lambda: next(calls), 1.0, Backoff(), str)  # would raise StopIteration if over-polled


def test_message_tags_and_their_limits():
    assert message_tag(0, 0, 2**29 - 1) == 0
    assert message_tag(3, 2, 2**29 - 1) == 3 * gems.comm.TENSORS_PER_MESSAGE + 2
    with pytest.raises(GemsError, match="at most 16 tensors"):
        message_tag(0, 16, 2**29 - 1)
    with pytest.raises(GemsError, match=r"outside 0\.\.33554431.*TAG_UB=536870911"):
        message_tag(33554432, 0, 2**29 - 1)
    with pytest.raises(GemsError):
        message_tag(-1, 0, 2**29 - 1)


def test_request_finishes_once_and_drops_its_buffers():
    finished = []
    req = Request(lambda: True, "recv from rank 1, tag 0", keep=[torch.zeros(1)],
                  finish=lambda: finished.append(1))
    assert req.poll() and req.poll()
    assert finished == [1] and req._keep == ()


class Aborted(Exception):
    pass


class FakeComm(Comm):
    def __init__(self) -> None:
        super().__init__(3, 4, 1, 2, torch.device("cpu"), 1.0, Backoff())

    def abort(self, code: int = 1):
        raise Aborted(code)


def test_guard_prints_one_line_and_aborts(capsys, monkeypatch):
    monkeypatch.delenv("GEMS_DEBUG", raising=False)
    with pytest.raises(Aborted, match="1"):
        with FakeComm().guard():
            raise RuntimeError("no such\nunit")
    err = capsys.readouterr().err
    assert err == "gems: rank 3 failed: RuntimeError: no such unit\n"


def test_guard_prints_traceback_with_gems_debug(capsys, monkeypatch):
    monkeypatch.setenv("GEMS_DEBUG", "1")
    with pytest.raises(Aborted):
        with FakeComm().guard():
            raise ValueError("boom")
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith("gems: rank 3 failed: ValueError: boom\n")


def test_guard_lets_clean_exit_through():
    with pytest.raises(SystemExit):
        with FakeComm().guard():
            raise SystemExit(0)


def test_create_rejects_bad_arguments():
    with pytest.raises(GemsError, match="unknown communication backend 'nccl'"):
        gems.comm.create("nccl")
    with pytest.raises(GemsError, match="positive number of seconds"):
        gems.comm.create("mpi", timeout=0)


def test_default_threads_share_cores():
    assert gems.comm.default_threads(4, cores=16) == 4
    assert gems.comm.default_threads(3, cores=2) == 1
    assert gems.comm.default_threads(1) >= 1


def test_group_ranks_are_checked():
    with pytest.raises(GemsError, match="distinct ranks"):
        base.check_group_ranks([0, 0], 2)
    with pytest.raises(GemsError):
        base.check_group_ranks([2], 2)


# -- under mpiexec -----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["mpi", "torch"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_every_operation(run_mpi, backend, ranks):
    """p2p tuples (float32/bfloat16/int64, 0-dim, empty, non-contiguous), ring with pre-posted
    receives, tag matching, test(), allreduce on the world and on sub-groups, buckets and their sums,
    reduce-scatters and allgathers by runs (in the node's shared memory on MPI), broadcast,
    allgather_object, the timeout message, tag limits, configure_threads."""
    result = run_mpi(ranks, WORKER, backend, "features", timeout=60, env={"GEMS_DEBUG": "1"})
    # Ranks' lines may interleave within one line of mpiexec's output: find, don't split.
    assert sorted(map(int, re.findall(r"rank (\d+): ok", result.stdout))) == list(range(ranks)), \
        result.tail()


def gems_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("gems:")]


@pytest.mark.parametrize("backend, ranks", [("mpi", 3), ("torch", 2)])
def test_exception_on_one_rank_ends_every_rank(run_mpi, backend, ranks):
    result = run_mpi(ranks, WORKER, backend, "raise", timeout=60, check=False)
    assert result.returncode != 0
    assert result.elapsed < 20, "abort should not wait for the 30 s comm timeout"
    assert gems_lines(result.stderr) == [
        f"gems: rank {ranks - 1} failed: ValueError: boom on purpose second line of the message"]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_killed_rank_ends_every_rank(run_mpi, backend):
    result = run_mpi(2, WORKER, backend, "kill", timeout=60, check=False)
    assert result.returncode != 0
    assert result.elapsed < 30, result.tail()


def test_hung_rank_is_ended_by_the_timeout(run_mpi):
    result = run_mpi(2, WORKER, "mpi", "hang", timeout=60, check=False)
    assert result.returncode != 0
    assert result.elapsed < 30, result.tail()
    assert gems_lines(result.stderr) == [
        "gems: rank 0 failed: CommTimeout: rank 0 waited 2.0s for a message from the failing rank "
        "(recv from rank 1, tag 1); that rank failed or hangs, or the ranks disagree on the "
        "schedule (the timeout is 2s)"], result.tail()
