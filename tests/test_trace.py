"""Timeline traces: label parsing, the Chrome trace structure, ranks lined up by wall clock,
and ``gems-train --trace/--trace-png`` on two ranks holding every action of the schedule."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import run_mpi
from gems.obs import trace
from gems.schedule import generators as sch

TRAIN = Path(sys.executable).parent / "gems-train"
TINY = "tests/assets/tiny_model.py:tiny"


def test_labels_parse_into_replica_micro_stage_and_peer():
    assert trace.parse("forward d0.s1") == {"op": "forward", "replica": "down", "micro": 0, "stage": 1}
    assert trace.parse("recv_grad u3.s0 @1") == {"op": "recv_grad", "replica": "up", "micro": 3, "stage": 0,
                                                 "peer": 1}
    assert trace.parse("sync") == {"op": "sync"}
    assert [trace.kind(x) for x in ("forward d0.s0", "backward u1.s1", "recv_act d0.s1 @0", "sync", "step")] == \
        ["forward", "backward", "recv wait", "sync", "optimizer"]
    for actions in sch.schedule("mast", 2, 2):   # every label the engine can produce parses
        for a in actions:
            assert trace.parse(str(a))["op"] == a.op


def two_ranks() -> list[trace.RankTimeline]:
    r0 = trace.RankTimeline(0, 0, 0, [trace.StepTimeline(1, 100.0, [("forward d0.s0", 0.0, 1.0), ("sync", 1.0, 2.0),
                                                                    ("step", 2.0, 2.5)])])
    r1 = trace.RankTimeline(1, 0, 1, [trace.StepTimeline(1, 100.5, [("recv_act d0.s1 @0", 0.0, 0.5),
                                                                    ("forward d0.s1", 0.5, 1.5)])])
    return [r0, r1]


def test_chrome_trace_names_rows_and_lines_ranks_up_by_wall_clock():
    data = json.loads(json.dumps(trace.chrome_trace(two_ranks(), {"schedule": "mp"})))
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0 (group 0, position 0)", 1: "rank 1 (group 0, position 1)"}
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 5
    fwd1 = next(e for e in slices if e["name"] == "forward d0.s1")
    assert fwd1["pid"] == 1 and fwd1["ts"] == pytest.approx(1.0e6) and fwd1["dur"] == pytest.approx(1.0e6)
    assert fwd1["args"] == {"step": 1, "replica": "down", "micro": 0, "stage": 1}
    assert fwd1["cat"] == "forward"
    assert data["otherData"] == {"schedule": "mp"}
    # busy = forward + optimizer: (1 + 0.5) + 1; wall = 100.0 .. 102.5 -> idle 1 - 2.5 / (2 x 2.5)
    assert trace.idle_fraction(two_ranks()) == pytest.approx(0.5)


def test_png_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    trace.write_png(tmp_path / "t.png", two_ranks(), "unit test")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gems_train_writes_a_trace_with_every_action_of_the_schedule(tmp_path):
    png = tmp_path / "run.png"
    args = ["--model", TINY, "--image-size", "32", "--workers", "0", "--no-progress", "--batch-size", "4",
            "--stages", "2", "--schedule", "mast", "--micro-batches", "2", "--steps", "4",
            "--trace", tmp_path / "run.json"]
    if trace.have_matplotlib():
        args += ["--trace-png", png]
    result = run_mpi(2, TRAIN, *args, timeout=120)
    assert "timeline of the last 3 step(s) written" in result.stdout
    data = json.loads((tmp_path / "run.json").read_text())
    events = data["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0 (group 0, position 0)", 1: "rank 1 (group 0, position 1)"}
    lists = sch.schedule("mast", 2, 2)
    for rank in (0, 1):
        slices = [e for e in events if e["ph"] == "X" and e["pid"] == rank]
        assert sorted({e["args"]["step"] for e in slices}) == [2, 3, 4]
        for step in (2, 3, 4):
            got = [e["name"] for e in sorted(slices, key=lambda e: e["ts"]) if e["args"]["step"] == step]
            assert got == [str(a) for a in lists[rank]] + ["zero_grad"]   # the gradient bucket zeroed last
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    if trace.have_matplotlib():
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_png_without_matplotlib_is_a_user_error(monkeypatch):
    from gems.errors import GemsError
    from gems.train.config import TrainConfig

    monkeypatch.setattr(trace, "have_matplotlib", lambda: False)
    with pytest.raises(GemsError, match="matplotlib"):
        TrainConfig(trace_png="run.png").validate()
    TrainConfig(trace="run.json").validate()   # the JSON trace needs nothing extra


def test_a_plan_png_shows_each_positions_memory_by_kind_the_budget_and_a_simulated_step(tmp_path):
    """gems-plan --plan-png: one stack of PARTS per position summing to its estimated peak, a line at
    the budget, one timeline row per position; the PNG reads back."""
    import matplotlib.image  # noqa: PLC0415
    import matplotlib.pyplot as plt  # noqa: PLC0415

    from gems.cli import plan as gems_plan  # noqa: PLC0415
    from gems.obs import plan_picture  # noqa: PLC0415
    from gems.plan import Plan  # noqa: PLC0415

    png, plan_json = tmp_path / "plan.png", tmp_path / "plan.json"
    assert gems_plan.main(["--model", "resnet50", "--image-size", "2048", "--batch-size", "2", "--stages", "4",
                           "--schedule", "mast", "--memory-budget", "16GiB", "--plan-png", str(png),
                           "--json", str(plan_json)]) == 0
    assert matplotlib.image.imread(png).shape[:2] > (400, 600)
    plan = Plan.from_json(plan_json)
    fig = plan_picture.figure(plan)
    bars, times = fig.axes[:2]
    stacks = [c for c in bars.containers]
    assert [c.get_label() for c in stacks] == list(plan_picture.PARTS)
    assert all(len(c.patches) == 4 for c in stacks)   # four positions
    tops = [max(bar.get_y() + bar.get_height() for bar in column) for column in zip(*[c.patches for c in stacks])]
    assert tops == pytest.approx([p.peak_bytes / 2**30 for p in plan.positions])
    assert [line.get_ydata()[0] for line in bars.get_lines()] == [16.0]   # the budget, in GiB
    assert len(times.get_yticklabels()) == 4
    plt.close(fig)


def test_plan_png_without_matplotlib_is_one_sentence_before_any_work(monkeypatch, capsys, tmp_path):
    from conftest import exit_status  # noqa: PLC0415
    from gems.cli import plan as gems_plan, train as gems_train  # noqa: PLC0415

    monkeypatch.setattr(trace, "have_matplotlib", lambda: False)
    argv = ["--model", "resnet18", "--image-size", "64", "--batch-size", "2", "--stages", "2", "--schedule", "mast",
            "--plan-png", str(tmp_path / "p.png")]
    for main in (gems_plan.main, gems_train.main):
        assert exit_status(main, argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith("drawing a plan needs matplotlib: pip install 'gems[plot]' (or matplotlib), or drop "
                            "--plan-png") and err.count("\n") == 0, err
    assert not (tmp_path / "p.png").exists()
