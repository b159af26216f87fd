"""gems-bench: per-schedule micro-batch choice, input checks, targets and loss from the model's
output (labels or per-pixel masks), a 2-rank run on a tiny model that prints every schedule and
writes well-formed JSON and traces, one with a spatial part (tile groups of 2 ranks, K = 1), the
two in one launch, and an in-process run of a segmentation model and one with --split-backward
auto (no timing assertions)."""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from conftest import DISTRIBUTED, cli_cases, run_mpi
from gems import bench, models, partition
from gems.bench import BenchConfig, Task, micro_batches_for, synthetic_batch, task_of
from gems.comm import loopback
from gems.errors import GemsError
from gems.obs import bench_report
from gems.schedule import generators as sch

BENCH = Path(sys.executable).parent / "gems-bench"
TINY = "tests/assets/tiny_model.py:tiny"
SEGMENTER = "tests/assets/tiny_model.py:tiny_segmenter"


def test_default_micro_batches_hold_one_image():
    cfg = BenchConfig(batch_size=8)
    assert [micro_batches_for(cfg, s, 1) for s in ("mp", "gpipe", "1f1b", "mast")] == [1, 8, 8, 4]
    assert micro_batches_for(BenchConfig(batch_size=8), "mast", 2) == 2
    assert micro_batches_for(BenchConfig(batch_size=8, micro_batches=2), "gpipe", 1) == 2


@pytest.mark.parametrize("kw, world, message", [
    ({"schedules": "mp,zigzag"}, 2, "--schedules"),
    ({"stages": 3}, 2, "--stages 3"),
    ({"batch_size": 3}, 2, "does not split"),
    ({"batch_size": 2, "micro_batches": 2}, 2, "does not split"),
    ({"warmup": -1}, 2, "--warmup"),
    ({"spatial": "3"}, 2, r"--spatial 3 at --stages 1 takes groups of 3 ranks \(mp, gpipe, 1f1b, mast\), which 2 "
                          "ranks cannot form: launch a multiple of 3 ranks$"),
    ({"spatial": "2", "stages": 2}, 6, r"3 ranks \(mp, gpipe, 1f1b\) and 4 ranks \(mast\).*multiple of 12 ranks"),
    ({"spatial": "2", "batch_size": 3}, 4, "does not split into 2 group"),
    ({"spatial": "auto"}, 2, "needs the tile count"),
    ({"split_backward": "sometimes"}, 2, "split backward must be one of auto, on, off"),
])
def test_bad_input_names_the_fix(kw, world, message):
    with pytest.raises(GemsError, match=message):
        BenchConfig(**kw).validate(world)


def test_spatial_groups_count_tile_groups():
    cfg = BenchConfig(spatial="2", stages=2)
    assert [cfg.group_count(12, s) for s in ("mp", "mast")] == [4, 3]   # groups of 3 and 4 ranks
    assert BenchConfig(spatial="2").stage_count(4) == 1 and BenchConfig().stage_count(4) == 4


def command() -> list:
    """The installed console script, or the module before setup.py lists gems-bench."""
    return [BENCH] if BENCH.exists() else ["-m", "gems.cli.bench"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-rank launch, two gems-bench runs (tests/distributed/bench_runs.py): every schedule with JSON
    and traces, then a spatial plan. Per run: (what it printed, its JSON file, its trace directory)."""
    root = tmp_path_factory.mktemp("bench")
    common = ["--model", TINY, "--image-size", "32", "--batch-size", "2"]
    runs = [[*common, "--steps", "2", "--warmup", "1", "--json", root / "all.json", "--trace-dir", root / "traces"],
            [*common, "--steps", "1", "--warmup", "0", "--schedules", "mp", "--spatial", "2", "--json",
             root / "spatial.json"]]
    result = run_mpi(2, DISTRIBUTED / "bench_runs.py", json.dumps([list(map(str, r)) for r in runs]), timeout=240)
    printed = re.split(r"^=== bench_runs\.py: run \d+\n", result.stdout, flags=re.M)[1:]
    assert len(printed) == 2, result.tail()
    return [(printed[0], root / "all.json", root / "traces"), (printed[1], root / "spatial.json", None)]


def test_two_ranks_run_every_schedule_and_write_json_and_traces(two_ranks):
    table, out, traces = two_ranks[0]
    for name in ("mp", "gpipe", "1f1b", "mast", "reference", "simulator", "physical limit"):
        assert name in table, table
    report = json.loads(out.read_text())
    assert set(report) >= {"config", "world", "stages", "tiles", "threads", "network", "reference", "schedules"}
    assert report["world"] == 2 and report["threads"] == 1 and report["tiles"] == 1
    assert list(report["schedules"]) == ["mp", "gpipe", "1f1b", "mast"]
    expected_m = {"mp": 1, "gpipe": 2, "1f1b": 2, "mast": 1}
    for name, r in report["schedules"].items():
        assert r["micro_batches"] == expected_m[name]
        assert r["micro_batch_size"] == (2 if name == "mp" else 1)
        assert r["groups"] == 1 and r["spatial_grid"] == [] and r["placement"] == [[0, 0, 0], [0, 1, 0]]
        for key in ("step_time", "images_per_s", "ratio_to_mp", "efficiency", "predicted_step_time",
                    "optimizer_time", "update_time"):
            assert math.isfinite(r[key]) and r[key] > 0, (name, key, r[key])
        assert r["update_time"] < r["optimizer_time"]   # the zeroing of the gradient bucket besides
        assert r["order"] and sch.schedule(name, 2, expected_m[name], order=r["order"])   # the order that ran
        assert -1.0 < r["bubble"] < 1.0 and math.isfinite(r["simulator_error"])
        assert 0.0 <= r["unequal_busy"] <= r["bubble"]   # the part of the bubble unequal busy times force
        assert len(r["stage_forward"]) == len(r["stage_backward"]) == 2
        assert len(r["peak_memory"]) == len(r["plan_memory"]) == 2
        assert min(r["peak_memory"]) > 0 and min(r["plan_memory"]) > 0
        trace = json.loads((traces / f"{name}.json").read_text())
        assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert report["schedules"]["mp"]["ratio_to_mp"] == 1.0
    assert report["reference"]["images_per_s"] > 0
    assert report["reference"]["peak_memory"] > 0 and report["reference"]["plan_memory"] > 0
    memory_cells = re.findall(r"\d+\.\d\d [KMG]iB / \d+\.\d\d [KMG]iB \([+-]\d+\.\d%\)", table)
    assert len(memory_cells) == 4 * 2 + 1, table   # measured / estimated (error): per schedule and rank, reference


def test_two_ranks_run_a_spatial_plan_and_name_the_tile_member(two_ranks):
    table, out, _ = two_ranks[1]
    assert "--spatial 2: stage 0's first units on tile groups of 2 ranks" in table, table
    report = json.loads(out.read_text())
    assert report["stages"] == 1 and report["tiles"] == 2 and report["config"]["spatial"] == "2"
    r = report["schedules"]["mp"]
    assert r["groups"] == 1 and r["spatial_grid"] == [2, 1] and 0 < r["spatial_end"] <= 5
    assert r["placement"] == [[0, 0, 0], [0, 0, 1]]   # rank 1 is the member of rank 0's tile group
    assert len(r["stage_forward"]) == 1 and len(r["peak_memory"]) == len(r["plan_memory"]) == 2
    assert math.isfinite(r["efficiency"]) and r["efficiency"] > 0 and min(r["peak_memory"]) > 0
    assert report["ceiling"]["grid"] == [2, 1] and report["ceiling"]["images_per_s"] > 0   # each rank its tile alone
    assert r["vs_ceiling"] == pytest.approx(r["images_per_s"] / report["ceiling"]["images_per_s"])
    assert "physical limit" in table and "no-communication ceiling" in table, table
    assert re.search(rf"^mp\s+1\s+1\s+2\s+0,5\s+2x1 \[0,{r['spatial_end']}\)\s", table, re.M), table
    assert re.search(r"^\s+position 0\s+position 0, tile 1$", table, re.M), table


def test_spatial_on_too_few_ranks_is_one_sentence_and_exit_2():
    result = run_mpi(2, *command(), "--model", TINY, "--image-size", "32", "--spatial", "3", timeout=60, check=False)
    assert result.returncode == 2 and result.stdout == "", result.tail()
    assert result.stderr.strip() == ("gems-bench: error: --spatial 3 at --stages 1 takes groups of 3 ranks (mp, gpipe, "
                                     "1f1b, mast), which 2 ranks cannot form: launch a multiple of 3 ranks")


@pytest.fixture(scope="module")
def one_process():
    """gems-bench's main on each bad command line below, all in one process (conftest.cli_cases)."""
    return cli_cases("gems.cli.bench", [["--spatial", "auto"], ["--schedules", "mp,zigzag"]])


def test_spatial_auto_is_refused_in_one_sentence(one_process):
    result = one_process[0]
    assert result["code"] == 2
    assert result["stderr"].strip() == ("gems-bench: error: gems-bench needs the tile count before planning: pass "
                                        "--spatial P or RxC (gems-plan --spatial auto finds one)")


def test_bad_flag_value_is_one_line_and_exit_2(one_process):
    result = one_process[1]
    assert result["code"] == 2
    assert result["stderr"].strip().startswith("gems-bench: error: --schedules")


def test_targets_follow_the_output_shape():
    assert task_of([(10,)], "m") == Task("classification", 10, ())
    assert task_of([(3, 64, 48)], "m") == Task("segmentation", 3, (64, 48))
    images, masks = synthetic_batch(BenchConfig(image_size=8, batch_size=2), Task("segmentation", 3, (4, 4)))
    assert images.shape == (2, 3, 8, 8) and masks.shape == (2, 4, 4) and masks.dtype == torch.int64
    assert 0 <= int(masks.min()) and int(masks.max()) < 3
    for shapes in ([(3, 8, 8), (5,)], [()]):
        with pytest.raises(GemsError, match="one such output"):
            task_of(shapes, "m")


def test_segmentation_model_trains_on_masks_in_process():
    cfg = BenchConfig(model=SEGMENTER, image_size=16, batch_size=2, schedules="mast", steps=1, warmup=0,
                      num_classes=3)
    report = loopback.run(1, lambda comm: bench.run(cfg, comm))[0]
    assert report["task"] == {"name": "segmentation", "classes": 3, "target_shape": (16, 16)}
    result, ref = report["schedules"]["mast"], report["reference"]
    assert math.isfinite(result["step_time"]) and result["peak_memory"][0] > 0 and ref["peak_memory"] > 0
    assert "segmentation (3 classes, synthetic per-pixel masks, cross-entropy)" in bench_report.table(report)


def test_split_backward_auto_is_chosen_per_schedule_and_reported(one_torch_thread):
    """Each schedule's plan chooses; the stage times, the simulator and the header follow that choice."""
    cfg = BenchConfig(model=TINY, image_size=16, batch_size=2, schedules="mp,mast", steps=1, warmup=0,
                      split_backward="auto")
    models.build(TINY)   # the factory's file loaded once, here: two rank threads loading it at once race
    report = loopback.run(2, lambda comm: bench.run(cfg, comm))[0]
    chosen = {name: r["split_backward"] for name, r in report["schedules"].items()}
    planned = {name: partition.plan(models.build(TINY, num_classes=10), (3, 16, 16), 2, 2, name, 1,
                                    balance_by="time", split_backward="auto").split_backward for name in chosen}
    assert chosen == planned and any(chosen.values()), chosen
    split = ", ".join(name for name, s in chosen.items() if s)
    assert f"; backward split where the planner predicts it faster (auto): {split}" in bench_report.table(report)


def test_the_reference_runs_the_schedules_recipe(one_torch_thread):
    """--channels-last --amp bf16: the schedules and the plain loop both run NHWC under bf16 autocast,
    and the header says so."""
    cfg = BenchConfig(model=TINY, image_size=16, batch_size=2, schedules="mp", steps=1, warmup=0,
                      channels_last=True, amp="bf16")
    report = loopback.run(1, lambda comm: bench.run(cfg, comm))[0]
    assert report["recipe"] == "channels_last, bf16 autocast, eager"
    assert "recipe (schedules and reference): channels_last, bf16 autocast, eager" in bench_report.table(report)
    assert math.isfinite(report["schedules"]["mp"]["step_time"]) and report["reference"]["images_per_s"] > 0
