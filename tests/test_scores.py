"""gems.train.scores: metrics from summed counts equal a direct computation on the whole set,
states add over ranks, IGNORE is skipped, and bad input raises a GemsError naming the fix."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gems.errors import GemsError
from gems.train.losses import make_loss
from gems.train.scores import METRICS, higher_is_better, make_scores
from gems.train.targets import IGNORE

C = 4   # class 3 occurs in neither truth nor prediction


def segmentation_set(seed: int = 0):
    """Logits [6, C, 8, 8] that never predict class 3, targets that never hold it, about a
    fifth of the pixels IGNORE and row 5 all IGNORE (a padding row)."""
    g = torch.Generator().manual_seed(seed)
    output = torch.randn(6, C, 8, 8, generator=g, dtype=torch.float64)
    output[:, 3] = -100.0
    target = torch.randint(3, (6, 8, 8), generator=g)
    target[torch.rand(6, 8, 8, generator=g) < 0.2] = IGNORE
    target[5] = IGNORE
    return output, target


def direct_metrics(output, target):
    pred, valid = output.argmax(1), target != IGNORE
    iou, dice = [], []
    for c in range(C):
        tp = ((pred == c) & (target == c) & valid).sum().item()
        fp = ((pred == c) & (target != c) & valid).sum().item()
        fn = ((pred != c) & (target == c) & valid).sum().item()
        iou.append(tp / (tp + fp + fn) if tp + fp + fn else math.nan)
        dice.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else math.nan)
    present = [x for x in iou if not math.isnan(x)]
    return {"miou": sum(present) / len(present), "iou_per_class": iou,
            "dice": sum(x for x in dice if not math.isnan(x)) / len(present),
            "pixel_accuracy": ((pred == target) & valid).sum().item() / valid.sum().item()}


def assert_same(got: dict, want: dict) -> None:
    for key, value in want.items():
        a, b = got[key], value
        if isinstance(b, list):
            assert len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, abs=1e-12)
                                            for x, y in zip(a, b)), (key, a, b)
        else:
            assert a == pytest.approx(b, abs=1e-12), (key, a, b)


def feed(scores, output, target, bounds=((0, 2), (2, 3), (3, 6))):
    for a, b in bounds:
        scores.update(output[a:b], target[a:b])
    return scores


def test_segmentation_metrics_equal_a_direct_computation():
    output, target = segmentation_set()
    got = feed(make_scores("segmentation", C, None), output, target).compute()
    assert set(got) == {"miou", "iou_per_class", "dice", "pixel_accuracy"}
    assert math.isnan(got["iou_per_class"][3])                  # absent class: NaN, left out of the means
    assert_same(got, direct_metrics(output, target))


def test_segmentation_agrees_with_torchmetrics():
    tm = pytest.importorskip("torchmetrics.classification")
    output, target = segmentation_set(1)
    scores = feed(make_scores("segmentation", C, None), output, target)
    confusion = tm.MulticlassConfusionMatrix(C, ignore_index=IGNORE)(output.argmax(1), target)
    assert torch.equal(scores.state.view(C, C), confusion.double())
    iou = tm.MulticlassJaccardIndex(C, average=None, ignore_index=IGNORE)(output.argmax(1), target)
    got = scores.compute()
    assert got["iou_per_class"][:3] == pytest.approx(iou[:3].tolist())
    accuracy = tm.MulticlassAccuracy(C, average="micro", ignore_index=IGNORE)(output.argmax(1), target)
    assert got["pixel_accuracy"] == pytest.approx(accuracy.item())


@pytest.mark.parametrize("task", ["segmentation", "classification"])
def test_states_add_over_ranks(task):
    if task == "segmentation":
        output, target = segmentation_set(2)
        loss = make_loss(task, "dice-ce", C, class_weights=[1.0, 2.0, 0.5, 1.0])
    else:
        g = torch.Generator().manual_seed(2)
        output, target = torch.randn(9, 7, generator=g, dtype=torch.float64), torch.randint(7, (9,), generator=g)
        target[4] = IGNORE
        loss = make_loss(task, "cross-entropy", 7, label_smoothing=0.1)
    classes = output.shape[1]
    halves = [make_scores(task, classes, loss) for _ in range(2)]
    feed(halves[0], output[:3], target[:3], [(0, 1), (1, 3)])
    feed(halves[1], output[3:], target[3:], [(0, 2), (2, len(target) - 3)])
    whole = feed(make_scores(task, classes, loss), output, target, [(0, len(target))])
    summed = halves[0].state + halves[1].state
    assert torch.equal(summed[2 * loss.terms:], whole.state[2 * loss.terms:])      # counts: exact
    assert_same(halves[0].compute(summed), whole.compute())


def test_the_loss_metric_is_the_mean_over_the_whole_set():
    output, target = segmentation_set(3)
    loss = make_loss("segmentation", "cross-entropy", C, class_weights=[1.0, 2.0, 0.5, 1.0])
    got = feed(make_scores("segmentation", C, loss), output, target).compute()["loss"]
    want = F.cross_entropy(output, target, weight=torch.tensor([1.0, 2.0, 0.5, 1.0], dtype=torch.float64),
                           ignore_index=IGNORE)
    assert got == pytest.approx(want.item(), rel=1e-12)


def test_padding_rows_do_not_count_for_a_mean_loss():
    g = torch.Generator().manual_seed(4)
    output, target = torch.randn(6, 3, generator=g), torch.randint(3, (6,), generator=g)
    target[[1, 5]] = IGNORE
    scores = feed(make_scores("classification", 3, nn.CrossEntropyLoss()), output, target)
    keep = target != IGNORE
    got = scores.compute()
    assert got["loss"] == pytest.approx(F.cross_entropy(output[keep], target[keep]).item(), rel=1e-6)
    assert got["top1"] == (output[keep].argmax(1) == target[keep]).float().mean().item()
    assert set(got) == {"loss", "top1"} and scores.names == ("loss", "top1")   # top-5 of 3 classes: always 1


def test_top1_and_top5_counts():
    output = torch.arange(8.0).repeat(4, 1)             # every row ranks class 7 first, 3 fifth, 2 sixth
    target = torch.tensor([7, 3, 2, IGNORE])
    scores = make_scores("classification", 8, None)
    scores.update(output, target)
    assert scores.state.tolist() == [3, 1, 2]            # rows, top-1 hits, top-5 hits
    assert scores.compute() == {"top1": pytest.approx(1 / 3), "top5": pytest.approx(2 / 3)}
    assert scores.names == ("top1", "top5")
    scores.reset()
    assert not scores.state.any() and math.isnan(scores.compute()["top1"])


def test_binary_one_channel_outputs():
    logits = torch.tensor([[[[2.0, -1.0], [-3.0, 0.5]]]])     # [1, 1, 2, 2]: predicts 1, 0 / 0, 1
    target = torch.tensor([[[1, 1], [IGNORE, 0]]])
    scores = make_scores("segmentation", 2, make_loss("segmentation", "bce", 2))
    scores.update(logits, target)
    assert scores.state[2:].view(2, 2).tolist() == [[0, 1], [1, 1]]     # (truth, prediction)
    flat = make_scores("classification", 2, make_loss("classification", "bce", 2))
    flat.update(torch.tensor([3.0, -1.0, 2.0]), torch.tensor([1, 1, 0]))
    assert flat.compute()["top1"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("task, output, target, match", [
    ("segmentation", torch.randn(2, 3, 4, 4), torch.zeros(2, 4, 4, dtype=torch.long), "--num-classes"),
    ("segmentation", torch.randn(2, C, 4, 4), torch.full((2, 4, 4), C), "--num-classes"),
    ("segmentation", torch.randn(2, C, 4, 4), torch.full((2, 4, 4), -5), "class indices"),
    ("segmentation", torch.randn(2, C, 4, 4), torch.zeros(2, 4, 5, dtype=torch.long), "targets"),
    ("classification", torch.randn(2, C), torch.zeros(2, C), "multi-label"),
    ("classification", torch.randn(2, C), torch.zeros(2), "class indices"),
])
def test_bad_input_raises(task, output, target, match):
    with pytest.raises(GemsError, match=match):
        make_scores(task, C, None).update(output, target)


def test_bad_setup_raises():
    with pytest.raises(GemsError, match="--task"):
        make_scores("detection", 3, None)
    with pytest.raises(GemsError, match="--num-classes 2"):
        make_scores("segmentation", 1, None)
    with pytest.raises(ValueError, match="state"):
        make_scores("segmentation", 3, None).compute(torch.zeros(4, dtype=torch.float64))


def test_keep_best_directions():
    assert METRICS["classification"] == ("loss", "top1", "top5")
    assert not higher_is_better("loss")
    assert all(higher_is_better(m) for names in METRICS.values() for m in names if m != "loss")
    with pytest.raises(GemsError, match="--keep-best"):
        higher_is_better("iou_per_class")
