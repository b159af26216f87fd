"""One gems.comm scenario on every rank, launched by tests/test_comm.py through ``run_mpi``:

    mpiexec -n N python tests/distributed/comm_worker.py BACKEND SCENARIO [ARGS]

features  every operation, checked against known values; each rank prints "rank R: ok"
raise     the last rank raises inside comm.guard() while the others wait for it
kill      the last rank SIGKILLs itself while the others wait for it
hang      the last rank sleeps for an hour: the others' 2 s timeout must end the job
pingpong  [MiB] [round trips]: ranks 0 and 1 bounce a tensor; rank 0 prints the timing
mismatch  N: rank 0 sends 5 floats, rank 1 receives into a buffer of N: a clear error, no hang
"""
from __future__ import annotations

import os
import signal
import statistics
import sys
import time
import zlib

import torch

import gems.comm
from gems.comm import CommTimeout, TENSORS_PER_MESSAGE
from gems.errors import GemsError


def payload(rank: int, round_: int) -> tuple[torch.Tensor, ...]:
    """Tensors of several dtypes and shapes whose values identify the sender and the round."""
    g = torch.Generator().manual_seed(1000 * rank + round_)
    return (torch.randn(3, 5, generator=g),
            torch.randn(2, 3, 4, generator=g).to(torch.bfloat16),
            torch.randint(-2**40, 2**40, (7,), generator=g, dtype=torch.int64),
            torch.randn(6, 4, generator=g).t(),          # non-contiguous on the sender
            torch.tensor(float(rank) + round_ / 10),     # 0-dim
            torch.empty(0, 3))                           # empty


def buffers() -> tuple[torch.Tensor, ...]:
    return (torch.zeros(3, 5), torch.zeros(2, 3, 4, dtype=torch.bfloat16),
            torch.zeros(7, dtype=torch.int64), torch.zeros(6, 4).t(),  # non-contiguous receiver
            torch.zeros(()), torch.zeros(0, 3))


def same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            raise AssertionError(f"{what}: tensor {i} differs: got {a}, want {b}")


def check_ring(comm: gems.comm.Comm) -> None:
    """Every rank sends to its right neighbour and receives from its left, receives posted first."""
    left, right = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
    for round_ in range(3):
        into = buffers()
        recv = comm.irecv(into, left, tag=round_)
        comm.barrier()  # every receive is posted before any send starts
        send = comm.isend(payload(comm.rank, round_), right, tag=round_)
        comm.wait(send, f"ring send {round_}")
        comm.wait(recv, f"ring recv {round_}")
        same(into, payload(left, round_), f"ring round {round_}")
    # Two messages in flight between the same pair, sent in the opposite order of the receives:
    # tags, not arrival order, decide which buffer gets which.
    first, second = buffers(), buffers()
    r1 = comm.irecv(first, left, tag=10)
    r2 = comm.irecv(second, left, tag=11)
    s2 = comm.isend(payload(comm.rank, 11), right, tag=11)
    s1 = comm.isend(payload(comm.rank, 10), right, tag=10)
    deadline = time.monotonic() + 20
    while not all(comm.test(r) for r in (r1, r2, s1, s2)):  # test() alone drives progress
        if time.monotonic() > deadline:
            raise AssertionError("test() never completed the requests")
        time.sleep(1e-4)
    same(first, payload(left, 10), "tag 10")
    same(second, payload(left, 11), "tag 11")
    nbytes = sum(t.numel() * t.element_size() for t in buffers())
    if any(comm.received[tag] != nbytes for tag in (0, 1, 2, 10, 11)):   # the byte counter, per tag
        raise AssertionError(f"received {dict(comm.received)}, want {nbytes} bytes per tag")


def check_allreduce(comm: gems.comm.Comm) -> None:
    n, total = comm.size, comm.size * (comm.size + 1) // 2
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        t = torch.full((3, 4), comm.rank + 1, dtype=dtype)
        comm.allreduce(t, None, f"world allreduce {dtype}")
        same((t,), (torch.full((3, 4), total, dtype=dtype),), f"world allreduce {dtype}")
    strided = torch.full((4, 6), float(comm.rank + 1)).t()
    comm.allreduce(strided, None, "non-contiguous allreduce")
    same((strided,), (torch.full((6, 4), float(total)),), "non-contiguous allreduce")

    # The engine's pattern: mirrored positions {0, n-1} and the rest; every rank makes every call.
    pair = [n - 1, 0] if n > 2 else [1, 0]       # given out of order on purpose
    rest = [r for r in range(n) if r not in pair] or [0]
    g_pair, g_rest = comm.group(pair), comm.group(rest)
    for ranks, g in ((pair, g_pair), (rest, g_rest)):
        if comm.rank not in ranks:
            if g is not None:
                raise AssertionError(f"rank {comm.rank} got a group {g} it is not in")
            continue
        if g.ranks != ranks or g.size != len(ranks) or g.rank != ranks.index(comm.rank):
            raise AssertionError(f"group {g} for ranks {ranks}")
        t = torch.full((5,), float(comm.rank + 1))
        comm.allreduce(t, g, f"allreduce over {ranks}")
        same((t,), (torch.full((5,), float(sum(r + 1 for r in ranks))),), f"allreduce over {ranks}")
        t = torch.full((2, 2), float(comm.rank)).to(torch.bfloat16)
        comm.broadcast(t, ranks[0], g)
        same((t,), (torch.full((2, 2), float(ranks[0])).to(torch.bfloat16),), f"broadcast in {ranks}")
        got = comm.allgather_object(("member", comm.rank), g)
        if got != [("member", r) for r in ranks]:
            raise AssertionError(f"allgather_object over {ranks}: {got}")


def check_buckets(comm: gems.comm.Comm) -> None:
    """Buckets (``Comm.bucket``): zeros; a slice of one summed over the world and over a pair, below
    and above the ring's size, exact and with the same bits on every member; the rest untouched. On
    the MPI backend the sums run in the node's shared memory, and a bucket no tensor uses any more
    gives its memory to the next."""
    cpu, n = torch.device("cpu"), comm.size
    pair = [n - 1, 0]
    g_pair, g_all = comm.group(pair), comm.group(list(range(n)))
    for numel in (5, 300_000):
        flat = comm.bucket(numel + 7, torch.float32, cpu)
        if flat.shape != (numel + 7,) or bool(flat.any()):
            raise AssertionError(f"bucket of {numel + 7}: {flat.shape}, any {bool(flat.any())}")
        for ranks, group in ((list(range(n)), None), (pair, g_pair)):
            if comm.rank not in ranks:
                continue
            whole = torch.arange(numel, dtype=torch.float32)   # integers: every order of the sum is exact
            flat[7:] = whole * (comm.rank + 1)
            flat[:7] = -1.0
            req = comm.iallreduce(flat[7:], group)
            comm.wait(req, f"a bucket's sum over {ranks}")
            same((flat[7:], flat[:7]), (whole * sum(r + 1 for r in ranks), torch.full((7,), -1.0)),
                 f"bucket of {numel} over {ranks}")
            if comm.backend == "mpi" and "in node memory" not in req.describe:
                raise AssertionError(f"a bucket's sum over {ranks} went {req.describe!r}")
            torch.manual_seed(comm.rank)
            flat[7:] = torch.randn(numel)   # not exact: the same bits on every member all the same
            comm.allreduce(flat[7:], group, "a bucket's sum of random values")
            bits = comm.allgather_object(zlib.crc32(flat[7:].numpy().tobytes()), group)
            if len(set(bits)) != 1:
                raise AssertionError(f"a bucket's sum over {ranks} differs between members")
            check_runs(comm, flat[7:], whole, ranks, group or g_all)
        where = flat.data_ptr()
        del flat
        again = comm.bucket(numel, torch.float32, cpu)
        if comm.backend == "mpi" and again.data_ptr() != where:
            raise AssertionError("a bucket no tensor uses did not give its memory to the next")
        del again


def check_runs(comm: gems.comm.Comm, flat: torch.Tensor, whole: torch.Tensor, ranks: list[int], group) -> None:
    """A sharded optimizer's collectives on a bucket (``flat``, of ``whole``'s size) over ``ranks``, by
    uneven runs, the first member's empty: the reduce-scatter sums each member's own run (exact:
    integers), the allgather gives every member each run from its member; in node memory on MPI."""
    numel, at = whole.numel(), ranks.index(comm.rank)
    bounds = [0, 0] + [numel * k // len(ranks) for k in range(2, len(ranks))] + [numel]
    flat.copy_(whole * (comm.rank + 1))
    req = comm.ireduce_scatter_runs(flat, bounds, group)
    comm.wait(req, f"a bucket's reduce-scatter over {ranks}")
    lo, hi = bounds[at], bounds[at + 1]
    same((flat[lo:hi],), (whole[lo:hi] * sum(r + 1 for r in ranks),), f"reduce-scatter run of {ranks}")
    flat.copy_(whole * (comm.rank + 1))   # each member's own run: its values; the rest: to be overwritten
    req = comm.iallgather_runs(flat, bounds, group)
    comm.wait(req, f"a bucket's allgather over {ranks}")
    expected = torch.cat([whole[a:b] * (r + 1) for r, a, b in zip(ranks, bounds, bounds[1:])])
    same((flat,), (expected,), f"allgather of runs over {ranks}")
    if comm.backend == "mpi":
        for r in (comm.ireduce_scatter_runs(flat, bounds, group), comm.iallgather_runs(flat, bounds, group)):
            comm.wait(r, "a bucket's collective")
            if "in node memory" not in r.describe:
                raise AssertionError(f"a bucket's collective over {ranks} went {r.describe!r}")


def check_broadcast_and_objects(comm: gems.comm.Comm) -> None:
    root = comm.size - 1
    t = torch.arange(12.0).reshape(3, 4) if comm.rank == root else torch.zeros(3, 4)
    comm.broadcast(t, root, None)
    same((t,), (torch.arange(12.0).reshape(3, 4),), "world broadcast")
    strided = torch.full((4, 3), 7.0).t() if comm.rank == root else torch.zeros(4, 3).t()
    comm.broadcast(strided, root, None)
    same((strided,), (torch.full((3, 4), 7.0),), "non-contiguous broadcast")
    objects = comm.allgather_object({"rank": comm.rank, "blob": "x" * 100 * comm.rank})
    if objects != [{"rank": r, "blob": "x" * 100 * r} for r in range(comm.size)]:
        raise AssertionError(f"allgather_object: {objects}")


def check_timeout(comm: gems.comm.Comm) -> None:
    """A wait past the timeout names the rank, action and peer; the request survives it."""
    into = (torch.zeros(4),)
    if comm.rank == 0:
        recv = comm.irecv(into, 1, tag=999)
        comm.timeout, saved = 0.3, comm.timeout
        try:
            comm.wait(recv, "the probe message")
        except CommTimeout as exc:
            text = str(exc)
            for part in ("rank 0 waited", "for the probe message", "recv from rank 1, tag 999"):
                if part not in text:
                    raise AssertionError(f"{part!r} missing from: {text}") from exc
        else:
            raise AssertionError("no CommTimeout")
        comm.timeout = saved
    comm.barrier()
    if comm.rank == 1:
        comm.wait(comm.isend((torch.ones(4),), 0, tag=999), "the late probe")
    if comm.rank == 0:
        comm.wait(recv, "the late probe")
        same(into, (torch.ones(4),), "late probe")


def check_limits(comm: gems.comm.Comm) -> None:
    """Impossible tags and mismatched group() calls are refused; thread setup runs."""
    too_many = tuple(torch.zeros(1) for _ in range(TENSORS_PER_MESSAGE + 1))
    for bad in (lambda: comm.isend(too_many, 0, 0), lambda: comm.isend((torch.zeros(1),), 0, 2**40)):
        try:
            bad()
        except GemsError:
            continue
        raise AssertionError("an impossible tag was accepted")
    try:
        comm.group([comm.rank])  # different ranks on every rank: refused everywhere, no hang
    except GemsError as exc:
        if "same ranks in the same order" not in str(exc):
            raise
    else:
        raise AssertionError("group() accepted different rank lists")
    if gems.comm.configure_threads(comm) < 1:
        raise AssertionError("configure_threads")


def features(comm: gems.comm.Comm) -> None:
    check_ring(comm)
    check_allreduce(comm)
    check_buckets(comm)
    check_broadcast_and_objects(comm)
    check_timeout(comm)
    check_limits(comm)
    comm.barrier()
    print(f"rank {comm.rank}: ok ({comm!r})")


def wait_for_last(comm: gems.comm.Comm, how: str) -> None:
    """The last rank fails by ``how``; the others wait for a message it will never send."""
    last = comm.size - 1
    comm.barrier()
    if comm.rank == last:
        time.sleep(0.5)
        if how == "raise":
            raise ValueError("boom on purpose\nsecond line of the message")
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)
    comm.wait(comm.irecv((torch.zeros(1),), last, tag=1), "a message from the failing rank")


def pingpong(comm: gems.comm.Comm, mib: float = 4, trips: int = 30) -> None:
    t = torch.ones(int(mib * 2**20) // 4)
    times = []
    for _ in range(trips + 3):
        start = time.perf_counter()
        if comm.rank == 0:
            comm.wait(comm.isend((t,), 1, 0), "ping")
            comm.wait(comm.irecv((t,), 1, 1), "pong")
        elif comm.rank == 1:
            comm.wait(comm.irecv((t,), 0, 0), "ping")
            comm.wait(comm.isend((t,), 0, 1), "pong")
        times.append(time.perf_counter() - start)
    if comm.rank == 0:
        rt = statistics.median(times[3:])
        print(f"pingpong {comm.backend}: {mib:g} MiB, median round trip {rt * 1e3:.2f} ms "
              f"(min {min(times[3:]) * 1e3:.2f} ms), {2 * mib * 2**20 / rt / 1e9:.2f} GB/s")


def mismatch(comm: gems.comm.Comm, elements: int) -> None:
    """A receive whose buffer does not match what arrives must fail loudly on the receiver."""
    if comm.rank == 0:
        comm.wait(comm.isend((torch.ones(5),), 1, tag=7), "the odd-sized message")
    elif comm.rank == 1:
        into = (torch.zeros(elements),)
        comm.wait(comm.irecv(into, 0, tag=7), "the odd-sized message")
        print(f"rank 1: received {into[0].tolist()} without an error")
    comm.barrier()


def main() -> None:
    backend, scenario, *args = sys.argv[1:]
    timeout = {"kill": 10.0, "hang": 2.0}.get(scenario, 30.0)
    comm = gems.comm.create(backend, timeout=timeout)
    with comm.guard():
        if scenario == "features":
            features(comm)
        elif scenario in ("raise", "kill", "hang"):
            wait_for_last(comm, scenario)
        elif scenario == "mismatch":
            mismatch(comm, int(args[0]))
        elif scenario == "pingpong":
            pingpong(comm, *map(float, args[:1]), *map(int, args[1:2]))
        else:
            raise GemsError(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()
