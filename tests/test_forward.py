"""The loss contract and forward-only steps, on loopback ranks against one process.

- A loss whose normaliser differs between micro-batches (cross-entropy over pixels with ignored
  pixels spread unevenly) trains like one process's mean over the global batch, in every
  schedule family; a plain mean loss keeps working through ``MeanLoss``.
- ``Engine.evaluate`` (both mirrored replicas forward, nothing kept for backward) gives the
  loss of one process over the whole set; ``Engine.predict`` gives one process's outputs, on
  the group's position-0 rank, for any batch size; the stages go back to training mode.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gems
from gems import partition
from gems.comm import loopback
from gems.pipeline.loss import SumLoss
from gems.schedule import generators as sch

C, SIDE, STEPS = 3, 8, 2


class PixelCE(SumLoss):
    """Cross-entropy over pixels, target -1 ignored: sum over valid pixels / valid pixels."""

    def normaliser(self, target):
        return (target >= 0).sum().double().reshape(1)

    def forward(self, output, target):
        return F.cross_entropy(output, target, ignore_index=-1, reduction="sum")


def segmenter() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.Dropout(0.5), nn.ReLU(), nn.Conv2d(8, C, 1))


def batch(n: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, 3, SIDE, SIDE, generator=g)
    y = torch.randint(0, C, (n, SIDE, SIDE), generator=g)
    # uneven: image i has i * 7 ignored pixels (the first has none, a late one almost all)
    for i in range(n):
        y[i].view(-1)[:min(i * 7, SIDE * SIDE - 1)] = -1
    return x, y


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def plan_for(model, schedule, K, m, D, rows=2):
    size = D * sch.replicas(schedule) * m * rows
    return partition.plan(model, input_shape=(3, SIDE, SIDE), batch_size=size, stages=K, schedule=schedule,
                          micro_batches=m, groups=D)


@pytest.mark.parametrize("schedule,K,m,D", [("mast", 2, 1, 1), ("1f1b", 2, 2, 1), ("mast", 2, 1, 2),
                                             ("gpipe", 3, 2, 1)], ids=str)
def test_uneven_normalisers_train_like_one_process(schedule, K, m, D):
    model = segmenter().eval()   # dropout off: batch-independent
    plan = plan_for(model, schedule, K, m, D)
    B = plan.batch_size
    copies = [copy.deepcopy(model) for _ in range(K * D)]

    def rank(comm):
        engine = gems.Engine(copies[comm.rank], copy.deepcopy(plan), optimizer=sgd, loss_fn=PixelCE(), comm=comm)
        return [engine.step(*batch(B, s)) for s in range(STEPS)], engine.state_dict()

    results = loopback.run(K * D, rank, timeout=30)
    ref, losses = copy.deepcopy(model), []
    opt = sgd(ref.parameters())
    for s in range(STEPS):
        x, y = batch(B, s)
        loss = F.cross_entropy(ref(x), y, ignore_index=-1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for got_losses, state in results:
        assert got_losses == pytest.approx(losses, rel=1e-5)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


def test_all_ignored_step_has_zero_loss_and_moves_nothing():
    model = segmenter().eval()
    plan = plan_for(model, "mast", 2, 1, 1)
    copies = [copy.deepcopy(model) for _ in range(2)]
    x = torch.randn(plan.batch_size, 3, SIDE, SIDE)
    y = torch.full((plan.batch_size, SIDE, SIDE), -1)

    def rank(comm):
        engine = gems.Engine(copies[comm.rank], copy.deepcopy(plan), optimizer=sgd, loss_fn=PixelCE(), comm=comm)
        return engine.step(x, y), engine.state_dict()

    for loss, state in loopback.run(2, rank, timeout=30):
        assert loss == 0.0
        for k, v in model.state_dict().items():
            assert torch.equal(state[k], v)


@pytest.mark.parametrize("schedule,K,m,D", [("mast", 2, 1, 1), ("mast", 3, 2, 1), ("1f1b", 2, 2, 2)], ids=str)
def test_evaluate_and_predict_match_one_process(schedule, K, m, D):
    model = segmenter()   # training mode: evaluate/predict must switch dropout off themselves
    plan = plan_for(model, schedule, K, m, D)
    size = 2 * plan.batch_size     # another batch size than the plan's
    copies = [copy.deepcopy(model) for _ in range(K * D)]
    sets = [batch(size, 10 + i) for i in range(2)]

    def rank(comm):
        engine = gems.Engine(copies[comm.rank], copy.deepcopy(plan), optimizer=sgd, loss_fn=PixelCE(), comm=comm)
        scores = engine.evaluate(sets, batch_size=size)
        x = sets[0][0] if engine.needs_images else None
        out = engine.predict(x, batch_size=size)
        training = all(m.training for s in engine.stages.values() for m in s.modules())
        return scores, out, engine.group, engine.position, training

    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        total = sum(F.cross_entropy(ref(x), y, ignore_index=-1, reduction="sum") for x, y in sets)
        count = sum((y >= 0).sum() for _, y in sets)
        expected = ref(sets[0][0])
    per_group = size // D
    for scores, out, group, position, training in loopback.run(K * D, rank, timeout=30):
        assert training
        assert scores["loss"] == pytest.approx(float(total / count), rel=1e-5)
        if position == 0:
            torch.testing.assert_close(out, expected[group * per_group:(group + 1) * per_group],
                                       rtol=1e-5, atol=1e-6)
        else:
            assert out is None
