"""The engine trains exactly like one process, in process: every schedule, layout, micro-batch
count and memory policy on loopback ranks (gems.comm.loopback, one thread per rank).

Each configuration trains a tiny model for a few SGD steps on K x D ranks and compares the
state dict and losses with one process training on the same global batches (rtol 1e-5), and
checks that every rank ran its units as often as the recompute rule says (tests/equivalence.py).
mpiexec launches (tests/test_engine.py) only remain for what needs real processes.

Under ``semantics="nccl"`` (un-batched NCCL: per pair of ranks, one queue of sends and receives
in posting order, tags ignored) every layout with m in {1, 4} runs too: the Messenger posts each
pair's transfers in the pair's wire order.
"""
from __future__ import annotations

import time

import pytest
import torch

import gems.pipeline.offload
import gems.pipeline.stage
from gems.schedule import ir
from gems.schedule import generators as sch
from gems.schedule.generators import SCHEDULES

from equivalence import batch_size, check_copies, describe, reference, run_loopback

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]


def layouts(Ks=(1, 2, 3, 4), ms=(1, 2), Ds=(1, 2), schedules=SCHEDULES) -> list[tuple[str, int, int, int]]:
    """(schedule, K, m, D) for every combination; mp runs one micro-batch only."""
    return [(s, K, m, D) for K in Ks for s in schedules for m in ms for D in Ds if not (s == "mp" and m > 1)]


def ids(layout: tuple[str, int, int, int]) -> str:
    s, K, m, D = layout
    return f"{s}-K{K}-m{m}-D{D}"


def params(items) -> list:
    return [pytest.param(*layout, id=ids(layout)) for layout in items]


# ---------------------------------------------------------------- the full matrix, MPI semantics
@pytest.mark.parametrize("schedule,K,m,D", params(layouts()))
def test_trains_like_one_process(schedule, K, m, D):
    run_loopback("transparency", schedule, K, m, D, steps=3)


# ---------------------------------------------------------------- memory policies
POLICY_NAMES = ("recompute", "segment", "offload", "recompute+offload")
POLICY_LAYOUTS = layouts(Ks=(2,), Ds=(1,)) + [
    ("mast", 2, 2, 2), ("1f1b", 2, 2, 2),
    ("mast", 3, 1, 1), ("mast", 3, 2, 2), ("gpipe", 3, 2, 1), ("1f1b", 3, 2, 1),
    ("mast", 4, 2, 1), ("1f1b", 4, 2, 1), ("gpipe", 4, 2, 2), ("mp", 4, 1, 1),
]


def offloads(policy: str, waiting: list[int]) -> bool:
    """Whether a rank whose waiting forwards run stages of these unit counts moves anything to
    the host. With every unit recomputed a stage saves only its segments' inputs, so a stage of
    one unit saves only its own input, which stays on the device."""
    smallest = 2 if policy == "recompute+offload" else 1
    return "offload" in policy and any(units >= smallest for units in waiting)


@pytest.mark.parametrize("schedule,K,m,D", params(POLICY_LAYOUTS))
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_policies_keep_the_math_and_the_recompute_rule(policy, schedule, K, m, D, monkeypatch):
    """Same state and losses as one process; each rank ran its units as the rule says; offload
    moves something exactly on the ranks with waiting forwards, and brings all of it back."""
    monkeypatch.setattr(gems.pipeline.offload, "MIN_OFFLOAD_BYTES", 1)   # these activations are tiny
    results = run_loopback("transparency", schedule, K, m, D, steps=2, policy=policy)
    for r in results:
        assert (r.offloaded > 0) == offloads(policy, r.waiting), f"rank {r.rank}: {r.offloaded} B offloaded"
        assert r.fetched_back, f"rank {r.rank} left offloaded tensors behind"


@pytest.mark.parametrize("schedule,m,policy", [("mast", 1, "offload"), ("gpipe", 2, "recompute+offload"),
                                               ("1f1b", 2, "recompute+offload")])
def test_offload_at_the_real_threshold(schedule, m, policy):
    """Side 40: 2 rows x 8 channels x 40 x 40 floats = 100 KiB activations, above MIN_OFFLOAD_BYTES."""
    results = run_loopback("transparency", schedule, 2, m, 1, steps=2, side=40, policy=policy)
    assert any(r.offloaded > 0 for r in results)
    for r in results:
        assert (r.offloaded > 0) == offloads(policy, r.waiting), f"rank {r.rank}: {r.offloaded} B offloaded"


# ---------------------------------------------------------------- BatchNorm, tuples, clipping
@pytest.mark.parametrize("schedule,K,m,D", params(layouts(Ks=(2, 4), schedules=("mast", "1f1b"))))
def test_batchnorm_copies_stay_identical(schedule, K, m, D):
    results = run_loopback("batchnorm", schedule, K, m, D, steps=3)
    shared = check_copies(describe("batchnorm", schedule, K, D, m), results[0].state,
                          [r.stage_state for r in results])
    assert (shared > 0) == (schedule == "mast" or D > 1)   # copies exist: mirrored replicas, groups
    tracked = [v for k, v in results[0].state.items() if k.endswith("num_batches_tracked")]
    assert tracked and all(int(t) == 3 * m for t in tracked)   # a copy forwards m micro-batches a step


@pytest.mark.parametrize("policy", ["recompute", "recompute+offload"])
def test_batchnorm_with_policies(policy, monkeypatch):
    monkeypatch.setattr(gems.pipeline.offload, "MIN_OFFLOAD_BYTES", 1)
    run_loopback("batchnorm", "mast", 2, 2, 2, steps=2, policy=policy)


# Tuple boundaries in every schedule, m = 1 and 2, K = 3, D = 2; the other layouts are the matrix's.
TUPLE_LAYOUTS = [("mp", 2, 1, 1), ("gpipe", 2, 2, 1), ("mast", 2, 2, 1), ("mast", 3, 1, 1), ("1f1b", 3, 2, 2)]


@pytest.mark.parametrize("schedule,K,m,D", params(TUPLE_LAYOUTS))
def test_tuple_boundaries_amoebanet(schedule, K, m, D):
    run_loopback("tuples", schedule, K, m, D, steps=2)


@pytest.mark.parametrize("schedule", ["mast", "1f1b"])
def test_recompute_with_tuple_boundaries(schedule):
    run_loopback("tuples", schedule, 2, 2, 1, steps=2, policy="recompute")


CLIP = 0.05


@pytest.mark.parametrize("schedule,K,m,D", params(layouts(Ks=(2, 4), ms=(2,), schedules=("mast", "1f1b"))))
def test_gradient_clipping_uses_the_global_norm(schedule, K, m, D):
    results = run_loopback("transparency", schedule, K, m, D, steps=3, clip=CLIP)
    _, _, norms = reference("transparency", batch_size(schedule, m, D), 3, CLIP)
    assert min(norms) > CLIP   # every step clips
    for r in results:
        assert r.grad_norm == pytest.approx(norms[-1], rel=1e-5), f"rank {r.rank}"


# ---------------------------------------------------------------- NCCL semantics
# Under un-batched NCCL (one ordered queue of sends and receives per pair of ranks, tags ignored,
# only a queue's head can complete) the Messenger posts each pair's transfers in the pair's wire
# order (ir.wire_order), so every layout trains exactly like one process there too -- including
# the layouts whose action lists cross (mast, 1f1b with m > 1), which deadlocked when receives
# were pre-posted at the start of a step or posted in each list's own order.
NCCL_LAYOUTS = layouts(ms=(1, 4))


def crossing(schedule: str, K: int, m: int) -> bool:
    """Whether two positions' action lists order the transfers between them differently."""
    lists = sch.schedule(schedule, K, m)
    def own(p: int, q: int) -> list[ir.Message]:
        return [a.message(p) for a in lists[p] if a.peer == q and (a.op in ir.SENDS or a.op in ir.RECVS)]
    return any(own(p, q) != own(q, p) for p in range(K) for q in range(p + 1, K))


@pytest.mark.parametrize("schedule,K,m,D", params(NCCL_LAYOUTS))
def test_trains_like_one_process_under_nccl_semantics(schedule, K, m, D):
    run_loopback("transparency", schedule, K, m, D, steps=2, semantics="nccl")


def test_the_nccl_matrix_includes_layouts_whose_lists_cross():
    crossed = {(s, K, m) for s, K, m, _ in NCCL_LAYOUTS if K > 1 and crossing(s, K, m)}
    assert {("mast", 2, 1), ("mast", 4, 4), ("1f1b", 3, 4)} <= crossed


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("K", range(2, 9))
def test_both_ends_of_a_pair_take_one_wire_order(schedule, K):
    """The order is one per pair, names each message of the pair once, and keeps each side's
    sends in its list's order (a send is posted when its action runs)."""
    for m in (1, 3, 8) if schedule != "mp" else (1,):
        lists = sch.schedule(schedule, K, m)
        for p in range(K):
            for q, wire in ir.wire_order(lists, p).items():
                assert ir.wire_order(lists, q)[p] == wire
                both = {a.message(p) for a in lists[p] if a.peer == q and (a.op in ir.SENDS or a.op in ir.RECVS)}
                assert len(wire) == len(set(wire)) and set(wire) == both
                assert [w for w in wire if w.src == p] == [a.message(p) for a in lists[p]
                                                          if a.peer == q and a.op in ir.SENDS]


def test_a_failing_rank_ends_every_rank_under_nccl_semantics(monkeypatch):
    """An exception in one rank's forward mid-step: the peers blocked on its transfers give up
    at once (PeerFailed), and run re-raises the failing rank's own exception."""
    original = gems.pipeline.stage.StageRunner.forward

    def forward(self, inputs, key, waiting):
        if key == (0, 1, 1):   # stage 1, micro-batch 1: its peers are mid-step
            raise RuntimeError("injected failure in forward")
        return original(self, inputs, key, waiting)

    monkeypatch.setattr(gems.pipeline.stage.StageRunner, "forward", forward)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="injected failure"):
        run_loopback("transparency", "1f1b", 3, 4, 1, steps=1, semantics="nccl", timeout=30)
    assert time.monotonic() - start < 10   # well inside the 30 s timeout
