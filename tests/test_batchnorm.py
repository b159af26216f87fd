"""BatchNorm modes (gems.pipeline.batchnorm), each against the one-process result it promises.

- ``deferred``: parameters, running statistics, ``num_batches_tracked`` and losses equal one
  process that runs the same micro-batches one after another (each normalised with its own
  statistics, running statistics written nothing) and then updates the running statistics once
  from the whole global batch -- for every schedule, K, m and D, under recomputation too;
- ``frozen``: running statistics never change, and training equals one process with its
  BatchNorm layers in eval mode on the whole global batch;
- ``micro-batch`` (today's behaviour, also covered by tests/test_equivalence.py): the rule
  the module docstring states, the middle stage of ``mast`` with odd K included;
- a step whose loss is not finite leaves every buffer as it was, in every mode.

Everything runs in process on loopback ranks (tests/equivalence.py's tiny model, side 16).
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch import nn

import gems
import gems.pipeline.offload
from gems.cli.train import parse
from gems.comm import loopback
from gems.errors import GemsError
from gems.pipeline.batchnorm import MODES, BatchNorms
from gems.schedule import generators as sch
from gems.schedule.generators import SCHEDULES
from gems.train.config import TrainConfig

from equivalence import (SIDE, Mismatch, build, check_copies, check_reference, count_unit_calls, data, describe,
                         expected_unit_calls, make_plan, optimizer, per_rank)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

ROWS = 2   # images per micro-batch (equivalence.batch_size's default)


# ---------------------------------------------------------------- one process
def _batchnorms(model: nn.Module) -> list[nn.BatchNorm2d]:
    return [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]


@functools.lru_cache(maxsize=None)
def deferred_reference(batch: int, steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process: each step runs the global batch's micro-batches (``ROWS`` consecutive rows,
    as gems.pipeline.batches cuts them) one after another, each normalised with its own
    statistics and writing no running statistics; float64 Σx, Σx², counts of every BatchNorm
    input are kept, and after the optimizer step the running statistics are updated once from
    them (unbiased variance, momentum 0.1). Written without gems' code on purpose."""
    model = build("batchnorm")
    opt = optimizer(model.parameters())
    layers = _batchnorms(model)
    sums: dict[nn.Module, list] = {}

    def record(layer, args):
        x = args[0].detach().double()
        s = sums.setdefault(layer, [0.0, 0.0, 0])
        s[0] = s[0] + x.sum((0, 2, 3))
        s[1] = s[1] + (x * x).sum((0, 2, 3))
        s[2] += x.numel() // x.shape[1]

    for layer in layers:
        layer.register_forward_pre_hook(record)
    losses = []
    for step in range(steps):
        x, y = data(batch, step)
        sums.clear()
        opt.zero_grad()
        total = 0.0
        for layer in layers:
            layer.track_running_stats = False   # batch statistics, nothing written
        for i in range(0, batch, ROWS):
            loss = nn.functional.cross_entropy(model(x[i:i + ROWS]), y[i:i + ROWS]) * ROWS / batch
            loss.backward()
            total += loss.item()
        opt.step()
        with torch.no_grad():
            for layer in layers:
                layer.track_running_stats = True
                s1, s2, n = sums[layer]
                mean = s1 / n
                var = (s2 - n * mean * mean) / (n - 1)
                layer.num_batches_tracked += 1
                layer.running_mean.copy_(0.9 * layer.running_mean.double() + 0.1 * mean)
                layer.running_var.copy_(0.9 * layer.running_var.double() + 0.1 * var)
        losses.append(total)
    return model.state_dict(), losses


@functools.lru_cache(maxsize=None)
def frozen_reference(batch: int, steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, BatchNorm in eval mode, the whole global batch at once."""
    model = build("batchnorm")
    for layer in _batchnorms(model):
        layer.eval()
    opt = optimizer(model.parameters())
    losses = []
    for step in range(steps):
        x, y = data(batch, step)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


# ---------------------------------------------------------------- loopback ranks
@dataclasses.dataclass
class Ran:
    rank: int
    losses: list[float]
    applied: list[bool]
    states: list[dict[str, torch.Tensor]]   # full state dict before the first step and after each
    stage_state: dict[str, torch.Tensor]    # this rank's own copies at the end
    calls: list[int]
    expected_calls: list[int]               # per step, by the recompute rule
    forwarded: int                          # unit forwards per step, recomputation aside
    counts: list[float]                     # deferred: per layer, elements summed in the last step


def _train(comm, copies, plans, mode: str, steps: int, poison: int | None, retrain: bool) -> Ran:
    """Train this rank's copy for ``steps`` steps under ``mode``; step ``poison`` gets a NaN
    image; ``retrain``: call ``train()`` on the stages before every step."""
    plan = plans[comm.rank]
    engine = gems.Engine(copies[comm.rank], plan, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss(),
                         comm=comm, batch_norm=mode)
    calls = count_unit_calls(engine)
    losses, applied, states = [], [], [engine.state_dict()]
    for step in range(steps):
        if retrain:
            for stage in engine.stages.values():
                stage.train()
        images, labels = data(plan.batch_size, step)
        if step == poison:
            images[0, 0, 0, 0] = float("nan")
        losses.append(engine.step(images, labels))
        applied.append(engine.last_step_applied)
        states.append(engine.state_dict())
    return Ran(comm.rank, losses, applied, states,
               {k: v.detach().clone() for s in engine.stages.values() for k, v in s.state_dict().items()},
               calls, expected_unit_calls(engine),
               sum(plan.cuts[a.stage + 1] - plan.cuts[a.stage] for a in engine.actions if a.op == sch.FORWARD),
               # the tiny model's layers all have 8 channels: Σx, Σx², count = 17 entries each
               [c for _, norms in engine.grads.batch_norms for c in norms.sums.view(-1, 17)[:, -1].tolist()])


def run(mode: str, schedule: str, K: int, m: int, D: int, steps: int = 2, policy: str = "none",
        poison: int | None = None, retrain: bool = False) -> list[Ran]:
    """Train on K x D loopback ranks; check the recompute rule, equal losses on every rank and
    every copy of every entry identical."""
    copies, plans = per_rank("batchnorm", schedule, K, m, D, policy=policy)
    results = loopback.run(K * D, _train, copies, plans, mode, steps, poison, retrain, timeout=20)
    where = describe("batchnorm", schedule, K, D, m, policy=policy) + f" batch_norm={mode}"
    for r in results:
        if r.calls != [steps * n for n in r.expected_calls]:
            raise Mismatch(f"{where}: rank {r.rank} ran its units {r.calls} times, the rule says "
                           f"{[steps * n for n in r.expected_calls]}")
        if not torch.allclose(torch.tensor(r.losses), torch.tensor(results[0].losses), rtol=0, atol=0,
                              equal_nan=True):
            raise Mismatch(f"{where}: rank {r.rank} reports losses {r.losses}, rank 0 {results[0].losses}")
    check_copies(where, results[0].states[-1], [r.stage_state for r in results])
    return results


def layouts(Ks=(1, 2, 3), ms=(1, 2), Ds=(1, 2)) -> list:
    return [pytest.param(s, K, m, D, id=f"{s}-K{K}-m{m}-D{D}")
            for K in Ks for s in SCHEDULES for m in ms for D in Ds if not (s == "mp" and m > 1)]


def batch(schedule: str, m: int, D: int) -> int:
    return D * sch.replicas(schedule) * m * ROWS


# ---------------------------------------------------------------- deferred
@pytest.mark.parametrize("schedule,K,m,D", layouts())
def test_deferred_equals_one_process_running_the_micro_batches_in_turn(schedule, K, m, D):
    results = run("deferred", schedule, K, m, D)
    ref_state, ref_losses = deferred_reference(batch(schedule, m, D), 2)
    check_reference(describe("batchnorm", schedule, K, D, m) + " deferred", results[0].states[-1],
                    results[0].losses, ref_state, ref_losses)


@pytest.mark.parametrize("schedule,K,m,D", [("mast", 2, 2, 1), ("mast", 3, 2, 2), ("1f1b", 3, 2, 1),
                                            ("gpipe", 2, 2, 2)])
@pytest.mark.parametrize("policy", ["recompute", "segment", "recompute+offload"])
def test_deferred_counts_a_recomputed_micro_batch_once(policy, schedule, K, m, D, monkeypatch):
    monkeypatch.setattr(gems.pipeline.offload, "MIN_OFFLOAD_BYTES", 1)
    results = run("deferred", schedule, K, m, D, policy=policy)
    assert any(sum(r.expected_calls) > r.forwarded for r in results), "nothing was recomputed"
    assert any(r.counts for r in results)
    for r in results:   # every layer summed each pixel of the global batch once
        assert set(r.counts) <= {batch(schedule, m, D) * SIDE * SIDE}, f"rank {r.rank}: {r.counts}"
    ref_state, ref_losses = deferred_reference(batch(schedule, m, D), 2)
    check_reference(describe("batchnorm", schedule, K, D, m, policy=policy) + " deferred",
                    results[0].states[-1], results[0].losses, ref_state, ref_losses)


def test_one_rule_for_every_stage_under_mast_with_odd_K():
    """K = 3: the middle position holds one copy of stage 1, which forwards both replicas'
    micro-batches; stages 0 and 2 have two copies of m each. Micro-batch mode counts 2m updates
    on the middle stage and m elsewhere; deferred mode one per step everywhere."""
    m, steps = 2, 2
    cuts = make_plan("batchnorm", "mast", 3, m, 1).cuts

    def tracked(ran: Ran) -> dict[int, int]:
        state = ran.states[-1]
        return {s: {int(state[k]) for k in state if k.endswith("num_batches_tracked")
                    and cuts[s] <= int(k.split(".")[0]) < cuts[s + 1]}.pop() for s in range(3)}

    assert tracked(run("micro-batch", "mast", 3, m, 1, steps)[0]) == {0: m * steps, 1: 2 * m * steps, 2: m * steps}
    assert tracked(run("deferred", "mast", 3, m, 1, steps)[0]) == {0: steps, 1: steps, 2: steps}


def test_deferred_update_is_pytorchs_for_one_batch_of_the_total():
    """Two micro-batches through a deferred layer, then the update: the running statistics of
    one PyTorch BatchNorm fed both at once, for a momentum and for the cumulative average."""
    for momentum in (0.1, None):
        torch.manual_seed(0)
        layer, plain = nn.BatchNorm2d(3, momentum=momentum), nn.BatchNorm2d(3, momentum=momentum)
        norms = BatchNorms([layer], "deferred", torch.device("cpu"))
        for _ in range(2):   # steps
            a, b = torch.randn(2, 3, 4, 4) * 3 + 1, torch.randn(3, 3, 4, 4)
            norms.begin_step()
            for x in (a, b):
                torch.testing.assert_close(layer(x), nn.functional.batch_norm(x, None, None, training=True))
            assert int(layer.num_batches_tracked) == int(plain.num_batches_tracked)   # nothing written yet
            norms.update()
            plain(torch.cat([a, b]))
            torch.testing.assert_close(layer.running_mean, plain.running_mean)
            torch.testing.assert_close(layer.running_var, plain.running_var)
            assert int(layer.num_batches_tracked) == int(plain.num_batches_tracked)


def test_deferred_leaves_a_layer_in_eval_mode_alone():
    layer = nn.BatchNorm2d(3).eval()
    layer.running_mean.fill_(0.5)
    norms = BatchNorms([layer], "deferred", torch.device("cpu"))
    x = torch.randn(2, 3, 4, 4)
    torch.testing.assert_close(layer(x), (x - 0.5) / torch.sqrt(torch.tensor(1 + layer.eps)))
    assert not norms.sums.any()
    norms.update()
    assert int(layer.num_batches_tracked) == 0


# ---------------------------------------------------------------- frozen
@pytest.mark.parametrize("schedule,K,m,D", [("mast", 2, 2, 2), ("mast", 3, 1, 1), ("1f1b", 3, 2, 1),
                                            ("gpipe", 2, 2, 2), ("mp", 2, 1, 1)])
def test_frozen_trains_like_one_process_in_eval_mode(schedule, K, m, D):
    """Even when the stages are put back in training mode before every step."""
    results = run("frozen", schedule, K, m, D, retrain=True)
    ref_state, ref_losses = frozen_reference(batch(schedule, m, D), 2)
    check_reference(describe("batchnorm", schedule, K, D, m) + " frozen", results[0].states[-1],
                    results[0].losses, ref_state, ref_losses)
    first, last = results[0].states[0], results[0].states[-1]
    for k in first:
        if "running" in k or k.endswith("num_batches_tracked"):
            assert torch.equal(first[k], last[k]), f"{k} changed"


# ---------------------------------------------------------------- every mode
@pytest.mark.parametrize("mode", MODES)
def test_a_skipped_step_leaves_no_trace(mode):
    results = run(mode, "mast", 3, 2, 2, steps=3, poison=1)
    for r in results:
        assert r.applied == [True, False, True]
    before, after = results[0].states[1], results[0].states[2]
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed in the skipped step"
    assert not torch.equal(results[0].states[3]["0.0.weight"], before["0.0.weight"])   # trains on


def test_an_unknown_mode_is_one_sentence():
    plan = make_plan("batchnorm", "mp", 1, 1, 1)
    with pytest.raises(GemsError, match="'micro-batch'.*'deferred'.*'frozen'.*got 'sync'"):
        gems.Engine(build("batchnorm"), plan, optimizer, nn.CrossEntropyLoss(), comm=None, batch_norm="sync")


def test_gems_train_takes_the_modes():
    field = {f.name: f for f in dataclasses.fields(TrainConfig)}["batch_norm"]
    assert field.metadata["choices"] == MODES and field.default == "micro-batch"
    assert parse(["--batch-norm", "deferred"]).batch_norm == "deferred"
    with pytest.raises(SystemExit):
        parse(["--batch-norm", "sync"])
