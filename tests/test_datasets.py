"""The data layer beyond the synthetic default: segmentation pairs and their mistakes, CSV sources, 8- and
16-bit decoding, augmentation that keeps a mask on its image, evaluation padding, prediction reads that
match training, worker-count independence, exact resume, and ``gems-data synth``."""
import re
import struct
import warnings
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from gems.cli.data import main as gems_data
from gems.errors import GemsError
from gems.train.data import EvalData, PredictImages, TrainData, read_image
from gems.train.images import decode, read_mask
from gems.train.targets import IGNORE

S = 24


def _pairs(root, masks, images=None, mask_ext="png"):
    """root/images/sJ.png and root/masks/sJ.<ext>; image J is gray, 60 where mask J is 0 and 200 elsewhere."""
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for j, mask in enumerate(masks):
        mask = np.asarray(mask, dtype=np.uint8)
        image = images[j] if images is not None else np.where(mask > 0, 200, 60).astype(np.uint8)
        Image.fromarray(image).save(root / "images" / f"s{j}.png")
        if mask_ext == "png":
            Image.fromarray(mask, "L").save(root / "masks" / f"s{j}.png")
        else:
            import tifffile  # noqa: PLC0415
            tifffile.imwrite(root / "masks" / f"s{j}.{mask_ext}", mask)
    return root


def _blocks(rng, h, w, classes=2, block=3):
    """A random label map of block x block squares: every S x S window holds every class."""
    small = rng.integers(0, classes, (h // block + 1, w // block + 1))
    return np.kron(small, np.ones((block, block), dtype=np.int64))[:h, :w].astype(np.uint8)


def _all(data, epoch=0, start=0):
    return list(data.batches(epoch, start))


def _same(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_pairs_give_their_masks_in_listing_order_and_centred_views(tmp_path):
    rng = np.random.default_rng(0)
    masks = [rng.integers(0, 3, (S, S)) for _ in range(3)]
    root = _pairs(tmp_path / "same", masks)
    x, y = next(EvalData(str(root), S, 3, 1, 0, task="segmentation", num_classes=3, workers=0).batches())
    assert x.shape == (3, 3, S, S) and y.dtype == torch.int64
    assert torch.equal(y, torch.tensor(np.stack(masks), dtype=torch.int64))
    train = TrainData(str(root), S, 3, 1, 0, task="segmentation", num_classes=3, augment=False, workers=0)
    (_, yt), = _all(train)   # same size as S: the window is the whole image, in a shuffled order
    assert sorted(m.tobytes() for m in yt.numpy()) == sorted(m.astype(np.int64).tobytes() for m in masks)

    big, small = rng.integers(0, 3, (30, 28)), rng.integers(0, 3, (20, 22))
    root = _pairs(tmp_path / "sizes", [big, small], images=[np.full((30, 28), 90, np.uint8),
                                                           np.full((20, 22), 90, np.uint8)])
    x, y = next(EvalData(str(root), S, 2, 1, 0, task="segmentation", num_classes=3, workers=0).batches())
    assert torch.equal(y[0], torch.tensor(big[3:27, 2:26]))          # centre crop
    assert torch.equal(y[1, 2:22, 1:23], torch.tensor(small))        # centred in padding ...
    pad = torch.ones(S, S, dtype=torch.bool)
    pad[2:22, 1:23] = False
    assert (y[1][pad] == IGNORE).all() and (x[1][:, pad] == 0).all()  # ... of IGNORE and zero pixels
    assert (x[1][:, ~pad] != 0).all()


def test_ignore_index_and_binary_masks(tmp_path):
    mask = np.array([[0, 255, 128], [255, 0, 128], [0, 0, 255]], np.uint8).repeat(8, 0).repeat(8, 1)
    root = _pairs(tmp_path / "bin", [mask])
    _, y = next(EvalData(str(root), S, 1, 1, 0, task="segmentation", binary_masks=True, ignore_index=128,
                         workers=0).batches())
    expected = np.where(mask == 128, IGNORE, (mask > 0).astype(np.int64))
    assert torch.equal(y[0], torch.tensor(expected))
    single = EvalData(str(root), S, 1, 1, 0, task="segmentation", binary_masks=True, num_classes=1, workers=0)
    assert torch.equal(next(single.batches())[1][0], torch.tensor(np.where(mask > 0, 1, 0)))  # one-logit head
    with pytest.raises(GemsError, match="binary masks have 2 classes"):
        EvalData(str(root), S, 1, 1, 0, task="segmentation", binary_masks=True, num_classes=10)

    mask = np.array([[0, 1, 2], [7, 7, 1], [2, 0, 7]], np.uint8).repeat(8, 0).repeat(8, 1)
    root = _pairs(tmp_path / "multi", [mask], mask_ext="tif")
    data = EvalData(str(root), S, 1, 1, 0, task="segmentation", num_classes=3, ignore_index=7, workers=0)
    assert data.num_classes == 3
    _, y = next(data.batches())
    assert torch.equal(y[0], torch.tensor(np.where(mask == 7, IGNORE, mask.astype(np.int64))))


def test_a_label_out_of_range_names_the_mask_and_the_value(tmp_path):
    masks = [np.zeros((S, S), np.uint8), np.full((S, S), 1, np.uint8)]
    masks[1][5, 5] = 5
    root = _pairs(tmp_path / "d", masks)
    data = TrainData(str(root), S, 2, 1, 0, task="segmentation", num_classes=3, workers=0)
    with pytest.raises(GemsError, match=r"masks/s1\.png has the value 5, which is not a class index below "
                                        r"num_classes=3"):
        _all(data)
    ok = TrainData(str(root), S, 2, 1, 0, task="segmentation", num_classes=6, workers=0)
    assert len(_all(ok)) == 1
    colour = np.zeros((S, S, 3), np.uint8)
    colour[..., 0] = 1
    Image.fromarray(colour).save(root / "masks" / "s0.png")   # a colour-coded mask is not a label map
    with pytest.raises(GemsError, match=r"masks/s0\.png has 3 channels that differ: save each mask with one"):
        _all(TrainData(str(root), S, 2, 1, 0, task="segmentation", num_classes=6, workers=0))


@pytest.mark.parametrize("mistake,match", [
    ("image_without_mask", r"image .*images/s9\.jpg has no mask"),
    ("mask_without_image", r"mask .*masks/s9\.png has no image"),
    ("size_mismatch", r"mask .*masks/s1\.png is 20x24 pixels but its image .*images/s1\.png is 24x24"),
    ("empty", r"has no image/mask pairs"),
    ("classification_task", r"holds images/ and masks/ .* pass task segmentation"),
    ("no_num_classes", r"need num_classes"),
    ("class_folders", r"has no images/ and masks/ subfolders"),
])
def test_bad_pairs_folders_name_the_file_and_the_fix(tmp_path, mistake, match):
    root = tmp_path / "d"
    masks = [np.zeros((S, S), np.uint8)] * 2 if mistake != "empty" else []
    _pairs(root, masks)
    kw = dict(task="segmentation", num_classes=2)
    if mistake == "image_without_mask":
        Image.new("RGB", (S, S)).save(root / "images" / "s9.jpg")
    elif mistake == "mask_without_image":
        Image.new("L", (S, S)).save(root / "masks" / "s9.png")
    elif mistake == "size_mismatch":
        Image.new("L", (20, S)).save(root / "masks" / "s1.png")
    elif mistake == "classification_task":
        kw = {}
    elif mistake == "no_num_classes":
        kw = dict(task="segmentation")
    elif mistake == "class_folders":
        root = tmp_path / "classes"
        (root / "a").mkdir(parents=True)
        Image.new("RGB", (S, S)).save(root / "a" / "0.png")
    with pytest.raises(GemsError, match=match):
        TrainData(str(root), S, 1, 1, 0, workers=0, **kw)


def test_csv_sources_by_number_and_by_name(tmp_path):
    (tmp_path / "img").mkdir()
    for j in range(5):
        Image.new("RGB", (S + j, S), (40 * j, 10, 200)).save(tmp_path / "img" / f"{j}.png")
    (tmp_path / "num.csv").write_text("path,label\n" + "".join(f"img/{j}.png,{j}\n" for j in range(4))
                                      + "img/4.png,9\n")
    data = EvalData(str(tmp_path / "num.csv"), S, 5, 1, 0, ignore_index=9, workers=0)
    assert data.num_classes == 4
    x, y = next(data.batches())
    assert y.tolist() == [0, 1, 2, 3, IGNORE] and x.shape == (5, 3, S, S)
    (tmp_path / "names.csv").write_text("img/0.png,zebra\nimg/1.png,ant\nimg/2.png,zebra\n")
    named = TrainData(str(tmp_path / "names.csv"), S, 3, 1, 0, workers=0, need_images=False)
    assert (named.num_classes, named.classes) == (2, ["ant", "zebra"])
    assert sorted(_all(named)[0][1].tolist()) == [0, 1, 1]
    (tmp_path / "bad.csv").write_text("img/0.png,0\nimg/1.png,7\n")
    with pytest.raises(GemsError, match=r"bad\.csv line 2: label 7 is not a class index below num_classes=3"):
        TrainData(str(tmp_path / "bad.csv"), S, 1, 1, 0, num_classes=3)
    (tmp_path / "gone.csv").write_text("img/0.png,0\nimg/nope.png,1\n")
    with pytest.raises(GemsError, match=r"gone\.csv line 2: image .*nope\.png does not exist"):
        TrainData(str(tmp_path / "gone.csv"), S, 1, 1, 0)
    with pytest.raises(GemsError, match=r"CSV of image labels, a classification source"):
        TrainData(str(tmp_path / "num.csv"), S, 1, 1, 0, task="segmentation", num_classes=2)


def _png16(path, array):
    """A 16-bit PNG written by hand (PIL writes 16-bit gray only)."""
    h, w = array.shape[:2]
    kind = {2: 0, 3: 2}[array.ndim]
    raw = b"".join(b"\x00" + array[y].astype(">u2").tobytes() for y in range(h))

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, kind, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def test_8_and_16_bit_png_and_tiff_decode_to_the_same_scale(tmp_path):
    import tifffile  # noqa: PLC0415

    rng = np.random.default_rng(1)
    rgb16 = rng.integers(0, 65536, (20, 30, 3)).astype(np.uint16)
    expected = torch.tensor(rgb16.astype(np.float32) / 65535).permute(2, 0, 1)
    tifffile.imwrite(tmp_path / "a.tif", rgb16)
    _png16(tmp_path / "a.png", rgb16)
    for name in ("a.tif", "a.png"):
        assert torch.allclose(decode(str(tmp_path / name)), expected, atol=1e-6), name
    gray16 = rgb16[..., 0]
    Image.fromarray(gray16).save(tmp_path / "g16.png")
    tifffile.imwrite(tmp_path / "g16.tiff", gray16)
    for name in ("g16.png", "g16.tiff"):
        x = decode(str(tmp_path / name))    # grayscale replicated to 3 channels
        assert x.shape == (3, 20, 30) and torch.allclose(x, expected[:1].expand(3, -1, -1), atol=1e-6), name
    Image.fromarray((gray16 >> 8).astype(np.uint8)).save(tmp_path / "g8.png")
    assert torch.allclose(decode(str(tmp_path / "g8.png"), channels=1), expected[:1], atol=1 / 255)
    palette = Image.fromarray(np.array([[0, 1], [2, 1]], np.uint8), "P")
    palette.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0])
    palette.save(tmp_path / "p.png")
    assert read_mask(str(tmp_path / "p.png")).tolist() == [[0, 1], [2, 1]]  # palette indices are labels


def test_augmentation_moves_the_mask_with_its_image(tmp_path):
    rng = np.random.default_rng(2)
    shapes = [(40, 32), (30, 50), (18, 30), (26, 20), (S, S), (35, 35)]   # crops and paddings
    root = _pairs(tmp_path / "d", [_blocks(rng, h, w) for h, w in shapes])
    data = TrainData(str(root), S, 6, 1, 0, task="segmentation", num_classes=2, workers=0)
    plain = TrainData(str(root), S, 6, 1, 0, task="segmentation", num_classes=2, workers=0, augment=False)
    differs = 0
    for epoch in range(4):
        (x, y), = _all(data, epoch)
        for image, mask in zip(x, y):
            pad = mask == IGNORE
            assert (image[:, pad] == 0).all()
            content = image[0][~pad]
            levels = content.unique()
            assert len(levels) == 2   # jitter changes the two gray levels, never their order
            assert torch.equal(content > levels.mean(), mask[~pad] == 1)
        differs += not torch.equal(y, _all(plain, epoch)[0][1])
    assert differs >= 3   # flips and turns happened


def test_the_same_batches_with_and_without_workers(tmp_path):
    rng = np.random.default_rng(3)
    root = _pairs(tmp_path / "d", [_blocks(rng, 30 + j, 40 - j, classes=3) for j in range(8)])
    kw = dict(task="segmentation", num_classes=3, seed=5)
    inline = TrainData(str(root), S, 4, 2, 1, workers=0, **kw)
    workers = TrainData(str(root), S, 4, 2, 1, workers=2, **kw)
    for epoch in range(2):    # the second epoch reuses the persistent workers
        _same(_all(inline, epoch), _all(workers, epoch))
    evaluate = [EvalData(str(root), S, 4, 2, 1, workers=w, **kw) for w in (0, 2)]
    _same(*[list(e.batches()) for e in evaluate])
    bad = _pairs(tmp_path / "bad", [np.full((S, S), 9, np.uint8)] * 2)  # found in a worker, raised here
    with pytest.raises(GemsError, match=r"masks/s\d\.png has the value 9"):
        _all(TrainData(str(bad), S, 2, 1, 0, workers=2, **kw))


def test_segmentation_resumes_mid_epoch_exactly_and_leaves_the_global_rng_alone(tmp_path):
    rng = np.random.default_rng(4)
    root = _pairs(tmp_path / "d", [_blocks(rng, 30, 36, classes=3) for _ in range(6)])
    kw = dict(task="segmentation", num_classes=3, seed=7, workers=0)
    data = TrainData(str(root), S, 2, 1, 0, **kw)
    state = torch.random.get_rng_state()
    full = _all(data, 1)
    assert torch.equal(torch.random.get_rng_state(), state)
    it = data.batches(1)
    next(it)
    fresh = TrainData(str(root), S, 2, 1, 0, **kw)
    fresh.load_state_dict(data.state_dict())
    assert (fresh.epoch, fresh.step) == (1, 1)
    _same(_all(fresh, fresh.epoch, fresh.step), full[1:])
    labels = TrainData(str(root), S, 2, 1, 0, need_images=False, **kw)   # a mask-only rank
    assert all(x is None and torch.equal(y, yf) for (x, y), (_, yf) in zip(_all(labels, 1), full))


def test_eval_reads_each_sample_once_and_pads_the_last_batch(tmp_path):
    (tmp_path / "img").mkdir()
    for j in range(5):
        Image.new("RGB", (S, S), (50 * j, 100, 30)).save(tmp_path / "img" / f"{j}.png")
    (tmp_path / "l.csv").write_text("".join(f"img/{j}.png,{j}\n" for j in range(5)))
    groups = [EvalData(str(tmp_path / "l.csv"), S, 4, 2, d, workers=0) for d in range(2)]
    assert [(g.steps, g.num_samples) for g in groups] == [(2, 5), (2, 5)]
    shards = [list(g.batches()) for g in groups]
    ys = [torch.cat([shards[0][k][1], shards[1][k][1]]).tolist() for k in range(2)]
    assert ys == [[0, 1, 2, 3], [4, IGNORE, IGNORE, IGNORE]]
    last = torch.cat([shards[0][1][0], shards[1][1][0]])
    assert last[0].any() and not last[1:].any()   # padding rows are zero images
    labels = EvalData(str(tmp_path / "l.csv"), S, 4, 2, 1, workers=0, need_images=False)
    assert [y.tolist() for _, y in labels.batches()] == [[2, 3], [IGNORE, IGNORE]]

    root = _pairs(tmp_path / "pairs", [np.ones((S, S), np.uint8)] * 3)
    last = list(EvalData(str(root), S, 2, 2, 1, task="segmentation", num_classes=2, workers=0).batches())[-1]
    assert last[0].shape == (1, 3, S, S) and not last[0].any() and (last[1] == IGNORE).all()


def test_prediction_reads_what_training_saw(tmp_path):
    rng = np.random.default_rng(5)
    image = rng.integers(0, 256, (S, S, 3)).astype(np.uint8)
    root = _pairs(tmp_path / "d", [np.zeros((S, S), np.uint8)] * 2, images=[image, image[::-1].copy()])
    paths = PredictImages(str(root))
    assert [p.rsplit("/", 2)[-2:] for p in paths] == [["images", "s0.png"], ["images", "s1.png"]]
    x, _ = next(EvalData(str(root), S, 2, 1, 0, task="segmentation", num_classes=2, workers=0).batches())
    assert torch.equal(read_image(paths[0]), x[0]) and torch.equal(read_image(paths[1]), x[1])
    assert PredictImages(str(root / "images")) == paths and paths.root == str(root / "images")
    (tmp_path / "none").mkdir()
    with pytest.raises(GemsError, match="holds no images"):
        PredictImages(str(tmp_path / "none"))


def test_a_corrupt_image_in_a_pair_is_zeroed_ignored_warned_once_and_counted(tmp_path):
    root = _pairs(tmp_path / "d", [np.ones((S, S), np.uint8)] * 3)
    (root / "images" / "s1.png").write_bytes(b"not a png")
    data = TrainData(str(root), S, 3, 1, 0, task="segmentation", num_classes=2, workers=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = [_all(data, e)[0] for e in range(2)]
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "s1.png" in messages[0], messages
    assert data.skipped == 2
    for x, y in runs:
        bad = [i for i in range(3) if not x[i].any()]
        assert len(bad) == 1 and (y[bad[0]] == IGNORE).all()


def test_synthetic_segmentation_needs_no_files(tmp_path):
    kw = dict(task="segmentation", synthetic_size=8, workers=0)
    data = TrainData("synthetic", 32, 4, 1, 0, **kw)
    assert data.num_classes == 3
    (x, y), _ = _all(data)
    assert x.shape == (4, 3, 32, 32) and y.shape == (4, 32, 32) and 0 <= y.min() and y.max() < 3
    assert (y > 0).any() and (y == 0).any()
    masks = TrainData("synthetic", 32, 4, 1, 0, need_images=False, **kw)
    assert all(xm is None and torch.equal(ym, yf) for (xm, ym), (_, yf) in zip(_all(masks), _all(data)))
    x2, y2 = next(EvalData("synthetic", 32, 4, 1, 0, task="segmentation", synthetic_size=8,
                           workers=0).batches())
    assert not torch.equal(y2, y)   # the evaluation set is not a training epoch


def test_gems_data_synth_writes_a_deterministic_layout(tmp_path, capsys):
    for argv in (["synth", "--size", "32", "--count", "3", "--val-count", "2", str(tmp_path / "seg")],
                 ["synth", "--size", "32", "--count", "3", "--val-count", "2", str(tmp_path / "again")],
                 ["synth", "--task", "classification", "--size", "32", "--count", "4", "--classes", "2",
                  str(tmp_path / "cls")]):
        with pytest.raises(SystemExit) as done:
            gems_data(argv)
        assert done.value.code == 0
    out = capsys.readouterr().out
    assert "wrote 3 training and 2 validation 32x32 segmentation samples" in out and "background, disc" in out
    seg = tmp_path / "seg"
    assert sorted(p.name for p in (seg / "train" / "images").iterdir()) == ["000000.png", "000001.png",
                                                                            "000002.png"]
    assert len(list((seg / "val" / "masks").iterdir())) == 2
    assert all((seg / "train" / "images" / n).read_bytes() == (tmp_path / "again" / "train" / "images" / n)
               .read_bytes() for n in ("000000.png", "000002.png"))   # a pure function of the seed
    mask = np.array(Image.open(seg / "train" / "masks" / "000000.png"))
    assert mask.shape == (32, 32) and set(np.unique(mask)) <= {0, 1, 2} and mask.any()
    data = TrainData(str(seg / "train"), 32, 3, 1, 0, task="segmentation", num_classes=3, workers=0)
    assert len(_all(data)) == 1
    assert sorted(p.name for p in (tmp_path / "cls" / "train").iterdir()) == ["0_disc", "1_square"]
    assert TrainData(str(tmp_path / "cls" / "train"), 32, 4, 1, 0, workers=0).num_classes == 2


@pytest.mark.parametrize("argv,match", [
    (["--count", "2"], "is not empty"),
    (["--count", "2", "--size", "8"], r"--size\) 8 is outside"),
    (["--count", "0"], "--count 0 is below 1"),
    (["--count", "2", "--classes", "9"], "2 to 7 classes, not 9"),
    (["--size", "32"], "the following arguments are required: --count"),
])
def test_gems_data_synth_refuses_bad_input_with_exit_2(tmp_path, capsys, argv, match):
    (tmp_path / "d" / "train").mkdir(parents=True)
    (tmp_path / "d" / "train" / "keep.txt").write_text("x")
    with pytest.raises(SystemExit) as done:
        gems_data(["synth", "--size", "32", *argv, str(tmp_path / "d")])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("gems-data") and len(err.strip().splitlines()) == 1
    assert re.search(match, err), err
