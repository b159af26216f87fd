"""gems.train.losses: every loss splits exactly (sum of totals / sum of normalisers over any
micro-batches == PyTorch's mean on the whole batch, and the same gradients), and bad choices
raise a GemsError that names the flag."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gems.errors import GemsError
from gems.pipeline.loss import reciprocal
from gems.train.losses import DEFAULT_LOSS, LOSSES, make_loss
from gems.train.targets import IGNORE

C = 5
# Uneven micro-batches: one or several rows each, one holding an image with nothing valid.
SPLITS = {4: [(0, 1), (1, 3), (3, 4)], 6: [(0, 1), (1, 4), (4, 5), (5, 6)]}
CASES = {
    "plain": dict(ignore=False, weights=None, smoothing=0.0),
    "ignore": dict(ignore=True, weights=None, smoothing=0.0),
    "weights": dict(ignore=False, weights=[0.5, 2.0, 1.0, 0.0, 3.0], smoothing=0.0),
    "smoothing": dict(ignore=False, weights=None, smoothing=0.2),
    "all": dict(ignore=True, weights=[0.5, 2.0, 1.0, 0.0, 3.0], smoothing=0.1),
}


def batch(kind: str, ignore: bool, seed: int = 0):
    """(output float64 requiring grad, target) for ``kind``; with ``ignore``, about a third of
    the targets IGNORE and row 2 entirely IGNORE (a padding row)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"classification": ((6, C), (6,), C), "segmentation": ((4, C, 8, 8), (4, 8, 8), C),
              "binary-seg": ((4, 1, 8, 8), (4, 8, 8), 2), "binary-cls": ((6, 1), (6,), 2),
              "binary-flat": ((6,), (6,), 2), "multi-label": ((6, C), (6, C), 2)}
    out_shape, t_shape, classes = shapes[kind]
    output = (2 * torch.randn(out_shape, generator=g, dtype=torch.float64)).requires_grad_()
    target = torch.randint(classes, t_shape, generator=g)
    if ignore:
        target[torch.rand(t_shape, generator=g) < 0.3] = IGNORE
        target[2] = IGNORE
    return output, target


def split_loss(loss, output, target):
    """The engine's loss: sum over micro-batches of sum_j total_j / N_j, N_j global."""
    bounds = SPLITS[len(target)]
    n = sum(loss.normaliser(target[a:b]) for a, b in bounds)
    assert n.dtype == torch.float64 and n.shape == (loss.terms,)
    inv = reciprocal(n)
    return sum((loss(output[a:b], target[a:b]).reshape(-1) * inv).sum() for a, b in bounds)


def check_split(loss, output, target, reference) -> None:
    got = split_loss(loss, output, target)
    want = reference(output, target)
    grad_got, = torch.autograd.grad(got, output)
    grad_want, = torch.autograd.grad(want, output)
    assert abs(got.item() - want.item()) < 1e-6, (got.item(), want.item())
    torch.testing.assert_close(grad_got, grad_want, atol=1e-6, rtol=1e-6)


def ce_reference(case):
    w = None if case["weights"] is None else torch.tensor(case["weights"], dtype=torch.float64)
    return lambda o, t: F.cross_entropy(o, t, weight=w, ignore_index=IGNORE, label_smoothing=case["smoothing"])


def dice_reference(output, target, smoothing=1.0):
    """Mean over the images with a valid pixel of mean over classes of 1 - (2I+1)/(P+T+1), by hand."""
    p = output.softmax(1)
    losses = []
    for i in range(len(target)):
        valid = target[i] != IGNORE
        if not valid.any():
            continue
        terms = []
        for c in range(output.shape[1]):
            truth = (target[i] == c) & valid
            inter, pred = p[i, c][truth].sum(), p[i, c][valid].sum()
            terms.append(1 - (2 * inter + smoothing) / (pred + truth.sum() + smoothing))
        losses.append(torch.stack(terms).mean())
    return torch.stack(losses).mean()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ["classification", "segmentation"])
def test_cross_entropy_splits_exactly(kind, case):
    c = CASES[case]
    loss = make_loss(kind, "cross-entropy", C, class_weights=c["weights"], label_smoothing=c["smoothing"])
    check_split(loss, *batch(kind, c["ignore"]), ce_reference(c))


@pytest.mark.parametrize("case", CASES)
def test_dice_ce_splits_exactly(case):
    c = CASES[case]
    loss = make_loss("segmentation", "dice-ce", C, class_weights=c["weights"], label_smoothing=c["smoothing"])
    assert loss.terms == 2
    ce = ce_reference(c)
    check_split(loss, *batch("segmentation", c["ignore"]), lambda o, t: ce(o, t) + dice_reference(o, t))


@pytest.mark.parametrize("case", ["plain", "ignore", "weights", "weights-ignore"])
@pytest.mark.parametrize("kind", ["binary-seg", "binary-cls", "binary-flat", "multi-label"])
def test_bce_splits_exactly(kind, case):
    num_classes = C if kind == "multi-label" else 2
    task = "segmentation" if kind == "binary-seg" else "classification"
    weights = None
    if "weights" in case:
        weights = [0.5, 2.0, 1.0, 0.0, 3.0] if kind == "multi-label" else [3.0]
    loss = make_loss(task, "bce", num_classes, class_weights=weights)
    output, target = batch(kind, "ignore" in case)

    def reference(o, t):
        t = t.reshape(o.shape)
        valid = t != IGNORE
        pw = None if weights is None else torch.tensor(weights, dtype=o.dtype)
        if pw is not None and o.dim() > 2:
            pw = pw.view(-1, 1, 1)
        pw = None if pw is None else pw.expand_as(o)[valid]
        return F.binary_cross_entropy_with_logits(o[valid], t[valid].to(o.dtype), pos_weight=pw)

    check_split(loss, output, target, reference)


def test_a_float_multi_hot_target_and_one_weight_for_every_label():
    loss = make_loss("classification", "bce", C, class_weights=[2.0])
    output, _ = batch("multi-label", False)
    target = torch.rand(6, C, generator=torch.Generator().manual_seed(1), dtype=torch.float64).round()
    reference = F.binary_cross_entropy_with_logits(output, target, pos_weight=torch.full((C,), 2.0, dtype=torch.float64))
    assert abs(split_loss(loss, output, target).item() - reference.item()) < 1e-6


def test_nothing_valid_gives_zero_and_finite_gradients():
    for name in ("cross-entropy", "dice-ce", "bce"):
        loss = make_loss("segmentation", name, 2)
        output = torch.randn(2, 1 if name == "bce" else 2, 4, 4, dtype=torch.float64, requires_grad=True)
        target = torch.full((2, 4, 4), IGNORE)
        assert loss.normaliser(target).sum() == 0
        value = (loss(output, target).reshape(-1) * reciprocal(loss.normaliser(target))).sum()
        value.backward()
        assert value.item() == 0 and torch.isfinite(output.grad).all() and not output.grad.any()


def test_bce_rejects_an_output_of_the_wrong_shape():
    with pytest.raises(GemsError, match="--loss bce"):
        make_loss("segmentation", "bce", 2)(torch.randn(2, 2, 4, 4), torch.zeros(2, 4, 4, dtype=torch.long))
    with pytest.raises(GemsError, match="--class-weights"):
        make_loss("classification", "bce", 3, class_weights=[1, 2, 3])(torch.randn(2, 1), torch.zeros(2, 1))


def test_defaults_and_names():
    assert DEFAULT_LOSS == {"classification": "cross-entropy", "segmentation": "cross-entropy"}
    assert set(LOSSES) == {"classification", "segmentation"}
    assert "dice-ce" in LOSSES["segmentation"] and "dice-ce" not in LOSSES["classification"]


@pytest.mark.parametrize("args, kwargs, flag", [
    (("classification", "dice-ce", 5), {}, "--loss"),
    (("segmentation", "focal", 5), {}, "--loss"),
    (("regression", "cross-entropy", 5), {}, "--task"),
    (("classification", "cross-entropy", 0), {}, "--num-classes"),
    (("classification", "cross-entropy", 5), dict(class_weights=[1.0, 2.0]), "--class-weights"),
    (("classification", "cross-entropy", 2), dict(class_weights=[1.0, -2.0]), "--class-weights"),
    (("classification", "cross-entropy", 2), dict(class_weights=[0.0, 0.0]), "--class-weights"),
    (("classification", "cross-entropy", 2), dict(class_weights=[1.0, float("nan")]), "--class-weights"),
    (("segmentation", "bce", 2), dict(class_weights=[1.0, 2.0]), "--class-weights"),
    (("classification", "bce", 5), dict(class_weights=[1.0, 2.0]), "--class-weights"),
    (("classification", "cross-entropy", 5), dict(label_smoothing=1.0), "--label-smoothing"),
    (("classification", "cross-entropy", 5), dict(label_smoothing=-0.1), "--label-smoothing"),
    (("segmentation", "bce", 2), dict(label_smoothing=0.1), "--label-smoothing"),
    (("segmentation", "bce", 3), {}, "--loss bce"),
])
def test_bad_choices_name_the_flag(args, kwargs, flag):
    with pytest.raises(GemsError, match=flag) as caught:
        make_loss(*args, **kwargs)
    assert "\n" not in str(caught.value) and ":" in str(caught.value)
