"""Schedules are complete and deadlock-free for every K and m; the validator catches faults."""
import pytest

from gems.errors import GemsError
from gems.schedule import generators as sch
from gems.schedule.validate import validate


def configs():
    for name in sch.SCHEDULES:
        for K in range(1, 9):
            for m in ([1] if name == "mp" else range(1, 9)):
                yield name, K, m


@pytest.mark.parametrize("name,K,m", list(configs()))
def test_every_schedule_is_valid(name, K, m):
    lists = sch.schedule(name, K, m)
    validate(name, K, m, lists)
    peaks = sch.in_flight(name, K, m)
    assert [sorted(p) for p in peaks] == [sch.holds(name, K, r) for r in range(K)]
    assert all(1 <= c <= m * sch.replicas(name) for p in peaks for c in p.values())


def test_mast_k2_m1_is_the_gems_mast_order():
    text = sch.describe(sch.schedule("mast", 2, 1))
    assert text.splitlines() == [
        "position 0: F d0.s0  F u0.s1  B u0.s1  B d0.s0",
        "position 1: F u0.s0  F d0.s1  B d0.s1  B u0.s0",
    ]


def test_mirror_placement_and_odd_middle():
    assert sch.holds("mast", 4, 1) == [1, 2]
    assert sch.holds("mast", 5, 2) == [2]
    assert sch.holds("1f1b", 4, 3) == [3]
    # the shared middle stage carries both replicas' micro-batches
    assert sch.in_flight("mast", 3, 1)[1] == {1: 2}


def test_moments_follow_each_position_in_time():
    lists = sch.schedule("mast", 2, 1)
    assert [str(a) for a in lists[0] if a.op in sch.COMPUTE] == \
        ["forward d0.s0", "forward u0.s1", "backward u0.s1", "backward d0.s0"]
    # after B u0.s1 only stage 0 is alive again: a moment already seen
    # (stage computed, alive per stage, the stage whose backward is prefetched during it, between
    # the halves of a split backward per stage, the stages whose gradients exist from their first backward to
    # their reduce): B d0.s0 differs from F d0.s0 by stage 0's gradients, made during it
    assert sch.moments(lists[0]) == [(0, {0: 1}, None, {}, ()), (1, {0: 1, 1: 1}, None, {}, ()),
                                     (1, {0: 1, 1: 1}, 0, {}, (1,)), (0, {0: 1}, None, {}, (0,))]
    gpipe = sch.moments(sch.schedule("gpipe", 2, 3)[0])
    # F0 F1 F2 B0 B1 B2: F2, B0 and B1 each run while the next backward's tensors come back (moments are distinct)
    assert gpipe == [(0, {0: 1}, None, {}, ()), (0, {0: 2}, None, {}, ()), (0, {0: 3}, 0, {}, ()),
                     (0, {0: 3}, 0, {}, (0,)), (0, {0: 2}, 0, {}, (0,)), (0, {0: 1}, None, {}, (0,))]
    for name, K, m in (("1f1b", 4, 8), ("mast", 4, 2), ("gpipe", 3, 4)):
        for actions, bound in zip(sch.schedule(name, K, m), sch.in_flight(name, K, m)):
            alive = [live for _, live, *_ in sch.moments(actions)]
            assert {s: max(live.get(s, 0) for live in alive) for s in bound} == bound


def test_in_flight_bounds():
    assert sch.in_flight("gpipe", 4, 6)[0] == {0: 6}
    assert [p[r] for r, p in enumerate(sch.in_flight("1f1b", 4, 8))] == [4, 3, 2, 1]
    assert sch.in_flight("mp", 3, 1) == [{0: 1}, {1: 1}, {2: 1}]


def test_validator_finds_a_deadlock():
    lists = sch.schedule("mast", 2, 1)
    # position 0 waits for its gradient before sending the activation it comes from
    p0 = lists[0]
    recv = next(a for a in p0 if a.op == sch.RECV_GRAD)
    p0.remove(recv)
    p0.insert(0, recv)
    with pytest.raises(ValueError, match="deadlock"):
        validate("mast", 2, 1, lists)


def test_validator_finds_missing_and_unmatched_actions():
    lists = sch.schedule("gpipe", 2, 2)
    del lists[1][[a.op for a in lists[1]].index(sch.BACKWARD)]
    with pytest.raises(ValueError, match="missing|before"):
        validate("gpipe", 2, 2, lists)
    lists = sch.schedule("gpipe", 2, 2)
    lists[0] = [a for a in lists[0] if a.op != sch.SEND_ACT]
    with pytest.raises(ValueError, match="unmatched"):
        validate("gpipe", 2, 2, lists)


@pytest.mark.parametrize("args,fix", [
    (("pipedream", 2, 1), "choose one of"),
    (("mast", 0, 1), "positive integer"),
    (("gpipe", 2, 0), "positive integer"),
    (("mp", 2, 4), "--micro-batches 1"),
])
def test_bad_input(args, fix):
    with pytest.raises(GemsError, match=fix):
        sch.schedule(*args)
