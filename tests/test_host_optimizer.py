"""``--state-placement host-optimizer``: the optimizer's state and update on the host, gradients copied
out after each stage's last backward and summed there, new parameters copied back
(``gems.pipeline.hostopt``). On CPU ranks the arithmetic is the device's, bit for bit, under every
schedule, sharded or not (on two MPI processes too: tests/test_engine.py); an optimizer without a host
implementation is refused."""
from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import gems
from gems.comm import loopback
from gems.errors import GemsError
from gems.obs import trace
from gems.pipeline import hostopt
from gems.pipeline.gradsync import GradSync
from gems.schedule import ir

from equivalence import adamw, build, data, make_plan, optimizer, run_loopback

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]
RTOL = {"sgd": 1e-5, "adamw": 1e-4}   # against one process


def _same(a, b) -> None:
    """Bit for bit: every rank's losses, the full state and this rank's copies."""
    assert [r.losses for r in a] == [r.losses for r in b]
    for ra, rb in zip(a, b):
        for key in ra.state:
            assert torch.equal(ra.state[key], rb.state[key]), key
        for key in ra.stage_state:
            assert torch.equal(ra.stage_state[key], rb.stage_state[key]), key


# pairwise: every schedule with both optimizers and sharded and not, every optimizer sharded and not
LAYOUTS = [("mp", 1), ("gpipe", 4), ("1f1b", 4), ("mast", 1)]


@pytest.mark.parametrize("schedule,m,optim,shard", [(schedule, m, optim, (i + (optim == "adamw")) % 2 == 1)
                                                   for i, (schedule, m) in enumerate(LAYOUTS)
                                                   for optim in ("sgd", "adamw")])
def test_host_optimizer_equals_device_bit_for_bit(schedule, m, optim, shard, monkeypatch):
    """K = 2, D = 2, three steps: SGD with momentum and AdamW, sharded or not (both near one process; Adam's
    division by the gradients' own scale makes the summation order's rounding count for more)."""
    held = _count_host_parts(monkeypatch)
    runs = [run_loopback("transparency", schedule, 2, m, 2, steps=3, optim=optim, shard=shard, placement=placement,
                         rtol=RTOL[optim]) for placement in ("device", "host-optimizer")]
    _same(*runs)
    assert len(held) == 2 * 2 * (1 + (schedule == "mast"))   # every rank's every stage, on the host run only


def _count_host_parts(monkeypatch) -> list:
    """The parts the host tier takes from now on (one entry each)."""
    held, add = [], hostopt.HostTier.add
    def counted(self, key, *args):
        held.append(key)
        return add(self, key, *args)
    monkeypatch.setattr(hostopt.HostTier, "add", counted)
    return held


def test_clipping_and_batchnorm_statistics_on_the_host():
    for kind, clip in (("transparency", 0.05), ("batchnorm", None)):
        runs = [run_loopback(kind, "mast", 2, 1, 2, steps=2, clip=clip, optim="adamw", placement=placement,
                             rtol=RTOL["adamw"])
                for placement in ("device", "host-optimizer")]
        _same(*runs)


def _engine(comm, plan, factory=optimizer, model=None):
    """An engine of the transparency model (``model``: its copy built in the main thread, which a rank thread
    must not seed)."""
    model = build("transparency") if model is None else model
    return gems.Engine(model, plan, optimizer=factory, loss_fn=nn.CrossEntropyLoss(), comm=comm)


def test_the_optimizer_holds_host_copies_and_the_trainer_s_writes_reach_them():
    """The optimizer's parameters are host copies, not the stages'; learning-rate writes and
    zero_grad act on them; a step that is not finite changes nothing."""
    plan = make_plan("transparency", "mp", 1, 1, 1, placement="host-optimizer")
    def rank(comm):
        engine = _engine(comm, copy.deepcopy(plan))
        held = {id(p) for s in engine.stages.values() for p in s.parameters()}
        params = [p for g in engine.optimizer.param_groups for p in g["params"]]
        assert params and not held & {id(p) for p in params}
        images, labels = data(plan.batch_size, 0)
        before = {k: v.clone() for k, v in engine.state_dict().items()}
        engine.step(torch.full_like(images, float("nan")), labels)
        assert not engine.last_step_applied
        assert all(torch.equal(before[k], v) for k, v in engine.state_dict().items())
        engine.optimizer.zero_grad()
        for g in engine.optimizer.param_groups:
            g["lr"] = 0.0
        engine.step(images, labels)
        assert engine.last_step_applied
        assert all(torch.equal(before[k], v) for k, v in engine.state_dict().items())   # lr 0: no change
        return True
    assert loopback.run(1, rank, timeout=20) == [True]


def test_the_host_update_runs_after_the_step_returns_with_the_learning_rate_it_was_given():
    """The update of a rank whose state lives on the host runs on a worker thread
    (``gems.pipeline.hostupdate``): ``engine.step`` returns before it does, and the learning rate written
    for the next step before the update has run does not reach it; bit for bit as on the device."""
    plan = make_plan("transparency", "mp", 1, 1, 1)
    rates = (0.05, 0.02, 0.01)

    def rank(comm, placement):
        engine = _engine(comm, copy.deepcopy(plan) if placement == "device" else
                         make_plan("transparency", "mp", 1, 1, 1, placement=placement))
        permits, held = threading.Semaphore(0), []

        def hold(optimizer, args, kwargs):   # on the host: each update waits for the rank's next lr write
            held.append((threading.current_thread().name, placement == "device" or permits.acquire(timeout=10)))
        engine.optimizer.register_step_pre_hook(hold)
        losses = []
        for i, rate in enumerate(rates):
            for g in engine.optimizer.param_groups:
                g["lr"] = rate
            if i:
                permits.release()   # step i-1's update runs now, after step i's rate was written
            losses.append(engine.step(*data(plan.batch_size, i)))
        permits.release()
        return losses, {k: v.clone() for k, v in engine.state_dict().items()}, held

    (device, expected, on_device), = loopback.run(1, rank, "device", timeout=20)
    (host, state, on_host), = loopback.run(1, rank, "host-optimizer", timeout=20)
    assert host == device and all(torch.equal(v, expected[k]) for k, v in state.items())
    assert [ok for _, ok in on_host] == [True] * 3
    assert {name.split("_")[0] for name, _ in on_host} == {"gems-host-update"}
    assert {name for name, _ in on_device} == {"loopback-rank-0"}


def test_a_host_optimizer_engine_on_parameters_a_device_engine_held_trains_as_on_fresh_ones():
    """A device engine's bucket hook (``gems.pipeline.gradplaces``) leaves the parameters when a later engine
    holds their state on the host: that engine trains bit for bit as one on a fresh copy of the model."""
    device = make_plan("transparency", "gpipe", 1, 2, 1)   # two micro-batches: two accumulations a step
    host = make_plan("transparency", "gpipe", 1, 2, 1, placement="host-optimizer")
    models = [build("transparency") for _ in range(2)]

    def rank(comm):
        losses = []
        for model, first in zip(models, (device, None)):
            if first is not None:
                _engine(comm, copy.deepcopy(first), model=model).step(*data(device.batch_size, 0))
                model.load_state_dict(build_state)   # the same start for both host engines
            engine = _engine(comm, copy.deepcopy(host), model=model)
            losses.append([engine.step(*data(host.batch_size, i)) for i in range(2)])
            losses[-1].append({k: v.clone() for k, v in engine.state_dict().items()})
        return losses

    build_state = {k: v.clone() for k, v in models[1].state_dict().items()}
    (after_device, fresh), = loopback.run(1, rank, timeout=20)
    assert after_device[:2] == fresh[:2]
    assert all(torch.equal(after_device[2][k], v) for k, v in fresh[2].items())


def test_device_gradients_exist_from_a_stage_s_first_backward_to_its_copy_out():
    """mast K = 2 (each rank holds two stages): no bucket for their gradients; a stage's device gradients
    are made at its first backward and dropped at its reduce (copied to the host then), whichever order
    the rank's two stages run in."""
    plan = make_plan("transparency", "mast", 2, 2, 1, placement="host-optimizer")
    def rank(comm):
        engine = _engine(comm, copy.deepcopy(plan))
        assert engine.bucket.numel() == 0   # the model has no BatchNorm statistics to carry
        seen = []
        def alive() -> tuple[int, ...]:
            return tuple(s for s, m in sorted(engine.stages.items()) if any(p.grad is not None for p in m.parameters()))
        def logged(run):
            def wrapped(a):
                run(a)
                seen.append((a, alive()))
            return wrapped
        runs = engine.executor._run
        for op in list(runs):
            runs[op] = logged(runs[op])
        images, labels = data(plan.batch_size, 0)
        for _ in range(2):
            assert alive() == ()
            seen.clear()
            engine.step(images, labels)
        for s in engine.stages:
            first = next(i for i, (a, _) in enumerate(seen) if a.stage == s and a.op in ir.GRADIENT)
            reduce = next(i for i, (a, _) in enumerate(seen) if a.stage == s and a.op == ir.REDUCE)
            assert [s in held for _, held in seen] == [first <= i < reduce for i in range(len(seen))]
        return True
    assert loopback.run(2, rank, timeout=20) == [True, True]


def test_a_copy_still_running_at_its_reduce_is_summed_once_it_arrives(monkeypatch):
    """CUDA's copies out complete after the reduce action that starts them: the host sum of such a part is
    posted between later compute actions once its copy has arrived (``GradSync.progress``), in the schedule's
    order, the rest at the sync -- as CPU ranks run here with the copies taken for asynchronous: bit for bit
    as device, and the first stage to finish its backward summed before the sync."""
    monkeypatch.setattr(hostopt.HostTier, "asynchronous", property(lambda self: bool(self._parts)))
    posted = []
    issue, sync = GradSync._issue, GradSync.sync
    def issued(self, key):
        posted.append((key, self._syncing))
        return issue(self, key)
    def syncing(self, loss):
        self._syncing = True
        try:
            return sync(self, loss)
        finally:
            self._syncing = False
    monkeypatch.setattr(GradSync, "_syncing", False, raising=False)
    monkeypatch.setattr(GradSync, "_issue", issued)
    monkeypatch.setattr(GradSync, "sync", syncing)
    host = run_loopback("transparency", "mast", 2, 1, 2, steps=3, optim="adamw", placement="host-optimizer",
                        rtol=RTOL["adamw"])
    early = [key for key, at_sync in posted if not at_sync]
    assert early and len(early) < len(posted)   # some before the sync, some at it
    _same(host, run_loopback("transparency", "mast", 2, 1, 2, steps=3, optim="adamw", placement="device",
                             rtol=RTOL["adamw"]))


def test_an_optimizer_without_a_host_implementation_is_refused():
    class Custom(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

    plan = make_plan("transparency", "mp", 1, 1, 1, placement="host-optimizer")
    def rank(comm):
        with pytest.raises(GemsError, match="the optimizer Custom has no host implementation"):
            _engine(comm, copy.deepcopy(plan), Custom)
        return True
    assert loopback.run(1, rank, timeout=20) == [True]


def _checkpoint(placement: str, steps, load=None) -> tuple[dict, dict]:
    """Two loopback ranks, mast K = 2, AdamW: (optimizer state by parameter name, model state) after
    ``steps`` (from ``load``, such a pair)."""
    plan, model = make_plan("transparency", "mast", 2, 1, 1, placement=placement), build("transparency")
    def rank(comm):
        engine = _engine(comm, copy.deepcopy(plan), adamw, copy.deepcopy(model))
        if load is not None:
            engine.load_state(load[1], copy.deepcopy(load[0]))
        for step in steps:
            engine.step(*data(plan.batch_size, step))
        return engine.stage_state(engine.position)["optimizer"], engine.state_dict()
    results = loopback.run(2, rank, timeout=30)
    return {n: st for opt, _ in results for n, st in opt.items()}, results[0][1]


def test_checkpoints_are_the_same_on_either_placement_and_each_resumes_the_other():
    device, host = _checkpoint("device", range(2)), _checkpoint("host-optimizer", range(2))
    assert device[0].keys() == host[0].keys() and device[0]
    for name, state in device[0].items():
        assert all(torch.equal(v, host[0][name][k]) for k, v in state.items() if torch.is_tensor(v)), name
    after = [_checkpoint(placement, [2], saved)[1] for placement, saved in (("host-optimizer", device),
                                                                            ("device", host))]
    assert all(torch.equal(v, after[1][k]) for k, v in after[0].items())


@pytest.mark.parametrize("placement, inside", [
    ("host-optimizer", {"copy-out", "host-update", "copy-back"}),
    ("host", {"weights-in", "grads-out", "host-update"})])
def test_the_host_tier_s_copies_and_update_are_spans_inside_their_actions(placement, inside):
    """The step's timeline (traces, gems-bench) shows the host tier's work as spans of their own kinds,
    each inside the action that does it, which the busy time does not count twice. The update runs on the
    host's worker (``gems.pipeline.hostupdate``): its span is the wait for it, and the copy back after it, in
    the next step's first compute action."""
    plan = make_plan("transparency", "mp", 1, 1, 1, placement=placement)

    def rank(comm):
        engine = _engine(comm, copy.deepcopy(plan))
        engine.step(*data(plan.batch_size, 0))
        engine.step(*data(plan.batch_size, 1))
        return engine.timeline()
    spans = loopback.run(1, rank, timeout=20)[0]
    mine = [(label, a, b) for label, a, b in spans if label.split(" ", 1)[0] in inside]
    assert {label.split(" ", 1)[0] for label, _, _ in mine} == inside, spans
    assert {trace.kind(label) for label, _, _ in mine} <= {"host copy", "host update"}
    actions = [(a, b) for label, a, b in spans if trace.kind(label) not in trace.INSIDE]
    assert all(any(a0 <= a and b <= b0 for a0, b0 in actions) for _, a, b in mine), spans
    assert trace.busy_seconds(spans) == trace.busy_seconds([s for s in spans if s not in mine])
