"""Memory policies (gems.pipeline.stage) change memory and time, never the math.

In-process engines run K = 1 on a one-rank communicator (every schedule still runs its
micro-batches, mirrored replicas included); tests/test_equivalence.py checks K >= 2 on loopback ranks.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import gems
import gems.pipeline.offload
import gems.pipeline.stage
from gems import models, partition
from gems.comm.base import Backoff, Comm, Group, Request
from gems.pipeline.stage import StageRunner, checkpointed_segments
from gems.plan import StagePolicy
from gems.plan import MIN_OFFLOAD_BYTES
from gems.schedule import generators as sch

SIDE = 32          # 4 rows x 8 channels x 32 x 32 floats = 128 KiB per activation: above MIN_OFFLOAD_BYTES
ROWS = 4           # per micro-batch


class SoloComm(Comm):
    """A one-rank communicator: collectives are the identity."""

    def __init__(self) -> None:
        super().__init__(0, 1, 0, 1, torch.device("cpu"), 10.0, Backoff())

    def group(self, ranks):
        return Group(list(ranks), 0, None)

    def iallreduce(self, tensor, group):
        return Request(lambda: True, "solo")

    def ibroadcast(self, tensor, root, group):
        return Request(lambda: True, "solo")

    def iallgather_bytes(self, data, group):
        return Request(lambda: True, "solo"), data.reshape(1, -1).clone()


def plain(batchnorm: bool = False) -> nn.Sequential:
    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), *([nn.BatchNorm2d(cout)] if batchnorm else []),
                             nn.ReLU())
    torch.manual_seed(0)
    return nn.Sequential(block(3, 8), block(8, 8), nn.Sequential(nn.Dropout(0.3), block(8, 8)), block(8, 8),
                         block(8, 8), nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)))


def cumulative() -> nn.Sequential:
    """BatchNorm with momentum=None: running statistics are cumulative averages."""
    net = plain(batchnorm=True)
    for mod in net.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.momentum = None
    return net


def amoebanet() -> nn.Sequential:
    """Tuple boundaries: cells take and return (previous, current)."""
    torch.manual_seed(0)
    return models.build("amoebanet-d", num_classes=5, num_layers=3, num_filters=8)


MODELS = {"plain": plain, "batchnorm": functools.partial(plain, batchnorm=True), "cumulative": cumulative,
          "amoebanet": amoebanet}
_PLANS: dict[tuple, partition.Plan] = {}


def make_plan(kind: str, schedule: str, m: int, side: int) -> partition.Plan:
    """A K = 1 plan, profiled once per configuration (profiling costs more than tiny steps).
    ``cumulative`` is profiled as ``batchnorm`` (same shapes; a fake-tensor profile cannot
    follow momentum=None's division by the counter's value)."""
    key = (kind, schedule, m, side)
    if key not in _PLANS:
        _PLANS[key] = partition.plan(MODELS["batchnorm" if kind == "cumulative" else kind](),
                                     input_shape=(3, side, side), batch_size=ROWS * m * sch.replicas(schedule),
                                     stages=1, schedule=schedule, micro_batches=m)
    return copy.deepcopy(_PLANS[key])


def per_unit(n: int, offload: bool = False) -> StagePolicy:
    return StagePolicy(recompute=[[u, u + 1] for u in range(n)], offload=offload)


POLICIES = {
    "recompute per unit": lambda n: per_unit(n),
    "recompute one segment": lambda n: StagePolicy(recompute=[[1, n - 1]]),
    "recompute two segments": lambda n: StagePolicy(recompute=[[0, 2], [3, n]]),
    "offload": lambda n: StagePolicy(offload=True),
    "recompute+offload": lambda n: per_unit(n, offload=True),
    "segment+offload": lambda n: StagePolicy(recompute=[[1, n - 1]], offload=True),
}


def train(kind: str, policy: StagePolicy | None, schedule: str, m: int, steps: int = 2,
          side: int = SIDE, calls: list[int] | None = None) -> dict:
    """Train model ``kind`` with K = 1 in process; returns losses, gradients before every
    step, final state. ``calls``: counts forward calls of each unit during the steps."""
    model, plan = MODELS[kind](), make_plan(kind, schedule, m, side)
    batch = plan.batch_size
    if policy is not None:
        plan.policies = [policy]
    grads: list[list[torch.Tensor]] = []

    def optimizer(params):
        params = list(params)
        opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        opt.register_step_pre_hook(lambda *_: grads.append([p.grad.clone() for p in params]))
        return opt

    torch.manual_seed(1)   # dropout masks: the same in every run
    engine = gems.Engine(model, plan, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss(), comm=SoloComm())
    for i, unit in enumerate(model if calls is not None else []):
        unit.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        losses.append(engine.step(torch.randn(batch, 3, side, side, generator=g),
                                  torch.randint(0, 5, (batch,), generator=g)))
    return {"losses": losses, "grads": grads, "state": engine.state_dict(), "engine": engine}


def assert_same(run: dict, ref: dict, rtol: float = 1e-5) -> None:
    for a, b in zip(run["losses"], ref["losses"]):
        assert abs(a - b) <= rtol * abs(b)
    for step, (gs, hs) in enumerate(zip(run["grads"], ref["grads"], strict=True)):
        for g, h in zip(gs, hs, strict=True):
            assert (g - h).abs().max() <= rtol * h.abs().max(), f"step {step}"
    for k, v in ref["state"].items():   # parameters, running statistics, num_batches_tracked
        if v.is_floating_point():
            assert (run["state"][k] - v).abs().max() <= rtol * v.abs().max().clamp_min(1e-12), k
        else:
            assert torch.equal(run["state"][k], v), k


# ---------------------------------------------------------------- which forwards
def compute(actions):
    return [f"{a.op[0].upper()}{a.micro}.{sch.REPLICA_NAMES[a.replica]}.s{a.stage}" for a in actions]


def test_waiting_forwards_follow_the_rule():
    gpipe = sch.schedule("gpipe", 2, 2)                                       # F0 F1 B0 B1 on both
    assert compute(sch.waiting_forwards(gpipe[0])) == ["F0.d.s0", "F1.d.s0"]
    assert compute(sch.waiting_forwards(gpipe[1])) == ["F0.d.s1", "F1.d.s1"]
    mast = sch.schedule("mast", 2, 1)
    assert compute(sch.waiting_forwards(mast[0])) == ["F0.d.s0"]              # F d.s0  F u.s1  B u.s1  B d.s0
    assert compute(sch.waiting_forwards(mast[1])) == ["F0.u.s0"]              # F u.s0  F d.s1  B d.s1  B u.s0
    one_f_one_b = sch.schedule("1f1b", 2, 2)
    assert compute(sch.waiting_forwards(one_f_one_b[0])) == ["F0.d.s0", "F1.d.s0"]
    assert sch.waiting_forwards(one_f_one_b[1]) == []                          # F0 B0 F1 B1
    assert sch.waiting_forwards(sch.schedule("mp", 3, 1)[1]) == []             # mp: every forward is immediate


def test_immediate_forwards_keep_a_last_segment_that_ends_the_stage():
    policy = StagePolicy(recompute=[[2, 3], [3, 5]])
    assert checkpointed_segments(policy, waiting=True, end_unit=5) == [[2, 3], [3, 5]]
    assert checkpointed_segments(policy, waiting=False, end_unit=5) == [[2, 3]]
    assert checkpointed_segments(policy, waiting=False, end_unit=6) == [[2, 3], [3, 5]]
    assert checkpointed_segments(StagePolicy(recompute=[[2, 5]]), waiting=False, end_unit=5) == []


@pytest.mark.parametrize("policy,waiting,immediate", [
    (per_unit(6), [4] * 6, [4, 4, 4, 4, 4, 2]),
    (StagePolicy(recompute=[[0, 6]]), [4] * 6, [2] * 6),
    (StagePolicy(recompute=[[0, 3], [3, 6]]), [4] * 6, [4, 4, 4, 2, 2, 2]),
    (StagePolicy(recompute=[[0, 2], [2, 4]]), [4, 4, 4, 4, 2, 2], [4, 4, 4, 4, 2, 2]),
])
def test_recomputed_forwards_are_counted_by_the_rule(policy, waiting, immediate):
    """Calls of each unit in one step with two forwards: gpipe K=1 m=2 (F0 F1 B0 B1: both
    wait, every segment recomputed) and mast K=1 m=1 (F d0 B d0 F u0 B u0: both immediate,
    a last segment that ends the stage is not recomputed)."""
    for schedule, m, expected in (("gpipe", 2, waiting), ("mast", 1, immediate)):
        calls = [0] * len(expected)
        train("plain", policy, schedule, m=m, steps=1, calls=calls)
        assert calls == expected, schedule


# ---------------------------------------------------------------- the math does not change
_REFERENCES: dict[tuple[str, int], dict] = {}


# K = 1: every forward waits under gpipe and is immediate under mast.
@pytest.mark.parametrize("schedule,m", [("gpipe", 2), ("mast", 2)])
@pytest.mark.parametrize("name", list(POLICIES))
def test_policies_keep_gradients(name, schedule, m):
    if (schedule, m) not in _REFERENCES:
        _REFERENCES[schedule, m] = train("plain", None, schedule, m)
    ref = _REFERENCES[schedule, m]
    run = train("plain", POLICIES[name](6), schedule, m)
    assert_same(run, ref)
    runner = run["engine"].runners[0]
    if runner.offload is not None and sch.waiting_forwards(run["engine"].actions):
        assert runner.offload.bytes > 0 and not runner.offload.saved   # moved, and all fetched back


@pytest.mark.parametrize("name", ["recompute per unit", "recompute two segments", "recompute+offload"])
def test_batchnorm_statistics_are_updated_once(name):
    ref = train("batchnorm", None, "gpipe", 2)
    run = train("batchnorm", POLICIES[name](6), "gpipe", 2)
    assert_same(run, ref)   # includes running_mean, running_var and num_batches_tracked
    assert int(run["state"]["0.1.num_batches_tracked"]) == 2 * 2   # steps x micro-batches


def test_batchnorm_with_cumulative_average():
    assert_same(train("cumulative", per_unit(6), "gpipe", 2), train("cumulative", None, "gpipe", 2))


def test_tuple_boundaries_amoebanet(monkeypatch):
    monkeypatch.setattr(gems.pipeline.offload, "MIN_OFFLOAD_BYTES", 1)   # its tensors are small at this size
    policy = per_unit(len(amoebanet()), offload=True)
    run = train("amoebanet", policy, "gpipe", 2, steps=1, side=SIDE)
    assert_same(run, train("amoebanet", None, "gpipe", 2, steps=1, side=SIDE))
    assert run["engine"].runners[0].offload.bytes > 0


# ---------------------------------------------------------------- what offload moves
def test_offload_skips_parameters_inputs_small_tensors_and_outputs():
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()), nn.ReLU())
    runner = StageRunner(stage, 0, StagePolicy(offload=True), torch.device("cpu"))
    x = torch.randn(4, 8, 32, 32, requires_grad=True)
    activation = x.numel() * x.element_size()
    assert activation >= MIN_OFFLOAD_BYTES > 4 * 8 * 4
    (y,) = runner.forward((x,), (0, 0, 0), waiting=True)
    # Saved: conv1's input (the stage input) and the weights stay; ReLU 1's output (also conv 2's
    # input: moved once) and ReLU 2's output move; the pooled 4x8 tensors are too small.
    assert runner.offload.bytes == 2 * activation
    assert [item.host is not None for item in runner.offload.saved[(0, 0, 0)]] == [True, True]
    runner.prefetch((0, 0, 0))
    y.sum().backward()
    ref = x.detach().clone().requires_grad_(True)
    stage(ref).sum().backward()
    assert torch.allclose(x.grad, ref.grad, rtol=1e-6) and not runner.offload.saved

    # A saved stage output stays on the device (the engine keeps it anyway): nothing comes back.
    runner = StageRunner(stage[:2], 0, StagePolicy(offload=True), torch.device("cpu"))
    runner.forward((x,), (0, 0, 0), waiting=True)
    assert [item.host for item in runner.offload.saved[(0, 0, 0)]] == [None]


def test_immediate_forwards_are_not_offloaded():
    run = train("plain", StagePolicy(offload=True), "mp", 1, steps=1)
    assert run["engine"].runners[0].offload.bytes == 0

