"""The optimizer sharded across the sync group: each rank updates its share of the parameters and
keeps only their optimizer state, the updated values are exchanged after the step; training equals
one process, and a checkpoint's optimizer state (keyed by parameter name) is the same whether the
run that wrote it sharded or not, so either kind of run resumes the other."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gems
from gems import models
from gems.comm import loopback
from gems.obs import memory
from gems.pipeline.shares import split_among

from equivalence import build, data, make_plan, optimizer, run_loopback

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("schedule,K,m,D", [("mast", 2, 2, 1), ("mast", 2, 2, 2), ("mast", 3, 1, 2),
                                            ("1f1b", 2, 2, 2), ("gpipe", 1, 2, 2)])
def test_sharded_optimizer_trains_like_one_process(schedule, K, m, D):
    run_loopback("transparency", schedule, K, m, D, steps=3, shard=True)


def test_sharded_optimizer_with_clipping_and_batchnorm():
    run_loopback("transparency", "mast", 2, 2, 1, steps=3, shard=True, clip=0.05)
    run_loopback("batchnorm", "mast", 2, 2, 1, steps=2, shard=True)


def test_each_member_takes_whole_parameters_of_about_equal_elements():
    def shared(sizes, n):
        params = [nn.Parameter(torch.zeros(k)) for k in sizes]
        ordered, bounds = split_among(params, n)
        assert sorted(map(id, ordered)) == sorted(map(id, params))
        runs = [ordered[a:b] for a, b in zip(bounds, bounds[1:])]
        index = {id(p): i for i, p in enumerate(params)}
        assert all([index[id(p)] for p in run] == sorted(index[id(p)] for p in run) for run in runs)
        return [[p.numel() for p in run] for run in runs]
    assert shared((5, 5, 5, 5), 2) == [[5, 5], [5, 5]]
    assert shared((1, 1, 100, 1, 1), 3) == [[100], [1, 1], [1, 1]]
    assert shared((100, 1, 1), 3) == [[100], [1], [1]]      # none empty
    assert shared((1, 2), 4) == [[1], [2], [], []]           # fewer parameters than members
    # resnet18's four largest convolutions (2.4M) split 2 : 2, not 3 : 1 as contiguous runs would
    resnet18 = [p.numel() for p in models.build("resnet18", num_classes=10).parameters()]
    loads = [sum(run) for run in shared(resnet18, 2)]
    assert max(loads) / (sum(loads) / 2) < 1.01, loads


def _shards(comm, model, plan, steps, load=None):
    """Train ``steps`` steps (after loading ``load``: (model state, optimizer state)), then every
    rank's checkpoint shard of its position and its optimizer's own parameter count."""
    engine = gems.Engine(model, plan, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss(), comm=comm)
    if load is not None:
        engine.load_state(*load)
    for step in steps:
        engine.step(*data(plan.batch_size, step))
    shard = engine.stage_state(engine.position)
    held = sum(len(g["params"]) for g in engine.optimizer.param_groups)
    return shard, held, engine.state_dict(), memory.storage_bytes(memory.engine_tensors(engine))


def _run(shard: bool, steps, load=None):
    model, plan = build("transparency"), make_plan("transparency", "mast", 2, 2, 2, shard=shard)
    return loopback.run(4, lambda comm: _shards(comm, copy.deepcopy(model), copy.deepcopy(plan), steps,
                                                copy.deepcopy(load)), timeout=30)


def _full_optimizer_state(results) -> dict:
    return {name: st for shard, _, _, _ in results for name, st in shard["optimizer"].items()}


def test_checkpoints_are_the_same_sharded_or_not_and_each_resumes_the_other():
    model = build("transparency")
    plain, sharded = _run(False, range(2)), _run(True, range(2))
    assert sharded[0][1] < plain[0][1]   # a rank's optimizer holds a share of the parameters
    # ... and only its share's state (no exchange buffer of its own), as the plan prices it: what a
    # rank holds between steps is its position's static estimate, up to one parameter's state (the
    # engine shares whole parameters, the plan 1/n of the state)
    one = max(p.numel() * p.element_size() for p in model.parameters())
    for shard in (False, True):
        plan = make_plan("transparency", "mast", 2, 2, 2, shard=shard)
        held = (sharded if shard else plain)[0][3]
        assert 0.97 * plan.positions[0].static_bytes <= held <= plan.positions[0].static_bytes + shard * one
    assert sharded[0][3] < plain[0][3]
    a, b = _full_optimizer_state(plain), _full_optimizer_state(sharded)
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(b[name]["momentum_buffer"], a[name]["momentum_buffer"], rtol=0, atol=0)
    # resume: sharded from the plain checkpoint and plain from the sharded one, one more step each
    state = plain[0][2]
    after = [_run(shard, [2], (state, opt))[0][2] for shard, opt in ((True, a), (False, b))]
    for key in after[0]:
        torch.testing.assert_close(after[0][key], after[1][key], rtol=0, atol=0, msg=key)


def _labels(comm, plan, images, labels):
    engine = gems.Engine(build("transparency"), plan, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss(), comm=comm)
    engine.step(images, labels)
    return [label for label, _, _ in engine.timeline()]


@pytest.mark.parametrize("shard", [False, True])
def test_the_parameter_exchange_is_its_own_span_after_an_applied_step(shard):
    """The timeline's ``step`` is the update alone; a sharded rank's exchange follows as ``share``
    (gems-bench and traces tell the two apart), a step not applied exchanges nothing, and the
    gradient bucket is zeroed last (``zero_grad``), applied or not."""
    plan = make_plan("transparency", "mast", 2, 2, 1, shard=shard)
    images, labels = data(plan.batch_size, 0)
    for x, applied in ((images, True), (torch.full_like(images, float("nan")), False)):
        for spans in loopback.run(2, lambda comm: _labels(comm, copy.deepcopy(plan), x, labels), timeout=30):
            assert spans[-1] == "zero_grad" and spans.count("zero_grad") == 1
            assert spans[-2] == ("share" if shard and applied else "step")
            assert spans.count("share") == (shard and applied) and spans[-3 if shard and applied else -2] == "step"
