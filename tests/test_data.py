"""TrainData: exact resume, shards that add up to the global batch, label-only ranks that open nothing,
bad files that are skipped instead of fatal, and a synthetic task a small CNN can learn."""
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

from gems.train.data import TrainData
from gems.errors import GemsError
from conftest import REPO, tagged

S = 16


def _save(path, size, color, fmt="PNG"):
    Image.new("RGB", size, color).save(path, fmt)


@pytest.fixture
def folder(tmp_path):
    """3 classes x 4 images of mixed sizes and formats: 12 samples."""
    root = tmp_path / "imgs"
    for c, name in enumerate(["cat", "dog", "eel"]):
        (root / name).mkdir(parents=True)
        for j in range(4):
            size = (20 + 3 * j, 17 + 5 * c)
            color = (40 * c + 10 * j, 200 - 30 * j, 17 * c * j % 256)
            if j % 2:
                _save(root / name / f"{j}.jpg", size, color, "JPEG")
            else:
                _save(root / name / f"{j}.png", size, color)
    return root


def _all(data, epoch=0, start=0):
    return list(data.batches(epoch, start))


def _same(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert (xa is None) == (xb is None) and (ya is None) == (yb is None)
        if xa is not None:
            assert torch.equal(xa, xb)
        if ya is not None:
            assert torch.equal(ya, yb)


def test_folder_batches_are_normalised_and_deterministic(folder):
    data = TrainData(str(folder), S, 4, 1, 0, workers=0)
    assert (data.num_classes, data.steps_per_epoch, data.skipped) == (3, 3, 0)
    run = _all(data)
    x, y = run[0]
    assert x.shape == (4, 3, S, S) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert x.min() < 0 < x.max()  # normalised, not raw [0, 1]
    _same(run, _all(TrainData(str(folder), S, 4, 1, 0, workers=0)))
    _same(_all(data, 0, 2), run[2:])  # resume from a step gives the rest of the epoch


def test_state_dict_resumes_mid_epoch(folder):
    data = TrainData(str(folder), S, 4, 1, 0, workers=0, seed=3)
    full = _all(data, 1)
    it = data.batches(1)
    next(it)
    state = data.state_dict()
    assert (state["epoch"], state["step"]) == (1, 1)
    fresh = TrainData(str(folder), S, 4, 1, 0, workers=0, seed=3)
    fresh.load_state_dict(state)
    _same(_all(fresh, fresh.epoch, fresh.step), full[1:])
    assert (fresh.epoch, fresh.step) == (2, 0)  # the epoch is done: next is epoch 2 from step 0
    with pytest.raises(GemsError, match="same data, batch size and seed"):
        TrainData(str(folder), S, 4, 1, 0, workers=0, seed=4).load_state_dict(state)


@pytest.mark.parametrize("source", ["folder", "synthetic"])
def test_group_shards_concatenate_to_the_global_batch(folder, source):
    src = str(folder) if source == "folder" else "synthetic"
    kw = dict(synthetic_size=12) if source == "synthetic" else {}
    whole = _all(TrainData(src, S, 4, 1, 0, workers=0, **kw))
    shards = [_all(TrainData(src, S, 4, 2, d, workers=2 * d, **kw)) for d in range(2)]  # workers 0 and 2
    for k, (x, y) in enumerate(whole):
        assert shards[0][k][0].shape[0] == 2
        assert torch.equal(torch.cat([shards[0][k][0], shards[1][k][0]]), x)
        assert torch.equal(torch.cat([shards[0][k][1], shards[1][k][1]]), y)


def test_epochs_reshuffle(folder):
    data = TrainData(str(folder), S, 12, 1, 0, workers=0)
    (x0, y0), = _all(data, 0)
    (x1, y1), = _all(data, 1)
    assert not torch.equal(x0, x1)
    assert sorted(y0.tolist()) == sorted(y1.tolist()) == [0] * 4 + [1] * 4 + [2] * 4  # each image once


def test_label_only_rank_opens_no_image(folder, monkeypatch):
    full = _all(TrainData(str(folder), S, 4, 2, 1, workers=0))

    def refuse(*args, **kw):
        raise AssertionError("a label-only rank opened an image")

    monkeypatch.setattr(Image, "open", refuse)
    labels = TrainData(str(folder), S, 4, 2, 1, workers=0, need_images=False)
    got = _all(labels)
    assert all(x is None for x, _ in got) and labels.skipped == 0
    assert all(torch.equal(y, yf) for (_, y), (_, yf) in zip(got, full))
    nothing = _all(TrainData(str(folder), S, 4, 2, 1, need_images=False, need_labels=False))
    assert nothing == [(None, None)] * 3


def test_synthetic_label_only_rank_generates_no_image():
    huge = 1 << 20  # one 3 x 2^20 x 2^20 image would need 12 TiB: only never creating it passes
    labels = _all(TrainData("synthetic", huge, 4, 2, 1, num_classes=7, synthetic_size=12, need_images=False))
    small = _all(TrainData("synthetic", S, 4, 2, 1, num_classes=7, synthetic_size=12, workers=0))
    assert all(x is None for x, _ in labels)
    assert all(torch.equal(y, ys) for (_, y), (_, ys) in zip(labels, small))
    x, y = small[0]
    assert x.shape == (2, 3, S, S) and x.dtype == torch.float32 and y.dtype == torch.int64


def test_corrupt_files_are_zeroed_warned_once_and_counted_with_workers(folder):
    (folder / "cat" / "bad.jpg").write_bytes(b"not an image at all")
    good = folder / "dog" / "0.png"
    (folder / "dog" / "cut.png").write_bytes(good.read_bytes()[:60])  # truncated inside the pixel data
    data = TrainData(str(folder), S, 7, 1, 0, workers=2)  # 14 samples: 2 steps, every sample used
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        epochs = [_all(data, e) for e in range(2)]
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 2, messages  # once per file, not once per epoch
    assert any("bad.jpg" in m for m in messages) and any("cut.png" in m for m in messages)
    assert data.skipped == 4  # 2 files x 2 epochs
    zero_rows = [(x[i], y[i]) for run in epochs for x, y in run for i in range(len(y)) if not x[i].any()]
    assert len(zero_rows) == 4
    assert sorted(int(y) for _, y in zero_rows) == [0, 0, 1, 1]  # labels kept: cat=0, dog=1


def test_decompression_bomb_is_rejected_from_the_header(folder):
    bomb = folder / "eel" / "bomb.png"
    _save(bomb, (400, 300), (1, 2, 3))
    raw = bomb.read_bytes()
    bomb.write_bytes(raw[:raw.index(b"IDAT") + 8])  # headers only: decoding it would fail differently
    data = TrainData(str(folder), S, 13, 1, 0, workers=0, max_image_pixels=50_000)
    with pytest.warns(RuntimeWarning, match=r"bomb.png: it has 400x300 = 120000 pixels"):
        _all(data)
    assert data.skipped == 1


def test_synthetic_task_is_learnable():
    torch.manual_seed(0)
    data = TrainData("synthetic", S, 32, 1, 0, num_classes=4, workers=0, synthetic_size=32 * 30)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    losses = []
    for x, y in data.batches(0):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses


@pytest.mark.parametrize("make,kw,match", [
    (lambda t: str(t / "missing"), {}, "neither 'synthetic' nor an existing folder"),
    (lambda t: "imagenet", {}, "neither 'synthetic' nor an existing folder"),
    (lambda t: str(t / "empty"), {}, "no class subfolders"),
    (lambda t: str(t / "noimages"), {}, "no class subfolders"),
    (lambda t: str(t / "file.txt"), {}, "is a file, not a folder"),
    (lambda t: str(t / "few"), {}, "fewer than one global batch"),
    (lambda t: "synthetic", {"batch_size": 6, "groups": 4}, "multiple of 4"),
    (lambda t: "synthetic", {"image_size": 0}, "image_size must be an integer >= 1"),
    (lambda t: "synthetic", {"group": 2, "groups": 2}, "pass 0 <= group < 2"),
    (lambda t: "synthetic", {"synthetic_size": 3}, "fewer than one global batch"),
    (lambda t: str(t / "few"), {"batch_size": 1, "num_classes": 5}, "1 class folders but num_classes is 5"),
])
def test_bad_input_names_the_fix(tmp_path, make, kw, match):
    (tmp_path / "empty").mkdir()
    (tmp_path / "noimages" / "a").mkdir(parents=True)
    (tmp_path / "noimages" / "a" / "notes.txt").write_text("x")
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "few" / "a").mkdir(parents=True)
    _save(tmp_path / "few" / "a" / "0.png", (8, 8), (0, 0, 0))
    args = dict(image_size=S, batch_size=4, groups=1, group=0) | kw
    with pytest.raises(GemsError, match=match):
        TrainData(make(tmp_path), args.pop("image_size"), args.pop("batch_size"), args.pop("groups"),
                  args.pop("group"), workers=0, **args)


def _png_header_only(path, width, height):
    """A valid PNG signature and header declaring width x height RGB pixels, with almost no pixel data:
    a few hundred bytes on disk, width * height * 3 bytes if decoded."""
    import struct  # noqa: PLC0415
    import zlib  # noqa: PLC0415

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(bytes(1000)))
                     + chunk(b"IEND", b""))


def test_a_decompression_bomb_in_a_folder_is_skipped_without_decoding(folder):
    import resource  # noqa: PLC0415

    _png_header_only(folder / "cat" / "bomb.png", 60_000, 60_000)  # 10.8 GB of RGB if decoded
    assert (folder / "cat" / "bomb.png").stat().st_size < 1000
    data = TrainData(str(folder), S, 13, 1, 0, workers=0)  # default limit: PIL's, about 89 million pixels
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        epochs = [_all(data, e) for e in range(2)]
    grew_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "bomb.png" in messages[0] and "3600000000 pixels" in messages[0], messages
    assert data.skipped == 2  # once per epoch: the sample stays in the batch, with zero pixels
    assert sum(int((~x.flatten(1).any(1)).sum()) for run in epochs for x, _ in run) == 2
    assert grew_kib < 1 << 20, f"peak RSS grew by {grew_kib} KiB: the bomb was decoded"


KILLED_RANK = """
import os, signal
from gems.train.data import TrainData
if __name__ == "__main__":
    data = TrainData("synthetic", 16, 4, 1, 0, num_classes=3, synthetic_size=64, workers=2)
    next(iter(data.batches(0, 0)))
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _left_behind(token: str) -> list[int]:
    """The processes of the run tagged ``token`` still alive after 30 s, killed (so none outlives the test)."""
    deadline = time.monotonic() + 30
    while (left := tagged("GEMS_TEST_RANK", token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return left


def test_workers_end_when_their_rank_is_killed(tmp_path):
    """A rank killed outright (no launcher to kill its process group) leaves no worker, fork server or
    resource tracker behind: the workers' parent is the fork server, so only their own watch of the
    rank ends them."""
    script = tmp_path / "rank.py"
    script.write_text(KILLED_RANK)
    token = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GEMS_TEST_RANK": token}
    log = tmp_path / "rank.log"  # not a pipe: processes left behind would hold it open
    with log.open("w") as out:
        done = subprocess.run([sys.executable, str(script)], env=env, stdout=out, stderr=out, timeout=120)
    assert done.returncode == -signal.SIGKILL, log.read_text()[-2000:]
    left = _left_behind(token)
    assert not left, "processes outlived their killed rank"


def test_a_stop_signal_to_every_process_stops_the_rank_cleanly(tmp_path):
    """SIGUSR1 to every process of a run, as Slurm's ``scancel --signal=USR1`` sends it (and its SIGTERM
    before a time limit): the rank saves and exits 3, its data workers, fork server and resource tracker
    neither die first nor print anything (they once did: the tracker, killed, was relaunched at the rank's
    exit and printed a ``KeyError: '/mp-...'`` traceback per semaphore), and none outlives the rank."""
    token = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GEMS_TEST_RANK": token}
    metrics, log = tmp_path / "m.jsonl", tmp_path / "rank.log"
    command = [sys.executable, str(Path(sys.executable).parent / "gems-train"), "--model",
               "tests/assets/tiny_model.py:tiny", "--image-size", "16", "--batch-size", "2", "--stages", "1",
               "--steps", "100000", "--workers", "2", "--no-progress", "--checkpoint-dir", str(tmp_path / "ck"),
               "--metrics", str(metrics)]
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=out)
        try:
            deadline = time.monotonic() + 120
            while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()[-2000:]
                time.sleep(0.1)
            for pid in tagged("GEMS_TEST_RANK", token):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGUSR1)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert code == 3 and "stopped by signal" in text, text[-2000:]
    assert "Traceback" not in text and "resource_tracker" not in text, text[-2000:]
    left = _left_behind(token)
    assert not left, "processes outlived their rank"
