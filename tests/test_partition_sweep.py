"""gems-plan --sweep with tile groups (gems.partition.sweep): a budget that no layout without tiles
meets gets a spatial layout, its launch size and flags, and a --json plan that gems-train runs as one
process would; a sweep that can try nothing says why in one sentence. The ranks a layout takes
(D x ranks per group) are checked without a model in tests/test_simulate.py."""
from __future__ import annotations

import json
import shlex
import threading
from types import SimpleNamespace

import pytest

from conftest import exit_status
from gems.cli.plan import main as gems_plan
from gems.plan import Plan
from gems.schedule.topology import Topology

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

UNET = ["--model", "unet", "--model-arg", "width=4", "--model-arg", "depth=3", "--model-arg", "groups=2",
        "--num-classes", "3", "--image-size", "96", "--batch-size", "2"]
# On 4 ranks, every layout without tiles needs 2.65 MiB or more (1f1b, K = 4, m = 2); with tile groups of
# 2, mp K = 1 (the whole U-Net on tiles, 2 groups of 2 ranks) needs 2.51 MiB and is the fastest that fits.
BUDGET = "2700000"


def train_on_loopback_ranks(argv: list[str], ranks: int, metrics, monkeypatch) -> list[float]:
    """gems-train's loop (trainer.prepare, trainer.run) on ``ranks`` loopback ranks, threads of this
    process, for 3 steps: the losses it wrote to ``metrics``. ``prepare`` runs one rank at a time, and
    each rank's units are traced and flattened there too: fx patches nn.Module process-wide while it
    traces, which another rank's forward must not meet (the engine would trace them itself)."""
    from gems.cli.train import parse  # noqa: PLC0415
    from gems.comm import loopback  # noqa: PLC0415
    from gems.graph import graph_units  # noqa: PLC0415
    from gems.spatial import flatten  # noqa: PLC0415
    from gems.train import trainer  # noqa: PLC0415

    monkeypatch.setattr(trainer, "_Signals", lambda: SimpleNamespace(caught=0))   # handlers: main thread only
    cfg = parse([*argv, "--task", "segmentation", "--workers", "0", "--steps", "3", "--no-progress",
                 "--metrics", str(metrics)])
    one_at_a_time = threading.Lock()

    def rank(comm) -> int:
        with one_at_a_time:
            job = trainer.prepare(cfg, comm)
            plan = job.plan
            job.model = graph_units(job.model, plan.input_shape, plan.micro_batch_size, plan.leaf_modules)
            for unit in job.model:
                flatten(unit)
        return trainer.run(job)
    assert loopback.run(ranks, rank, timeout=60) == [0] * ranks
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def test_a_sweep_that_needs_tiles_recommends_a_plan_gems_train_runs_as_one_process(tmp_path, capsys, monkeypatch):
    path = tmp_path / "plan.json"
    assert exit_status(gems_plan, [*UNET, "--sweep", "4", "--memory-budget", BUDGET, "--device", "cpu",
                                   "--json", path]) == 0
    out = capsys.readouterr().out
    print(out)
    lines = out.splitlines()
    plan = Plan.from_json(path)
    grid = "x".join(map(str, plan.spatial_grid))
    assert plan.tiles == 2 and plan.fits
    # the table: P and the ranks used out of 4; layouts without tiles all over the budget
    rows = [line.split() for line in lines[3:] if line.split()[0] in ("mp", "gpipe", "1f1b", "mast")]
    assert rows[0][3] == "2" and rows[0][5] == "4/4"
    assert all(row[3] != "1" for row in rows) and "over the budget" in lines[1]
    # the recommendation: gems-plan's flags for this very plan, and the launch
    recommended = next(line for line in lines if line.startswith("recommended: "))
    assert recommended == (f"recommended: --stages {plan.stages} --schedule {plan.schedule} --micro-batches "
                           f"{plan.micro_batches} --groups {plan.groups} --spatial {grid} --spatial-end "
                           f"{plan.spatial_end} --spatial-start {plan.spatial_start} on 4 of 4 ranks "
                           f"({plan.groups} data-parallel group(s) of {4 // plan.groups} ranks)")
    assert lines[-1] == f"plan written to {path}"
    launch = shlex.split(next(line for line in lines if line.startswith("launch: ")).removeprefix("launch: "))
    assert launch[:3] == ["mpiexec", "-n", "4"] and launch[3] == "gems-train"
    assert launch[-2:] == ["--plan", str(path)] and f"--spatial {grid}" in shlex.join(launch)
    ranks = int(launch[2])
    assert Topology.of(plan, ranks).size * plan.groups == ranks <= 4   # D x ranks per group
    # the printed command, on 4 loopback ranks, trains as one process does (3 steps, GroupNorm)
    losses = train_on_loopback_ranks(launch[4:], ranks, tmp_path / "tiled.jsonl", monkeypatch)
    alone = train_on_loopback_ranks([*UNET, "--stages", "1", "--schedule", "mp"], 1, tmp_path / "one.jsonl",
                                    monkeypatch)
    assert len(losses) == 3 and losses == pytest.approx(alone, rel=1e-5)


@pytest.mark.parametrize("extra, message", [
    (["--sweep", "2", "--spatial", "4"], "2 ranks are too few for any layout: a group with tile groups of 4 ranks "
                                         "needs at least 4; give --sweep 4 or more, or fewer tiles with --spatial"),
    (["--sweep", "2", "--spatial", "1", "--memory-budget", "1KiB"], "no layout on 2 ranks could be planned: no "
                                                                     "number of stages fits resnet18"),
])
def test_a_sweep_that_tries_nothing_says_why_in_one_sentence(capsys, extra, message):
    argv = ["--model", "resnet18", "--num-classes", "10", "--image-size", "64", "--batch-size", "2"]
    for i in range(0, len(extra), 2):   # replace a flag's value, or add the flag
        if extra[i] in argv:
            argv[argv.index(extra[i]) + 1] = extra[i + 1]
        else:
            argv += extra[i:i + 2]
    assert exit_status(gems_plan, argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.count("\n") == 1 and captured.err.startswith(f"gems-plan: error: {message}")
