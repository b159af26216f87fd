"""``--state-placement host``: parameters in host memory, on the device per unit group
(``gems.pipeline.hostweights``). On CPU ranks the arithmetic is the device's, bit for bit, under every
schedule, sharded or not, with recompute, offload and split backward; a group's device storage is
empty outside its forward and backward; checkpoints round-trip across placements; bad plans are refused
in one sentence."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import gems
from gems import partition
from gems.comm import loopback
from gems.errors import GemsError
from gems.obs import memory
from gems.pipeline import compiler
from gems.schedule import generators as sch

from conftest import DISTRIBUTED, run_mpi
from equivalence import build, data, make_plan, optimizer, run_loopback
from test_host_optimizer import RTOL, _checkpoint, _same

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("one_torch_thread")]


# K = 2, D = 2, three steps; pairwise: every schedule with both optimizers, sharded and not, groups of one
# unit and of several, and the memory policies and split backward each under some schedule
CASES = [
    ("mp", 1, "sgd", False, 1, "none", False),
    ("mp", 1, "adamw", True, 0, "recompute", False),
    ("gpipe", 4, "sgd", True, 2, "none", False),
    ("gpipe", 4, "adamw", False, 1, "recompute+offload", False),
    ("1f1b", 4, "sgd", False, 3, "offload", False),
    ("1f1b", 4, "adamw", True, 1, "none", True),
    ("mast", 1, "sgd", True, 1, "segment", False),
    ("mast", 1, "adamw", False, 2, "none", True),
    ("mast", 2, "adamw", True, 1, "recompute", True),
]


# group-major runs (Plan.swap_grouped): gpipe's runs of four, 1f1b's warm-up, mast's runs of one; and stages
# that fall back to one visit per action (a checkpointed segment across groups, offload, split backward)
GROUPED = [
    ("gpipe", 4, "sgd", False, 1, "none", False),
    ("gpipe", 4, "adamw", True, 2, "recompute", False),
    ("1f1b", 4, "adamw", True, 1, "none", False),
    ("mast", 2, "sgd", False, 1, "recompute", False),
    ("gpipe", 4, "sgd", False, 1, "segment", False),
    ("1f1b", 4, "sgd", False, 1, "offload", False),
    ("gpipe", 4, "sgd", False, 1, "none", True),
]


@pytest.mark.parametrize("schedule,m,optim,shard,group_units,policy,split,grouped",
                         [(*case, False) for case in CASES] + [(*case, True) for case in GROUPED])
def test_host_equals_device_bit_for_bit(schedule, m, optim, shard, group_units, policy, split, grouped):
    runs = [run_loopback("transparency", schedule, 2, m, 2, steps=3, optim=optim, shard=shard, policy=policy,
                         split=split, placement=placement, group_units=group_units if placement == "host" else 0,
                         grouped=grouped and placement == "host", rtol=RTOL[optim])
            for placement in ("device", "host")]
    _same(*runs)
    if not grouped:
        assert [r.offloaded for r in runs[0]] == [r.offloaded for r in runs[1]]   # offload moves the same tensors
        assert all(r.fetched_back for r in runs[1])


@pytest.mark.parametrize("schedule,m", [("gpipe", 4), ("mast", 2)])
def test_group_major_runs_under_nccl_semantics_on_three_stages(schedule, m):
    """The run's sends wait for its last group and its receives keep their place: no deadlock where a send
    completes only once its receive is posted; equal to one process."""
    run_loopback("transparency", schedule, 3, m, 1, steps=2, placement="host", group_units=1, grouped=True,
                 semantics="nccl")


def test_group_major_runs_move_each_group_once_per_run():
    """gpipe K = 2, m = 4, groups of one unit: one forward and one backward run per position, so every
    group comes to the device twice a step instead of eight times; 1f1b's two warm-up forwards on
    position 0 share one visit."""
    def loads(schedule, grouped):
        plan = make_plan("transparency", schedule, 2, 4, 1, placement="host", group_units=1, grouped=grouped)
        copies, plans = [build("transparency") for _ in range(2)], [copy.deepcopy(plan) for _ in range(2)]

        def rank(comm):
            engine = _engine(comm, plans[comm.rank], copies[comm.rank])
            engine.step(*data(plan.batch_size, 0))
            (weights,) = [r.weights for r in engine.runners.values()]
            return weights.loads, len(weights.groups), weights.device_bytes
        return loopback.run(2, rank, timeout=30)

    for (each, groups, _), (once, _, left) in zip(loads("gpipe", False), loads("gpipe", True)):
        assert (each, once, left) == (8 * groups, 2 * groups, 0)
    (first_each, groups, _), _ = loads("1f1b", False)
    (first_once, _, _), _ = loads("1f1b", True)
    assert (first_each, first_once) == (8 * groups, 6 * groups)


def test_clipping_batchnorm_and_three_stages_on_the_host():
    """Clipping's norm is read from the host gradients; BatchNorm statistics stay on the device and are
    averaged through the segment; mast K = 3 puts the middle stage's one copy beside two."""
    for kind, K, clip in (("transparency", 2, 0.05), ("batchnorm", 2, None), ("transparency", 3, None)):
        runs = [run_loopback(kind, "mast", K, 1, 2 if K == 2 else 1, steps=2, clip=clip, optim="adamw",
                             placement=placement, group_units=1 if placement == "host" else 0, rtol=RTOL["adamw"])
                for placement in ("device", "host")]
        _same(*runs)


@pytest.mark.parametrize("mode", ["deferred", "frozen"])
def test_batch_norm_modes_keep_their_buffers_on_the_device(mode):
    """BatchNorm's deferred and frozen modes (micro-batch: above) give host the device's state bit for bit."""
    out = {}
    for placement in ("device", "host"):
        plan = make_plan("batchnorm", "gpipe", 2, 2, 1, placement=placement,
                         group_units=1 if placement == "host" else 0)
        model = build("batchnorm")
        copies, plans = [copy.deepcopy(model) for _ in range(2)], [copy.deepcopy(plan) for _ in range(2)]

        def rank(comm, copies=copies, plans=plans):
            engine = _engine(comm, plans[comm.rank], copies[comm.rank], batch_norm=mode)
            return [engine.step(*data(plan.batch_size, step)) for step in range(2)], engine.state_dict()
        out[placement] = loopback.run(2, rank, timeout=30)[0]
    assert out["host"][0] == out["device"][0]
    assert all(torch.equal(v, out["host"][1][k]) for k, v in out["device"][1].items())


def _engine(comm, plan, model, **kwargs):
    return gems.Engine(model, plan, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss(), comm=comm, **kwargs)


def _watch(engine) -> dict:
    """Record, for every host stage of ``engine``: its parameters' device bytes after each action, and the
    resident groups at every unit's forward and at every gradient handed over in backward."""
    seen = {"after": [], "forward": [], "backward": []}
    for s, runner in engine.runners.items():
        weights = runner.weights
        resident = lambda w=weights: [g.index for g in w.groups if g.buffer is not None]   # noqa: E731
        for unit in runner.module:   # after the loading hook, registered first
            unit.register_forward_pre_hook(lambda *_, r=resident: seen["forward"].append(
                (torch._C._current_graph_task_id() != -1, r())))
        for group in weights.groups:
            for p in group.params:
                p.register_post_accumulate_grad_hook(lambda p, r=resident: seen["backward"].append(r()))
    run = engine.executor._run
    for op, fn in list(run.items()):
        def after(a, fn=fn):
            fn(a)
            seen["after"].append(sum(r.weights.device_bytes for r in engine.runners.values()))
        run[op] = after
    return seen


def test_a_group_is_on_the_device_only_while_its_units_run():
    """gpipe m = 2 on one rank, groups of one unit: between actions no parameter holds device storage; a
    forward's unit finds its own group alone on the device; in a backward (no recompute) one group at a
    time is; each forward and each backward moves every group once."""
    plan = make_plan("transparency", "gpipe", 1, 2, 1, placement="host", group_units=1)
    model = build("transparency")

    def rank(comm):
        engine = _engine(comm, copy.deepcopy(plan), copy.deepcopy(model))
        weights = engine.runners[0].weights
        assert weights.device_bytes == 0 and len(weights.groups) == 6
        assert engine.bucket.numel() == 0   # no statistics, and the gradients are not kept there
        assert all(p.grad is None for p in engine.stages[0].parameters())
        seen = _watch(engine)
        for step in range(2):
            engine.step(*data(plan.batch_size, step))
        before = engine.state_dict()
        images, labels = data(plan.batch_size, 2)
        engine.step(torch.full_like(images, float("nan")), labels)   # not finite: skipped, nothing moves
        assert not engine.last_step_applied
        assert all(torch.equal(v, before[k]) for k, v in engine.state_dict().items())
        assert weights.device_bytes == 0
        engine.step(images, labels)
        assert engine.last_step_applied and not all(torch.equal(v, before[k]) for k, v in engine.state_dict().items())
        actions = sum(a.op in (sch.FORWARD, sch.BACKWARD) for a in engine.actions)
        return seen, weights.loads, actions, weights.bytes_in, weights.bytes_out

    seen, loads, actions, bytes_in, bytes_out = loopback.run(1, rank, timeout=30)[0]
    assert seen["after"] and set(seen["after"]) == {0}
    units, steps = plan.cuts[-1], 4
    forwards = [r for inside, r in seen["forward"] if not inside]
    assert len(forwards) == steps * 2 * units and all(len(r) == 1 for r in forwards)
    assert forwards[:units] == [[u] for u in range(units)]
    assert seen["backward"] and all(len(r) <= 1 for r in seen["backward"])
    assert loads == steps * actions * units   # once per action per group
    params = sum(p.numel() * 4 for p in build("transparency").parameters())
    assert bytes_in == steps * actions * params and bytes_out == steps * 2 * params   # gradients: per backward


def test_a_saved_view_of_a_weight_holds_no_copy_of_its_group():
    """A linear layer saves ``weight.t()``, a view of its parameter, for backward: kept as is, it held the
    group's whole device buffer from each forward to its backward -- one copy of the group per
    micro-batch in flight (resnet18 64^2 on one rank, gpipe m = 4: 186 MiB measured against 110 priced).
    Packed like the parameter itself, gpipe m = 4 peaks no higher than m = 1 (8 MiB of weights in the head)."""
    def peak(m: int) -> int:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, 1024),
                              nn.ReLU(), nn.Linear(1024, 4))
        plan = partition.plan(model, (3, 16, 16), batch_size=4, stages=1, schedule="gpipe", micro_batches=m,
                              device="cpu", state_placement="host")
        def rank(comm):
            engine = _engine(comm, copy.deepcopy(plan), copy.deepcopy(model))
            images, labels = torch.randn(4, 3, 16, 16), torch.randint(0, 4, (4,))
            engine.step(images, labels)
            meter = memory.PeakMeter(engine.device)
            meter.start(memory.engine_tensors(engine))
            engine.step(images, labels)
            return meter.stop()
        return loopback.run(1, rank, timeout=30)[0]
    with memory.PeakMeter("cpu"):   # the profiler's one warning spent here, not in a rank
        pass
    assert peak(4) < peak(1) + 2**20


def test_recompute_and_split_backward_bring_groups_back_on_demand():
    """One rank, every unit recomputed, split backward: the parameters are still off the device between
    actions, and the step equals the device's bit for bit (the recomputation's loads counted)."""
    for policy, split in (("recompute", False), ("none", True)):
        runs = {}
        for placement in ("device", "host"):
            plan = make_plan("transparency", "1f1b", 1, 2, 1, policy=policy, split=split, placement=placement,
                             group_units=2 if placement == "host" else 0)
            model = build("transparency")

            def rank(comm, plan=plan, model=model):
                engine = _engine(comm, copy.deepcopy(plan), copy.deepcopy(model))
                seen = _watch(engine) if engine.runners[0].weights is not None else {"after": [0]}
                losses = [engine.step(*data(plan.batch_size, step)) for step in range(2)]
                return losses, engine.state_dict(), set(seen["after"])
            runs[placement] = loopback.run(1, rank, timeout=30)[0]
        assert runs["host"][2] == {0}
        assert runs["host"][0] == runs["device"][0]
        assert all(torch.equal(v, runs["host"][1][k]) for k, v in runs["device"][1].items())


def test_bf16_autocast_saves_the_cast_copy_and_stays_exact():
    """Under autocast the saved weight is the cast copy, an activation: host equals device bit for bit."""
    out = {}
    for placement in ("device", "host"):
        plan = make_plan("transparency", "1f1b", 1, 2, 1, placement=placement,
                         group_units=2 if placement == "host" else 0)
        model = build("transparency")

        def rank(comm, plan=plan, model=model):
            engine = _engine(comm, copy.deepcopy(plan), copy.deepcopy(model), autocast=torch.bfloat16)
            losses = [engine.step(*data(plan.batch_size, step)) for step in range(2)]
            return losses, engine.state_dict()
        out[placement] = loopback.run(1, rank, timeout=30)[0]
    assert out["host"][0] == out["device"][0]
    assert all(torch.equal(v, out["host"][1][k]) for k, v in out["device"][1].items())


def test_checkpoints_round_trip_across_placements():
    """The state and optimizer state written under host equal device's, and each resumes the other."""
    device, host = _checkpoint("device", range(2)), _checkpoint("host", range(2))
    assert device[0].keys() == host[0].keys() and device[0]
    assert all(torch.equal(v, host[1][k]) for k, v in device[1].items())
    for name, state in device[0].items():
        assert all(torch.equal(v, host[0][name][k]) for k, v in state.items() if torch.is_tensor(v)), name
    after = [_checkpoint(placement, [2], saved)[1] for placement, saved in (("host", device), ("device", host))]
    assert all(torch.equal(v, after[1][k]) for k, v in after[0].items())


def test_evaluation_runs_on_the_host_weights():
    plan = make_plan("transparency", "mp", 1, 1, 1, placement="host", group_units=2)
    model = build("transparency")

    def rank(comm):
        engine = _engine(comm, copy.deepcopy(plan), copy.deepcopy(model))
        images, _ = data(plan.batch_size, 0)
        out = engine.predict(images)
        assert engine.runners[0].weights.device_bytes == 0
        return out
    with torch.no_grad():
        expected = build("transparency")(data(plan.batch_size, 0)[0])
    assert torch.equal(loopback.run(1, rank, timeout=30)[0], expected)


def test_bad_weight_groups_and_compile_are_refused():
    plan = make_plan("transparency", "mp", 1, 1, 1, placement="host")
    n = plan.cuts[-1]
    for placement, groups, match in (("device", [[0, n]], "weight groups need state_placement \"host\""),
                                     ("host", [[0, 2], [3, n]], "do not cover its units"),
                                     ("host", [[0, 2]], "do not cover its units")):
        bad = dataclasses.replace(plan, policies=[dataclasses.replace(plan.policies[0], state_placement=placement,
                                                                      weight_groups=groups)])
        with pytest.raises(GemsError, match=match):
            bad.check()
    with pytest.raises(GemsError, match="--compile cannot run stages whose parameters live in host memory"):
        compiler.check(plan, "cpu")


def test_two_mpi_ranks():
    """mast K = 2 on two processes, AdamW sharded: host equals device bit for bit (MPI on the host copies)."""
    result = run_mpi(2, DISTRIBUTED / "host_weights_worker.py", timeout=120)
    assert "ok host weights" in result.stdout, result.tail()
