"""The schedule search and the comparison schedules: mast's orders beat Chimera's closed form and
ZB-V in one simulator (forward 1, backward 2 or input-gradient 1 + weight-gradient 1, messages
free), within 1F1B's peak plus one micro-batch, and never lose to the classic order."""
from __future__ import annotations

import json

import pytest

from gems.cli import sim
from gems.schedule import generators as sch, ir, peers, search, simulate
from gems.schedule.ir import replay


def mast(K: int, m: int, split: bool) -> float:
    return simulate.utilization(sch.schedule("mast", K, m, split=split))


def chimera(K: int, N: int) -> float:
    return 2 * N / (2 * N + K - 2)


@pytest.mark.parametrize("K,m,target", [(4, 4, 0.93), (8, 8, 0.90), (8, 4, 0.85)])
def test_mast_with_split_backward_beats_chimera_and_zbv(K, m, target):
    value = mast(K, m, True)
    zbv = simulate.utilization(peers.peer_schedule("zbv", K, 2 * m))
    assert value >= target and value > chimera(K, 2 * m) and value >= zbv, (value, zbv)


@pytest.mark.parametrize("K", range(1, 9))
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_the_search_keeps_within_the_memory_bound_and_never_loses_to_the_classic_order(K, m):
    for split in (False, True):
        lists = sch.schedule("mast", K, m, split=split)
        peak = max(max(sum(live.values()) for _, live, *_ in sch.moments(actions)) for actions in lists)
        assert peak <= search.memory_bound(K, m)
        classic = search._run("mast", K, m, split, search.Variant("backward-first", 0, None))
        assert simulate.utilization(lists) >= classic.utilization() - 1e-12
    # the list scheduler's own timing is the simulator's with unit costs
    found, _ = search.order("mast", K, m, True)
    assert found.utilization() == pytest.approx(mast(K, m, True))


def test_known_utilizations():
    # today's figures before the search (classic order): 0.828 at K=4 m=4, 0.738 at K=8 m=8
    assert mast(4, 4, False) == pytest.approx(24 / 28)
    assert mast(8, 8, False) == pytest.approx(0.8)
    assert mast(4, 4, True) == pytest.approx(0.96)
    assert simulate.utilization(sch.schedule("1f1b", 4, 8)) == pytest.approx(24 / 33)
    assert sch.variant("mast", 2, 1) == "backward-first, cap K-s"


@pytest.mark.parametrize("name", peers.PEERS)
@pytest.mark.parametrize("K", [1, 2, 3, 4, 8])
def test_comparison_schedules_run_every_task_once_without_deadlock(name, K):
    for n in [2 * K, 2 * K + 3] + ([K, 1] if name == "zbv" else []):
        lists = peers.peer_schedule(name, K, n)
        replay(lists)
        done = [(a.op, a.micro, a.stage) for actions in lists for a in actions if a.op in ir.COMPUTE]
        assert len(done) == len(set(done))
        for s in range(2 * K):
            for j in range(n):
                has = {op for op, jj, ss in done if (jj, ss) == (j, s)}
                assert has in ({ir.FORWARD, ir.BACKWARD}, {ir.FORWARD, ir.BACKWARD_INPUT, ir.BACKWARD_WEIGHT}), (s, j)


def test_zbv_is_zero_bubble_with_enough_micro_batches():
    # ZB-V's claim: with F = I = W only the start-up is idle; K=4, N=8 -> 48 / 51
    assert simulate.utilization(peers.peer_schedule("zbv", 4, 8)) == pytest.approx(48 / 51)


def test_gems_sim_prints_and_writes_json(tmp_path, capsys):
    out = tmp_path / "u.json"
    assert sim.main(["utilization", "--schedule", "mast", "--stages", "4", "--micro-batches", "4",
                     "--split-backward", "--json", str(out)]) == 0
    line = capsys.readouterr().out
    assert "utilization 0.9600" in line and "in flight" in line
    data = json.loads(out.read_text())
    assert data["utilization"] == pytest.approx(0.96) and data["split_backward"] is True
    assert sim.main(["utilization", "--schedule", "zbv", "--stages", "4", "--micro-batches", "8"]) == 0
    assert "zbv K=4 M=8 split backward: utilization 0.9412" in capsys.readouterr().out


@pytest.mark.parametrize("args,fix", [
    (["--schedule", "mp", "--stages", "2", "--micro-batches", "3"], "--micro-batches 1"),
    (["--schedule", "dualpipev", "--stages", "4", "--micro-batches", "4"], "at least 2K = 8"),
    (["--schedule", "mast", "--stages", "0"], "positive integer"),
    (["--schedule", "mast", "--stages", "2", "--json", "/nonexistent/dir/x.json"], "writable"),
])
def test_gems_sim_bad_input_is_one_sentence(args, fix, capsys):
    assert sim.main(["utilization", *args]) == 2
    err = capsys.readouterr().err
    assert fix in err and err.count("\n") == 1 and "Traceback" not in err
