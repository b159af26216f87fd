"""Sliding-window prediction pieces: window geometry and blending (gems.train.windows), lazy region
reading (gems.train.regions) and output writing (gems.train.outputs)."""
from __future__ import annotations

import csv
import os

import numpy as np
import pytest
import torch

tifffile = pytest.importorskip("tifffile")
from PIL import Image  # noqa: E402

from gems.errors import GemsError  # noqa: E402
from gems.train.outputs import (output_name, write_class_csv, write_mask_png, write_mask_png_rows,  # noqa: E402
                                write_probabilities_tiff)
from gems.train.regions import open_image, to_unit_float  # noqa: E402
from gems.train.windows import Stitcher, blend_weights, window_origins  # noqa: E402


def stitch(image: torch.Tensor, size: int, overlap: int, model, **kw) -> Stitcher:
    """What gems-predict does on one process: every window, padded to size x size, in canonical order."""
    _, height, width = image.shape
    st = Stitcher(height, width, model(image[:, :1, :1]).shape[0], size, overlap, **kw)
    for top, left in window_origins(height, width, size, overlap):
        window = image[:, top:top + size, left:left + size]
        pad = (0, size - window.shape[2], 0, size - window.shape[1])
        st.add(top, left, model(torch.nn.functional.pad(window, pad)))
    return st


# ---- windows ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("height, width, size, overlap", [
    (100, 130, 32, 8), (32, 32, 32, 0), (33, 97, 32, 31), (20, 40, 32, 8), (5, 5, 32, 0), (2048, 4100, 512, 64)])
def test_windows_cover_every_pixel_and_the_last_is_flush(height, width, size, overlap):
    origins = window_origins(height, width, size, overlap)
    covered = np.zeros((height, width), bool)
    for top, left in origins:
        covered[top:top + size, left:left + size] = True
    assert covered.all()
    tops, lefts = sorted({t for t, _ in origins}), sorted({x for _, x in origins})
    assert origins == [(t, x) for t in tops for x in lefts]  # row by row
    assert tops[-1] == max(0, height - size) and lefts[-1] == max(0, width - size)
    for starts in (tops, lefts):
        assert starts[0] == 0 and all(0 < b - a <= size - overlap for a, b in zip(starts, starts[1:]))


@pytest.mark.parametrize("overlap", [-1, 32, 40])
def test_bad_overlap_is_a_user_error_naming_the_flag(overlap):
    with pytest.raises(GemsError, match="--overlap"):
        window_origins(100, 100, 32, overlap)
    with pytest.raises(GemsError, match="--overlap"):
        Stitcher(100, 100, 1, 32, overlap)


def test_blend_weights_are_positive_and_cross_fade_to_one():
    w = blend_weights(32, 8)
    assert w.shape == (32, 32) and w.dtype == torch.float32
    assert w.min() > 0 and w.max() == 1 and torch.equal(w, w.T) and torch.equal(w, w.flip(0))
    ramp = w[16]
    assert torch.allclose(ramp[24:] + ramp[:8], torch.ones(8))  # neighbours 24 apart sum to 1
    assert torch.equal(blend_weights(16, 0), torch.ones(16, 16))


@pytest.mark.parametrize("spill", [False, True])
def test_constant_probabilities_come_back_exactly(spill):
    st = stitch(torch.zeros(1, 100, 130), 32, 8, lambda x: torch.ones(2, 32, 32), spill_bytes=0 if spill else 1 << 40)
    assert st.spilled == spill
    assert torch.equal(st.result(), torch.ones(2, 100, 130))


def test_a_per_pixel_model_is_reproduced_in_ram_and_spilled_identically(tmp_path):
    image = torch.randn(3, 100, 130, generator=torch.Generator().manual_seed(0))
    in_ram = stitch(image, 32, 8, torch.sigmoid)
    spilled = stitch(image, 32, 8, torch.sigmoid, spill_bytes=0, spill_dir=str(tmp_path))
    assert not in_ram.spilled and spilled.spilled
    assert os.listdir(tmp_path) == []  # the memmap's file is anonymous: nothing to clean up, ever
    expected = torch.sigmoid(image)
    assert (in_ram.result() - expected).abs().max() < 1e-6
    assert torch.equal(in_ram.result(), spilled.result())
    assert torch.equal(in_ram.result(), stitch(image, 32, 8, torch.sigmoid).result())  # deterministic
    bands = list(spilled.rows(40))
    assert [top for top, _ in bands] == [0, 40, 80] and bands[-1][1].shape == (3, 20, 130)
    assert torch.equal(torch.cat([b for _, b in bands], 1), in_ram.result())
    spilled.close()


def test_windows_past_a_small_image_are_cropped():
    image = torch.rand(1, 20, 40)
    st = stitch(image, 32, 8, lambda x: x * 2)
    assert window_origins(20, 40, 32, 8) == [(0, 0), (0, 8)]
    assert torch.allclose(st.result(), image * 2, atol=1e-6)


def test_a_pixel_no_window_covered_is_a_bug_not_a_nan():
    st = Stitcher(64, 64, 1, 32, 0)
    st.add(0, 0, torch.ones(1, 32, 32))
    with pytest.raises(RuntimeError, match="covered by no window"):
        st.result()


# ---- regions ---------------------------------------------------------------------------------------

def random_regions(height: int, width: int, n: int = 25, seed: int = 0):
    rng = np.random.default_rng(seed)
    yield 0, 0, height, width
    yield height - 1, width - 1, 1, 1
    for _ in range(n):
        top, left = int(rng.integers(height)), int(rng.integers(width))
        yield top, left, int(rng.integers(1, height - top + 1)), int(rng.integers(1, width - left + 1))


@pytest.mark.parametrize("options", [dict(tile=(64, 64)), dict(tile=(64, 64), compression="zlib"),
                                     dict(rowsperstrip=16, compression="zlib"), dict(),
                                     dict(tile=(32, 64), planarconfig="separate", photometric="rgb", byteorder=">")])
def test_tiff_regions_equal_numpy_slicing(tmp_path, options):
    image = np.random.default_rng(1).integers(0, 256, (200, 170, 3), dtype=np.uint8)
    stored = image.transpose(2, 0, 1).copy() if options.get("planarconfig") == "separate" else image
    tifffile.imwrite(tmp_path / "a.tif", stored, **options)
    with open_image(tmp_path / "a.tif") as src:
        assert (src.height, src.width, src.channels, src.dtype) == (200, 170, 3, np.uint8)
        for top, left, h, w in random_regions(200, 170):
            region = src.read(top, left, h, w)
            assert region.shape == (h, w, 3) and np.array_equal(region, image[top:top + h, left:left + w])


def test_16_bit_grayscale_tiff_keeps_its_depth_and_one_channel(tmp_path):
    image = np.random.default_rng(2).integers(0, 65536, (130, 90), dtype=np.uint16)
    tifffile.imwrite(tmp_path / "g.tif", image, tile=(32, 32), compression="zlib")
    src = open_image(tmp_path / "g.tif")
    region = src.read(10, 20, 50, 60)
    assert src.channels == 1 and region.dtype == np.uint16 and region.shape == (50, 60, 1)
    assert np.array_equal(region[:, :, 0], image[10:60, 20:80])
    x = to_unit_float(region)
    assert x.shape == (1, 50, 60) and x.dtype == torch.float32
    assert torch.equal(x[0], torch.from_numpy(image[10:60, 20:80].astype(np.float32)) / 65535)


def test_only_the_tiles_a_region_overlaps_are_decoded(tmp_path):
    image = np.random.default_rng(3).integers(0, 256, (512, 512, 3), dtype=np.uint8)
    tifffile.imwrite(tmp_path / "big.tif", image, tile=(64, 64), compression="zlib")
    src = open_image(tmp_path / "big.tif")
    decode, calls = src.page.decode, []
    src.page.decode = lambda data, index, **kw: calls.append(index) or decode(data, index, **kw)
    region = src.read(130, 70, 100, 100)  # rows 130..229 -> tile rows 2, 3; cols 70..169 -> tile cols 1, 2
    assert np.array_equal(region, image[130:230, 70:170])
    assert sorted(calls) == [17, 18, 25, 26] and src.decoded == 4  # of 64 tiles
    src.read(140, 80, 50, 50)  # inside the same tiles: from the cache
    assert len(calls) == 4


def test_png_and_jpeg_through_pil(tmp_path):
    image = np.random.default_rng(4).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    Image.fromarray(image).save(tmp_path / "a.png")
    src = open_image(tmp_path / "a.png")
    assert (src.height, src.width, src.channels, src.dtype) == (40, 50, 3, np.uint8)
    assert np.array_equal(src.read(5, 7, 20, 30), image[5:25, 7:37])
    assert torch.equal(to_unit_float(src.read(0, 0, 40, 50)), torch.from_numpy(image).permute(2, 0, 1) / 255.0)
    deep = np.random.default_rng(5).integers(0, 65536, (30, 20), dtype=np.uint16)
    Image.fromarray(deep).save(tmp_path / "deep.png")
    src = open_image(tmp_path / "deep.png")
    assert src.dtype == np.uint16 and np.array_equal(src.read(0, 0, 30, 20)[:, :, 0], deep)
    Image.fromarray(image).save(tmp_path / "a.jpg")
    assert open_image(tmp_path / "a.jpg").read(0, 0, 40, 50).shape == (40, 50, 3)


@pytest.mark.parametrize("content, name", [(b"II*\0broken", "x.tif"), (b"not an image", "x.png")])
def test_unreadable_files_are_one_sentence_user_errors(tmp_path, content, name):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(GemsError, match="cannot be read"):
        open_image(tmp_path / name)
    with pytest.raises(GemsError, match="not a file"):
        open_image(tmp_path / "missing.tif")


# ---- outputs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("classes, mode", [(5, "L"), (300, "I;16")])
def test_png_masks_round_trip(tmp_path, classes, mode):
    labels = np.random.default_rng(6).integers(0, classes, (70, 90))
    write_mask_png(tmp_path / "m.png", torch.from_numpy(labels), num_classes=classes)
    with Image.open(tmp_path / "m.png") as img:
        assert img.mode == mode and np.array_equal(np.asarray(img), labels)


def test_png_mask_streams_from_a_stitcher(tmp_path):
    image = torch.randn(3, 100, 130, generator=torch.Generator().manual_seed(7))
    st = stitch(image, 32, 8, lambda x: torch.softmax(x, 0), spill_bytes=0)
    write_mask_png_rows(tmp_path / "m.png", 100, 130, (p.argmax(0) for _, p in st.rows(16)), num_classes=3)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "m.png")), st.result().argmax(0).numpy())


def test_probability_tiffs_round_trip_tiled(tmp_path):
    image = torch.randn(2, 100, 130, generator=torch.Generator().manual_seed(8))
    st = stitch(image, 32, 8, torch.sigmoid)
    expected = st.result().numpy()
    write_probabilities_tiff(tmp_path / "p32.tif", st, dtype="float32", tile=64)
    write_probabilities_tiff(tmp_path / "p16.tif", expected, tile=32, compression=None)
    with tifffile.TiffFile(tmp_path / "p32.tif") as tif:
        page = tif.pages[0]
        assert page.is_tiled and (page.tilelength, page.tilewidth) == (64, 64)
        assert np.array_equal(page.asarray().transpose(2, 0, 1), expected)
    half = tifffile.imread(tmp_path / "p16.tif")
    assert half.dtype == np.float16 and np.allclose(half.transpose(2, 0, 1), expected, atol=1e-3)


def test_class_csv(tmp_path):
    write_class_csv(tmp_path / "c.csv", [("a.png", [0.1, 0.9]), ("b.png", torch.tensor([0.75, 0.25]))], ["cat", "dog"])
    with open(tmp_path / "c.csv", newline="") as f:
        assert list(csv.reader(f)) == [["image", "predicted", "cat", "dog"],
                                       ["a.png", "dog", "0.1", "0.9"], ["b.png", "cat", "0.75", "0.25"]]


def test_writes_are_atomic(tmp_path):
    write_mask_png(tmp_path / "m.png", np.zeros((8, 8), int))

    def failing_bands():
        yield np.ones((4, 8), int)
        raise KeyboardInterrupt  # interrupted half way

    with pytest.raises(KeyboardInterrupt):
        write_mask_png_rows(tmp_path / "m.png", 8, 8, failing_bands(), num_classes=2)
    assert os.listdir(tmp_path) == ["m.png"]  # no temporary file left, the old mask intact
    assert not np.asarray(Image.open(tmp_path / "m.png")).any()
    one_class = np.random.default_rng(9).random((1, 8, 20), np.float32)
    write_probabilities_tiff(tmp_path / "sub" / "p.tif", one_class, dtype="float32", tile=16)
    assert np.array_equal(tifffile.imread(tmp_path / "sub" / "p.tif"), one_class[0])  # one class: [H, W]
    write_class_csv(tmp_path / "c.csv", [], ["x"])
    assert sorted(os.listdir(tmp_path)) == ["c.csv", "m.png", "sub"] and os.listdir(tmp_path / "sub") == ["p.tif"]


def test_output_names_mirror_the_input():
    assert output_name("images/sub/a.tif", "images", ".png") == output_name("images/sub/a.tiff", "images/", ".png")
    assert str(output_name("images/sub/a.tif", "images", ".png")) == os.path.join("sub", "a.png")
    assert str(output_name("/data/a.ome.tif", None, "_probs.tif")) == "a_probs.tif"
    assert str(output_name("elsewhere/b.jpg", "images", ".png")) == "b.png"
    assert str(output_name("c.png", "c.png", ".png")) == "c.png"  # a single file as input
