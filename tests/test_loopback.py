"""gems.comm.loopback: the in-process, one-thread-per-rank communicator, under both semantics."""
from __future__ import annotations

import time

import pytest
import torch

from gems.comm.base import CommTimeout
from gems.comm.loopback import Deadlock, LoopbackComm, P2POp, run
from gems.errors import GemsError

pytestmark = pytest.mark.timeout(30)


# -- mpi semantics -----------------------------------------------------------------------------

def test_ring_with_tags_received_out_of_order():
    def fn(comm: LoopbackComm) -> list[float]:
        right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        sends = [comm.isend((torch.full((2,), 10.0 * comm.rank + tag),), right, tag) for tag in range(3)]
        bufs = {tag: torch.zeros(2) for tag in (2, 0, 1)}
        recvs = {tag: comm.irecv((buf,), left, tag) for tag, buf in bufs.items()}
        for tag in (1, 2, 0):
            comm.wait(recvs[tag], f"recv tag {tag}")
        for req in sends:
            comm.wait(req, "send")
        return [bufs[tag][0].item() for tag in range(3)]

    results = run(4, fn)
    for rank, got in enumerate(results):
        left = (rank - 1) % 4
        assert got == [10.0 * left + tag for tag in range(3)]


def test_equal_tags_do_not_overtake_and_sends_are_buffered():
    def fn(comm: LoopbackComm) -> list[float]:
        if comm.rank == 0:
            t = torch.zeros(1)
            for value in range(5):
                t.fill_(value)  # reusing the buffer at once is fine: an mpi-semantics send copies
                comm.wait(comm.isend((t,), 1, tag=7), "send")
            return []
        time.sleep(0.05)  # let every message arrive unexpected
        bufs = [torch.zeros(1) for _ in range(5)]
        reqs = [comm.irecv((b,), 0, tag=7) for b in bufs]
        for req in reqs:
            comm.wait(req, "recv")
        return [b.item() for b in bufs]

    assert run(2, fn)[1] == [0.0, 1.0, 2.0, 3.0, 4.0]


def cross(comm: LoopbackComm, batched: bool = False) -> float:
    """Each rank posts [recv from the other, send to the other], then waits for both."""
    peer = 1 - comm.rank
    buf, data = torch.zeros(3), torch.full((3,), float(comm.rank + 1))
    if batched:
        recv, send = comm.ibatch([P2POp("recv", (buf,), peer, 0), P2POp("send", (data,), peer, 0)])
    else:
        recv, send = comm.irecv((buf,), peer, 0), comm.isend((data,), peer, 0)
    comm.wait(recv, "recv_act d0.s1")
    comm.wait(send, "send_grad d0.s1")
    return buf[0].item()


def test_mpi_cross_pattern_completes():
    assert run(2, cross, semantics="mpi") == [2.0, 1.0]
    assert run(2, cross, True, semantics="mpi") == [2.0, 1.0]


def test_mpi_shape_mismatch_fails_the_receiver():
    def fn(comm: LoopbackComm) -> None:
        if comm.rank == 0:
            comm.wait(comm.isend((torch.zeros(3),), 1, 5), "send")
        else:
            comm.wait(comm.irecv((torch.zeros(4),), 0, 5), "recv")

    with pytest.raises(GemsError, match=r"rank 0 sent \[float32\[3\]\].*rank 1 receives \[float32\[4\]\]") as info:
        run(2, fn)
    assert "on loopback rank 1" in info.value.__notes__


def test_bad_peer_and_tag_are_gems_errors():
    with pytest.raises(GemsError, match="to one of ranks 0..1"):
        run(2, lambda comm: comm.isend((torch.zeros(1),), 5, 0))
    with pytest.raises(GemsError, match="at most 16 tensors"):
        run(1, lambda comm: comm.isend(tuple(torch.zeros(1) for _ in range(17)), 0, 0))


# -- nccl semantics ----------------------------------------------------------------------------

def test_nccl_ordered_pairs_and_a_chain():
    def fn(comm: LoopbackComm) -> list[float]:
        got = []
        for micro in range(3):
            if comm.rank > 0:
                buf = torch.zeros(2)
                comm.wait(comm.irecv((buf,), comm.rank - 1, tag=123), "recv")  # tags are ignored
                got.append(buf.sum().item())
            if comm.rank < comm.size - 1:
                comm.wait(comm.isend((torch.full((2,), float(micro + comm.rank)),), comm.rank + 1, micro), "send")
        return got

    assert run(3, fn, semantics="nccl") == [[], [0.0, 2.0, 4.0], [2.0, 4.0, 6.0]]


def test_nccl_cross_pattern_is_a_deadlock_found_at_once():
    start = time.monotonic()
    with pytest.raises(Deadlock) as info:
        run(2, cross, semantics="nccl", timeout=20)
    assert time.monotonic() - start < 2
    message = str(info.value)
    assert "rank 0 waits for recv_act d0.s1 (recv from rank 1, tag 0)" in message
    assert "rank 1 waits for recv_act d0.s1 (recv from rank 0, tag 0)" in message


def test_nccl_cross_pattern_in_one_batch_completes():
    assert run(2, cross, True, semantics="nccl") == [2.0, 1.0]


def test_nccl_send_waits_for_its_receive():
    def fn(comm: LoopbackComm) -> bool | None:
        if comm.rank == 0:
            req = comm.isend((torch.ones(1),), 1, 0)
            done_early = comm.test(req)
            comm.barrier()
            comm.wait(req, "send")
            return done_early
        comm.barrier()
        comm.wait(comm.irecv((torch.zeros(1),), 0, 0), "recv")
        return None

    assert run(2, fn, semantics="nccl")[0] is False
    assert run(2, fn, semantics="mpi")[0] is True


def test_nccl_size_mismatch_fails_both_sides():
    failures = []

    def fn(comm: LoopbackComm) -> None:
        t = torch.zeros(3 if comm.rank == 0 else 2)
        req = comm.isend((t,), 1, 0) if comm.rank == 0 else comm.irecv((t,), 0, 0)
        try:
            comm.wait(req, "boundary")
        except GemsError as exc:
            failures.append((comm.rank, str(exc)))
            raise

    with pytest.raises(GemsError, match="disagree on the boundary shapes"):
        run(2, fn, semantics="nccl")
    assert sorted(rank for rank, _ in failures) == [0, 1]


def test_a_rank_returning_while_another_waits_is_a_deadlock():
    def fn(comm: LoopbackComm) -> None:
        if comm.rank == 0:
            comm.wait(comm.irecv((torch.zeros(1),), 1, 3), "the reply")

    with pytest.raises(Deadlock, match=r"rank 0 waits for the reply.*ranks \[1\] have returned"):
        run(2, fn, timeout=20)


# -- collectives -------------------------------------------------------------------------------

@pytest.mark.parametrize("semantics", ["mpi", "nccl"])
def test_collectives_and_a_sub_group(semantics):
    def fn(comm: LoopbackComm) -> dict:
        out = {}
        t = torch.full((2, 2), float(comm.rank))
        comm.allreduce(t, None, "sum")
        out["sum"] = t[0, 0].item()
        b = torch.full((3,), float(comm.rank))
        comm.broadcast(b, root=2)
        out["bcast"] = b.tolist()
        out["objects"] = comm.allgather_object({"rank": comm.rank, "pad": "x" * comm.rank})
        comm.barrier()
        odd = comm.group([3, 1])
        if odd is not None:
            out["group"] = (odd.rank, odd.size)
            g = torch.tensor([comm.rank], dtype=torch.int64)
            comm.allreduce(g, odd, "odd sum")
            out["odd"] = g.item()
            out["odd_objects"] = comm.allgather_object(comm.rank, odd)
            h = torch.tensor([comm.rank * 1.5])
            comm.broadcast(h, root=1, group=odd)
            out["odd_bcast"] = h.item()
        else:
            assert comm.rank in (0, 2)
        comm.barrier()
        return out

    results = run(4, fn, semantics=semantics)
    for rank, out in enumerate(results):
        assert out["sum"] == 6.0
        assert out["bcast"] == [2.0, 2.0, 2.0]
        assert out["objects"] == [{"rank": r, "pad": "x" * r} for r in range(4)]
        if rank in (1, 3):
            assert out["group"] == ({3: 0, 1: 1}[rank], 2)
            assert out["odd"] == 4
            assert out["odd_objects"] == [3, 1]
            assert out["odd_bcast"] == 1.5
        else:
            assert "group" not in out


def test_allreduce_reads_contributions_at_post_time():
    def fn(comm: LoopbackComm) -> float:
        t = torch.ones(1)
        req = comm.iallreduce(t, None)
        t.fill_(100.0)  # too late to change what was contributed
        comm.wait(req, "sum")
        return t.item()

    assert run(3, fn) == [3.0, 3.0, 3.0]


def test_mismatched_collectives_are_gems_errors():
    def fn(comm: LoopbackComm) -> None:
        t = torch.zeros(1)
        if comm.rank == 0:
            comm.allreduce(t, None, "sum")
        else:
            comm.broadcast(t, root=1)

    with pytest.raises(GemsError, match="disagree on collective #1"):
        run(2, fn)


# -- failures and timeouts ---------------------------------------------------------------------

@pytest.mark.parametrize("guarded", [False, True])
def test_a_failing_rank_ends_the_others_waits_promptly(guarded, capfd):
    def fn(comm: LoopbackComm) -> None:
        if comm.rank == 1:
            time.sleep(0.05)  # the others are blocked by now
            if guarded:
                with comm.guard():
                    raise ValueError("bad input on rank 1")
            raise ValueError("bad input on rank 1")
        comm.wait(comm.irecv((torch.zeros(1),), 1, 0), "never sent")

    start = time.monotonic()
    with pytest.raises(ValueError, match="bad input on rank 1") as info:
        run(3, fn, timeout=20)
    assert time.monotonic() - start < 2
    assert type(info.value) is ValueError
    assert "on loopback rank 1" in info.value.__notes__
    assert "gems: rank" not in capfd.readouterr().err  # guard's failure line is for real jobs only


def test_a_wait_times_out_while_a_peer_computes():
    def fn(comm: LoopbackComm) -> None:
        if comm.rank == 0:
            comm.wait(comm.irecv((torch.zeros(1),), 1, 0), "activations")
        else:
            time.sleep(0.6)  # busy, not blocked: no deadlock can be claimed

    with pytest.raises(CommTimeout, match="rank 0 waited .* for activations") as info:
        run(2, fn, timeout=0.2)
    assert type(info.value) is CommTimeout


def test_abort_raises_instead_of_exiting():
    with pytest.raises(RuntimeError, match="rank 0 aborted the loopback world with exit code 3"):
        run(2, lambda comm: comm.abort(3) if comm.rank == 0 else comm.barrier())


def test_results_and_arguments():
    def fn(comm: LoopbackComm, base: int, *, scale: int) -> tuple:
        return (comm.backend, comm.semantics, comm.local_rank, comm.local_size, base + scale * comm.rank)

    assert run(3, fn, 10, scale=2, semantics="nccl") == [("loopback", "nccl", r, 3, 10 + 2 * r) for r in range(3)]
    with pytest.raises(GemsError, match="unknown loopback semantics"):
        run(2, fn, 0, scale=1, semantics="gloo")
