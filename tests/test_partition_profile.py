"""gems.partition.profile: the fake-tensor profile against real CPU runs.

Parameters and activations (what autograd keeps, counted per storage) must match a real
forward/backward exactly, for the whole model and for stages cut anywhere; the estimated
peak of a forward + backward must be within 10% of what the CPU allocator really held
(recorded by the PyTorch profiler). Run ``python -m gems.partition.accuracy`` for the table.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from gems.errors import GemsError
from gems.models import build
from gems.partition import measure_times, profile
from gems.partition.accuracy import compare, random_cuts, toy_model
from gems.partition.records import ModelProfile, Storage, UnitProfile, segment_matrices

SIZE, BATCH = 64, 2
MODELS = {
    "toy": lambda: toy_model(),
    "resnet18": lambda: build("resnet18", num_classes=10),
    "preact-resnet20": lambda: build("preact-resnet", depth=20, num_classes=10),
    "amoebanet-d": lambda: build("amoebanet-d", num_classes=10, num_layers=3, num_filters=16),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_profile_matches_a_real_run(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    cuts = random_cuts(len(model), 2, seed=1)
    for c in compare(model, (3, SIZE, SIZE), BATCH, cuts, name):
        print(f"{name} [{c.lo},{c.hi}): params {c.params}, activations {c.activations}, peak {c.peak}")
        assert c.params[0] == c.params[1]
        assert c.activations[0] == c.activations[1]
        if c.peak[1] is not None and (c.lo, c.hi) == (0, len(model)):
            assert c.peak[0] == pytest.approx(c.peak[1], rel=0.10)


def test_activation_matrix_equals_the_set_definition():
    prof = profile(toy_model(), (3, 16, 16), 2)
    A = prof.activation_matrix()
    n = len(prof)
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            assert A[lo, hi] == prof.activation_bytes(lo, hi)
    W = prof.working_matrix()
    assert (W >= 0).all() and W[0, n] > 0


def test_segment_matrices_equal_their_definition_on_random_storages():
    """``segment_matrices`` (every segment at once) against the definition, one segment and one storage
    at a time, for every choice of terms; the working memory against its docstring, one unit at a time.
    Random storages: saved by a few units, crossing a few boundaries, read by a few units or not."""
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(1, 12)
        storages = []
        for _ in range(rng.randint(0, 25)):
            savers = tuple(sorted(rng.sample(range(n), rng.randint(0, min(3, n)))))
            if rng.random() < 0.4:
                storages.append(Storage(rng.randint(1, 10**6), savers[:1], ()))
                continue
            boundaries = tuple(sorted(rng.sample(range(-1, n), rng.randint(1, min(2, n + 1)))))
            readers = None if rng.random() < 0.5 else tuple(sorted(rng.sample(range(n + 1), rng.randint(0, 2))))
            storages.append(Storage(rng.randint(1, 10**6), savers, boundaries, readers))

        def counts(s: Storage, lo: int, hi: int, terms) -> bool:
            inside = any(lo <= u < hi for u in s.savers)
            return any(lo <= u < hi for u in s.touchers()) and (
                ("input" in terms and lo - 1 in s.boundaries) or ("saved" in terms and inside)
                or ("output" in terms and hi - 1 in s.boundaries))
        terms_sets = [("saved", "input", "output"), ("saved", "input"), ("input",), ("output",), ("saved",)]
        matrices = dict(zip(terms_sets, segment_matrices(n, storages, *terms_sets)))
        for terms, matrix in matrices.items():
            expected = np.zeros((n + 1, n + 1))
            for lo in range(n):
                for hi in range(lo + 1, n + 1):
                    expected[lo, hi] = sum(s.nbytes for s in storages if counts(s, lo, hi, terms))
            assert np.array_equal(matrix, expected), terms
        units = [UnitProfile(f"u{u}", 0, 0, 0, 0, 0, (), (), 0, 0, 0, rng.choice([0, rng.randint(0, 10**6)]),
                             rng.choice([0, rng.randint(0, 10**6)]), 0)
                 for u in range(n)]
        prof = ModelProfile(units, ((3, 8, 8),), ("float32",), 1, "float32", "sgd", storages)
        A, S, I, O = (matrices[t] for t in terms_sets[:4])  # noqa: E741
        for lo in range(n):
            for hi in range(lo + 1, n + 1):
                forward = max(A[lo, u] + units[u].forward_working + I[lo, hi] - I[lo, u] for u in range(lo, hi))
                backward = max([A[lo, hi] + units[hi - 1].backward_working]
                               + [S[lo, u + 1] - I[lo, u + 1] + I[lo, hi] + O[lo, hi] + units[u].backward_working
                                  for u in range(lo, hi - 1)])
                assert prof.working_matrix()[lo, hi] == max(forward - A[lo, hi], backward - A[lo, hi], 0)


def test_unit_fields():
    prof = profile(toy_model(), (3, 16, 16), 4, optimizer="adam")
    conv = prof.units[0]
    assert conv.param_bytes == (16 * 3 * 9 + 16) * 4 == conv.grad_bytes
    assert conv.optimizer_bytes == 2 * conv.param_bytes
    assert conv.output_shapes == ((16, 16, 16),) and conv.output_dtypes == ("float32",)
    assert conv.output_bytes == 4 * 16 * 16 * 16 * 4
    assert conv.forward_flops == 2 * 4 * 16 * 16 * 16 * 3 * 9
    assert prof.units[1].buffer_bytes == (16 + 16) * 4 + 8      # running mean, var, batch count
    fork = prof.units[4]
    assert len(fork.output_shapes) == 2                            # tuple boundary
    assert profile(toy_model(), (3, 16, 16), 4, optimizer="sgd").units[0].optimizer_bytes == conv.param_bytes


def test_unit_modifying_its_input_in_place():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3),
                          nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(4 * 12 * 12, 2))
    (whole,) = compare(model, (3, 16, 16), 2, [(0, len(model))])
    assert whole.activations[0] == whole.activations[1]


def test_half_precision_halves_activations_and_meta_models_work():
    with torch.device("meta"):
        meta = build("resnet18", num_classes=10)
    full = profile(meta, (3, 64, 64), 2)
    half = profile(meta, (3, 64, 64), 2, dtype=torch.float16)
    # BatchNorm keeps its statistics in float32 and max-pool its indices in int64: a bit over half.
    ratio = half.activation_matrix()[0, len(full)] / full.activation_matrix()[0, len(full)]
    assert 0.5 < ratio < 0.55
    assert sum(u.param_bytes for u in half.units) * 2 == sum(u.param_bytes for u in full.units)
    assert half.units[-1].output_dtypes == ("float16",)


def test_too_small_an_image_names_the_fix():
    with pytest.raises(GemsError, match=r"cannot take 3x8x8 input .*use a larger image size"):
        profile(build("resnet18", num_classes=10), (3, 8, 8), 1, model_name="resnet18")
    with pytest.raises(GemsError, match=r"cannot take 1x32x32 input .*input shape the model accepts"):
        profile(build("resnet18", num_classes=10), (1, 32, 32), 1)


def test_value_dependent_unit_is_explained():
    class Branchy(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x
    with pytest.raises(GemsError, match="depend on tensor shapes only"):
        profile(nn.Sequential(nn.Conv2d(3, 3, 1), Branchy()), (3, 8, 8), 2)


def test_batch_must_stay_first():
    class Transposed(nn.Module):
        def forward(self, x):
            return x.transpose(0, 1)
    with pytest.raises(GemsError, match="batch"):
        profile(nn.Sequential(nn.Conv2d(3, 4, 3), Transposed()), (3, 8, 8), 2)


def test_measure_times():
    times = measure_times(toy_model(), (3, 16, 16), 2, device="cpu", repeats=1)
    assert len(times) == 11 and all(t > 0 for t in times)


def test_profiling_leaves_each_modules_mode_as_it_was():
    # Fine-tuning: BatchNorm frozen (eval) inside units that train; profiling runs everything in
    # training mode and must give each module its own mode back, not its unit's.
    model = nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4).eval()), nn.Flatten())
    profile(model, (3, 8, 8), 2)
    assert model.training and model[0].training and model[0][0].training and not model[0][1].training
