"""Real jobs end to end on two MPI ranks: segmentation on image/mask pairs with validation,
--keep-best, TensorBoard and JSONL metrics, then gems-predict (pipelined, the model never
gathered) against one process running the same weights, 2048-style full images and sliding
windows over an image larger than the plan's size; classification on class folders."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from conftest import REPO, cli_cases, exit_status, run_mpi
from gems.cli import data as gems_data, export

BIN = Path(sys.executable).parent
SEG = "tests/assets/tiny_model.py:tiny_segmenter"
SIZE = 32


def synth(root: Path, task: str, count: int, val: int, size: int = SIZE) -> Path:
    assert exit_status(gems_data.main, ["synth", "--task", task, "--size", size, "--count", count,
                                        "--val-count", val, "--workers", "0", root]) == 0
    return root


def exported(checkpoint_dir: Path, out: Path) -> dict:
    assert exit_status(export.main, [checkpoint_dir, out]) == 0
    return torch.load(out, weights_only=True)


def reference_model(state: dict):
    sys.path.insert(0, str(REPO / "tests" / "assets"))
    from tiny_model import tiny_segmenter  # noqa: PLC0415
    model = tiny_segmenter(3)
    model.load_state_dict(state)
    return model.eval()


def test_segmentation_trains_validates_keeps_best_and_predicts_like_one_process(tmp_path):
    data = synth(tmp_path / "data", "segmentation", 8, 4)
    ck, metrics, board = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "tb"
    run_mpi(2, BIN / "gems-train", "--task", "segmentation", "--model", SEG, "--num-classes", "3",
            "--image-size", SIZE, "--batch-size", "2", "--stages", "2", "--steps", "4", "--workers", "0",
            "--data", data / "train", "--val-data", data / "val", "--val-every", "2", "--keep-best", "miou",
            "--loss", "dice-ce", "--optimizer", "adamw", "--weight-decay", "0.01", "--lr", "0.01",
            "--checkpoint-dir", ck, "--checkpoint-every", "2", "--metrics", metrics, "--tensorboard", board,
            "--no-progress", timeout=120)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    validations = [line for line in lines if "validation" in line]
    assert [v["step"] for v in validations] == [2, 4]
    for v in validations:
        assert set(v["validation"]) >= {"loss", "miou", "dice", "pixel_accuracy", "iou_per_class"}
    assert list(board.glob("events.out.tfevents.*"))
    best = sorted((ck / "best").glob("step-*"))
    assert len(best) == 1
    # resumed from step 2's checkpoint: the same losses and validation metrics, bit for bit
    again, resumed = tmp_path / "again", tmp_path / "again.jsonl"
    shutil.copytree(ck / "step-00000002", again / "step-00000002")
    run_mpi(2, BIN / "gems-train", "--task", "segmentation", "--model", SEG, "--num-classes", "3",
            "--image-size", SIZE, "--batch-size", "2", "--stages", "2", "--steps", "4", "--workers", "0",
            "--data", data / "train", "--val-data", data / "val", "--val-every", "2",
            "--loss", "dice-ce", "--optimizer", "adamw", "--weight-decay", "0.01", "--lr", "0.01",
            "--checkpoint-dir", again, "--resume", "--metrics", resumed, "--no-progress", timeout=120)
    tail = [json.loads(line) for line in resumed.read_text().splitlines()]
    keys = ("step", "loss", "validation")
    assert [{k: v for k, v in line.items() if k in keys} for line in tail] == \
        [{k: v for k, v in line.items() if k in keys} for line in lines if line["step"] > 2]
    # one gems-predict launch, pipelined on two ranks, on a pairs folder holding the validation images
    # (the plan's size: one window each, "2048-style" full images) and an 80 x 72 tiled TIFF larger than
    # the plan's 32 x 32 (sliding windows)
    scenes = tmp_path / "scenes"
    shutil.copytree(data / "val", scenes)
    g = torch.Generator().manual_seed(0)
    pixels = (torch.rand(80, 72, 3, generator=g) * 255).to(torch.uint8).numpy()
    import tifffile  # noqa: PLC0415
    tifffile.imwrite(scenes / "images" / "scene.tif", pixels, tile=(16, 16))
    out = tmp_path / "pred"
    run_mpi(2, BIN / "gems-predict", "--checkpoint-dir", ck, "--data", scenes, "--out", out, "--stages", "2",
            "--batch-size", "2", "--overlap", "8", "--probabilities", "--probabilities-dtype", "float32",
            timeout=120)
    model = reference_model(exported(ck, tmp_path / "model.pt"))
    from gems.train import images  # noqa: PLC0415
    names = sorted(p.name for p in (data / "val" / "images").iterdir())
    assert sorted(p.name for p in out.glob("*.png")) == \
        sorted(Path(n).with_suffix(".png").name for n in [*names, "scene.tif"])
    for name in names:
        x = images.read_image(str(data / "val" / "images" / name))
        with torch.no_grad():
            probs = model(x[None]).softmax(1)[0]
        got = torch.from_numpy(np.asarray(Image.open(out / Path(name).with_suffix(".png"))).astype(np.int64))
        got_probs = torch.from_numpy(tifffile.imread(out / Path(name).with_suffix(".tif"))).permute(2, 0, 1)
        torch.testing.assert_close(got_probs, probs, rtol=0, atol=1e-5)
        top2 = probs.topk(2, 0).values
        clear = (top2[0] - top2[1]) > 1e-5
        assert torch.equal(got[clear], probs.argmax(0)[clear])
    sliding_windows_equal_one_process(scenes / "images" / "scene.tif", out / "scene.tif", model)


def sliding_windows_equal_one_process(scene: Path, predicted: Path, model) -> None:
    """gems-predict's probabilities for the 80 x 72 ``scene``, larger than the plan's 32 x 32 (windows
    overlapping by 8, blended), equal one process running the same windows with the same weights."""
    import tifffile  # noqa: PLC0415
    from gems.train import images, regions, windows  # noqa: PLC0415
    stitcher = windows.Stitcher(80, 72, 3, SIZE, 8)
    source = regions.open_image(scene)
    for top, left in windows.window_origins(80, 72, SIZE, 8):
        x = images.normalise(regions.to_unit_float(source.read(top, left, SIZE, SIZE)))
        with torch.no_grad():
            stitcher.add(top, left, model(x[None]).softmax(1)[0])
    got = torch.from_numpy(tifffile.imread(predicted)).permute(2, 0, 1)
    torch.testing.assert_close(got, stitcher.result(), rtol=0, atol=1e-5)


def test_classification_on_class_folders_validates_and_writes_a_csv(tmp_path):
    data = synth(tmp_path / "data", "classification", 8, 4)
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    result = run_mpi(2, BIN / "gems-train", "--model", "tests/assets/tiny_model.py:tiny", "--image-size", SIZE,
                     "--batch-size", "4", "--stages", "2", "--steps", "2", "--workers", "0", "--data", data / "train",
                     "--val-data", data / "val", "--val-batch-size", "2", "--label-smoothing", "0.1",
                     "--lr-schedule", "step", "--lr-milestones", "1", "--checkpoint-dir", ck, "--metrics", metrics,
                     "--no-progress", timeout=120)
    validation = [json.loads(line) for line in metrics.read_text().splitlines() if "validation" in line]
    assert len(validation) == 1 and 0 <= validation[0]["validation"]["top1"] <= 1
    # the last validation's measured peak beside the plan's forward-only estimate, per rank
    assert "validation in batches of 2, forward-only steps estimated at" in result.stdout
    lines = result.stdout.split("over the last validation (forward-only, batches of 2)")[1].splitlines()[1:3]
    assert all(re.match(r"    rank \d \(position \d\): [\d.]+ KiB measured, [\d.]+ KiB estimated", line)
               for line in lines), result.stdout
    out = tmp_path / "pred"
    run_mpi(2, BIN / "gems-predict", "--checkpoint-dir", ck, "--data", data / "val", "--out", out,
            "--stages", "2", "--batch-size", "2", timeout=120)
    rows = (out / "predictions.csv").read_text().splitlines()
    assert rows[0].startswith("image,predicted,") and len(rows) == 1 + 4


def _pairs(root: Path, masks: dict[str, tuple[int, int, int]], images: tuple[str, ...] | None = None) -> Path:
    """A pairs folder: masks {name: (height, width, value)}; images for ``images`` (default every
    mask's name), all 16 x 16 unless the mask says otherwise."""
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for name in images if images is not None else masks:
        Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(root / "images" / f"{name}.png")
    for name, (h, w, value) in masks.items():
        Image.fromarray(np.full((h, w), value, np.uint8)).save(root / "masks" / f"{name}.png")
    return root


def test_bad_segmentation_input_is_one_sentence_and_exit_2(tmp_path):
    good = _pairs(tmp_path / "good", {"a": (16, 16, 1), "b": (16, 16, 0)})
    base = ["--task", "segmentation", "--model", SEG, "--num-classes", "3", "--image-size", "16",
            "--batch-size", "2", "--stages", "1", "--schedule", "gpipe", "--steps", "1", "--workers", "0",
            "--no-progress"]
    (tmp_path / "empty" / "images").mkdir(parents=True)
    (tmp_path / "empty" / "masks").mkdir()
    cases = [
        (["--data", _pairs(tmp_path / "nomask", {"a": (16, 16, 0)}, images=("a", "b"))], "b"),
        (["--data", _pairs(tmp_path / "noimage", {"a": (16, 16, 0), "c": (16, 16, 0)}, images=("a",))], "c"),
        (["--data", _pairs(tmp_path / "size", {"a": (16, 16, 0), "b": (8, 16, 0)})], "b.png"),
        (["--data", good, "--val-data", tmp_path / "empty"], "empty"),
        (["--data", good, "--val-data", good, "--keep-best", "top1", "--checkpoint-dir", tmp_path / "ck"],
         "--keep-best top1"),
        (["--data", good, "--task", "classification", "--ignore-index", "255"], "--task segmentation"),
        (["--data", "synthetic", "--loss", "dice-ce", "--task", "classification"], "dice-ce"),
        (["--data", good, "--val-data", good, "--micro-batches", "2", "--val-batch-size", "3"],
         "--val-batch-size 3 does not split"),
    ]
    for (args, message), outcome in zip(cases, cli_cases("gems.cli.train", [[*base, *args] for args, _ in cases])):
        assert outcome["code"] == 2, (args, outcome)
        assert message in outcome["stderr"], (args, outcome)
        assert "Traceback" not in outcome["stderr"] and len(outcome["stderr"].strip().splitlines()) == 1, outcome

    # found only when the mask is decoded, mid-run: the job ends on every rank with exit 2
    args = [*base, "--data", str(_pairs(tmp_path / "range", {"a": (16, 16, 7), "b": (16, 16, 7)}))]
    result = subprocess.run([sys.executable, str(BIN / "gems-train"), *args], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "rank 0 failed: GemsError: mask " in result.stderr and "range/masks/" in result.stderr
    assert "Traceback" not in result.stderr
