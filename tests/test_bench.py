"""gems-bench: per-schedule micro-batch choice, input checks, targets and loss from the model's
output (labels or per-pixel masks), a 2-rank run on a tiny model that prints every schedule and
writes well-formed JSON and traces, and an in-process run of a segmentation model (no timing
assertions)."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_mpi
from gems import bench
from gems.obs import bench_report
from gems.bench import BenchConfig, Task, micro_batches_for, synthetic_batch, task_of
from gems.comm import loopback
from gems.errors import GemsError

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
])
def test_bad_input_names_the_fix(kw, world, message):
    with pytest.raises(GemsError, match=message):
        BenchConfig(**kw).validate(world)


def command() -> list:
    """The installed console script, or the module before setup.py lists gems-bench."""
    return [BENCH] if BENCH.exists() else ["-m", "gems.cli.bench"]


def test_two_ranks_run_every_schedule_and_write_json_and_traces(tmp_path):
    out = tmp_path / "bench.json"
    result = run_mpi(2, *command(), "--model", TINY, "--image-size", "32", "--batch-size", "2", "--steps", "2",
                     "--warmup", "1", "--json", out, "--trace-dir", tmp_path / "traces", timeout=120)
    table = result.stdout
    for name in ("mp", "gpipe", "1f1b", "mast", "reference", "simulator", "physical limit"):
        assert name in table, table
    report = json.loads(out.read_text())
    assert set(report) >= {"config", "world", "stages", "groups", "threads", "network", "reference", "schedules"}
    assert report["world"] == 2 and report["threads"] == 1
    assert list(report["schedules"]) == ["mp", "gpipe", "1f1b", "mast"]
    expected_m = {"mp": 1, "gpipe": 2, "1f1b": 2, "mast": 1}
    for name, r in report["schedules"].items():
        assert r["micro_batches"] == expected_m[name]
        assert r["micro_batch_size"] == (2 if name == "mp" else 1)
        for key in ("step_time", "images_per_s", "ratio_to_mp", "efficiency", "predicted_step_time",
                    "optimizer_time"):
            assert math.isfinite(r[key]) and r[key] > 0, (name, key, r[key])
        assert -1.0 < r["bubble"] < 1.0 and math.isfinite(r["simulator_error"])
        assert len(r["stage_forward"]) == len(r["stage_backward"]) == 2
        assert len(r["peak_memory"]) == len(r["plan_memory"]) == 2
        assert min(r["peak_memory"]) > 0 and min(r["plan_memory"]) > 0
        trace = json.loads((tmp_path / "traces" / f"{name}.json").read_text())
        assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert report["schedules"]["mp"]["ratio_to_mp"] == 1.0
    assert report["reference"]["images_per_s"] > 0
    assert report["reference"]["peak_memory"] > 0 and report["reference"]["plan_memory"] > 0
    memory_cells = re.findall(r"\d+\.\d\d [KMG]iB / \d+\.\d\d [KMG]iB \([+-]\d+\.\d%\)", table)
    assert len(memory_cells) == 4 * 2 + 1, table   # measured / estimated (error): per schedule and rank, reference


def test_bad_flag_value_is_one_line_and_exit_2():
    result = subprocess.run([sys.executable, "-m", "gems.cli.bench", "--schedules", "mp,zigzag"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("gems-bench: error: --schedules")


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
