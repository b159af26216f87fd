"""Compiled stages (gems.pipeline.compiled): stages compiled before the first step train as eager does.

Each layout trains a tiny model of tests/equivalence.py for 3 steps on loopback ranks with every unit
compiled (fixed shapes, one graph per run of units), under a memory policy, and compares the state
and losses with eager within 1e-4 (fp32): with one process for the model without BatchNorm, with the
eager engine on the same layout for the one with BatchNorm (whose statistics depend on the layout).
Every rank then reports 0 recompiles: its units compiled in the warm-up and never again. The
module's runs share one compile cache; the layouts are few, each covering several things (a schedule,
D, a policy, a BatchNorm mode), since each compiles. What gems does with a compiled run -- warm-ups,
guards, variants, recompiles, fallbacks -- is dynamo's and AOTAutograd's side, whatever generates the
code: the tests compile with ``aot_eager`` (the same graphs, run by the eager kernels: seconds, not
inductor's C++ code generation, 20-30 s for even one graph here; ``GEMS_TEST_COMPILE_BACKEND=inductor``
runs them all with inductor). Real runs compile with inductor, as do gems-bench's recipe runs
(benchmarks/README.md) and ``make gpu-check``'s.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import gems
import gems.pipeline.offload
from gems import partition
from gems.comm import loopback
from gems.errors import GemsError
from gems.pipeline import compiled, compiler

import equivalence as eq

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE",
                   "TRITON_CACHE_DIR")


@pytest.fixture(autouse=True)
def graphs_run_eagerly(monkeypatch):
    """dynamo and AOTAutograd as in a real run, the graphs run by eager kernels (module docstring);
    ``GEMS_TEST_COMPILE_BACKEND=inductor`` runs every test with inductor."""
    monkeypatch.setattr(compiled, "BACKEND", os.environ.get("GEMS_TEST_COMPILE_BACKEND", "aot_eager"))


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """One compile cache for the module's runs; the process's settings put back afterwards."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    saved = {name: os.environ.get(name) for name in CACHE_VARIABLES}
    flags = inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache
    yield compiler.use_cache(tmp_path_factory.mktemp("compile-cache"))
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache = flags


def train(kind: str, schedule: str, K: int, m: int, D: int, policy: str, batch_norm: str, compile: bool,
          evaluate: bool = False, autocast: torch.dtype | None = None, steps: int = 3) -> list[dict]:
    """Every rank's losses, full state, recompiles after ``steps`` steps (and the evaluation loss) on K x D
    loopback ranks."""
    models, plans = eq.per_rank(kind, schedule, K, m, D, policy=policy)

    def rank(comm):
        engine = gems.Engine(models[comm.rank], plans[comm.rank], optimizer=eq.optimizer,
                             loss_fn=nn.CrossEntropyLoss(), comm=comm, batch_norm=batch_norm, compile=compile,
                             autocast=autocast)
        losses = [engine.step(*eq.data(plans[0].batch_size, step)) for step in range(steps)]
        result = {"losses": losses, "state": engine.state_dict(), "compiled": engine.compiled}
        if evaluate:
            result["evaluated"] = engine.evaluate([eq.data(plans[0].batch_size, 9)])["loss"]
        return result
    return loopback.run(K * D, rank, timeout=120)


# (kind, schedule, K, m, D, policy, batch_norm): mp, gpipe m=4, 1f1b m=4, mast K=2 with D=2; every
# policy; deferred BatchNorm under recompute (its flag), micro-batch BatchNorm under offload
LAYOUTS = [("transparency", "mp", 2, 1, 1, "segment", "micro-batch"),
           ("batchnorm", "gpipe", 2, 4, 1, "recompute", "deferred"),
           ("batchnorm", "1f1b", 2, 4, 1, "offload", "micro-batch"),
           ("transparency", "mast", 2, 1, 2, "recompute+offload", "micro-batch")]


@pytest.mark.parametrize("kind,schedule,K,m,D,policy,batch_norm", [pytest.param(*c, id="-".join(map(str, c[1:6])))
                                                                   for c in LAYOUTS])
def test_compiled_stages_train_like_eager(kind, schedule, K, m, D, policy, batch_norm, monkeypatch):
    monkeypatch.setattr(gems.pipeline.offload, "MIN_OFFLOAD_BYTES", 1)   # these activations are tiny
    evaluate = schedule == "mp"   # forward-only steps: their own variant, warmed when first made
    results = train(kind, schedule, K, m, D, policy, batch_norm, compile=True, evaluate=evaluate)
    where = f"compiled {eq.describe(kind, schedule, K, D, m, policy=policy)} ({batch_norm})"
    if kind == "batchnorm":
        eager = train(kind, schedule, K, m, D, policy, batch_norm, compile=False)[0]
        ref_state, ref_losses = eager["state"], eager["losses"]
    else:
        ref_state, ref_losses, _ = eq.reference(kind, eq.batch_size(schedule, m, D), 3)
    eq.check_reference(where, results[0]["state"], results[0]["losses"], ref_state, ref_losses, rtol=1e-4)
    for r in results:
        units = r["compiled"]
        assert units.units and not units.eager and units.recompiles == 0, (units.units, units.eager, units.recompiles)
    if evaluate:
        eager = train(kind, schedule, K, m, D, policy, batch_norm, compile=False, evaluate=True)[0]
        assert results[0]["evaluated"] == pytest.approx(eager["evaluated"], rel=1e-4)


def test_forward_only_steps_compile_their_variant_alone():
    """An engine that only evaluates (gems-predict) compiles no training variant: one graph per run."""
    compiled_run, = train("transparency", "mp", 1, 1, 1, "none", "micro-batch", compile=True, evaluate=True, steps=0)
    eager, = train("transparency", "mp", 1, 1, 1, "none", "micro-batch", compile=False, evaluate=True, steps=0)
    units = compiled_run["compiled"]
    assert len(units.runs) == 1 and units.graphs == 1 and units.recompiles == 0
    assert compiled_run["evaluated"] == pytest.approx(eager["evaluated"], rel=1e-5)


def test_under_autocast_nothing_recompiles(monkeypatch):
    """bf16 autocast and recompute: each unit's variant under autocast compiles in the warm-up. A
    recompile is a guard of dynamo's failing, the same whichever backend compiles the graphs, so the
    module's aot_eager serves. One rank: with several
    loopback ranks, a thread tracing under autocast and another casting eagerly deadlock on autocast's
    cast cache in torch 2.14 (one process per rank never meets it). The losses agree to bf16's precision
    (a compiled graph may keep intermediates in fp32)."""
    compiled_run, = train("transparency", "gpipe", 1, 2, 1, "recompute", "micro-batch", compile=True,
                          autocast=torch.bfloat16)
    eager, = train("transparency", "gpipe", 1, 2, 1, "recompute", "micro-batch", compile=False,
                   autocast=torch.bfloat16)
    assert compiled_run["compiled"].recompiles == 0 and not compiled_run["compiled"].eager
    assert compiled_run["losses"] == pytest.approx(eager["losses"], rel=1e-2)


def test_tiled_units_stay_eager_and_the_leaders_others_compile():
    """A spatial part (units [0, 3) on tiles of 2 ranks): the tiled units exchange halos, so they run
    eagerly; the leader's units after them compile, warmed on the gathered values' metadata."""
    torch.manual_seed(0)
    model = eq.tiny(batchnorm=False)
    plan = partition.plan(model, (3, eq.SIDE, eq.SIDE), 2, 1, "mp", spatial=2, spatial_end=3)

    def rank(comm):
        engine = gems.Engine(copy.deepcopy(model), copy.deepcopy(plan), optimizer=eq.optimizer,
                             loss_fn=nn.CrossEntropyLoss(), comm=comm, compile=True)
        losses = [engine.step(*eq.data(2, step)) for step in range(3)]
        return losses, engine.state_dict(), engine.compiled
    leader, member = loopback.run(2, rank, timeout=120)
    assert (sorted(leader[2].units), leader[2].tiled, sorted(member[2].units)) == ([3, 4, 5], [0, 1, 2], [])
    assert leader[2].recompiles == member[2].recompiles == 0
    ref_state, ref_losses, _ = eq.reference("transparency", 2, 3)
    eq.check_reference("compiled with a spatial part", leader[1], leader[0], ref_state, ref_losses, rtol=1e-4)


class Breaks(nn.Module):
    """A unit torch.compile cannot take as one graph (a graph break), eagerly a plain block."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        torch._dynamo.graph_break()
        return torch.relu(self.conv(x))


def test_a_unit_that_does_not_compile_runs_eagerly_named_once(capsys):
    torch.manual_seed(0)
    model = eq.tiny(batchnorm=False)
    model[2] = Breaks()
    plan = partition.plan(model, (3, eq.SIDE, eq.SIDE), 2, 1, "mp")
    reference = copy.deepcopy(model)
    x, y = eq.data(2, 0)

    def rank(comm):
        engine = gems.Engine(model, plan, optimizer=eq.optimizer, loss_fn=nn.CrossEntropyLoss(), comm=comm,
                             compile=True)
        return engine.compiled, engine.step(x, y)
    [(units, loss)] = loopback.run(1, rank, timeout=120)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "eagerly" in line]
    assert len(lines) == 1 and "unit 2 (2)" in lines[0] and "graph_break" in lines[0].lower(), out
    assert sorted(units.units) == [0, 1, 3, 4, 5] and list(units.eager) == [2] and units.recompiles == 0
    assert loss == pytest.approx(nn.functional.cross_entropy(reference(x), y).item(), rel=1e-5)


def test_compiled_plans_never_split_the_backward():
    model = eq.tiny(batchnorm=False)
    auto = partition.plan(model, (3, eq.SIDE, eq.SIDE), 4, 2, "1f1b", 2, split_backward=None, compile=True)
    assert auto.compiled and not auto.split_backward
    assert any("one autograd node" in note for note in auto.notes)
    with pytest.raises(GemsError, match="drop --split-backward"):
        partition.plan(model, (3, eq.SIDE, eq.SIDE), 4, 2, "1f1b", 2, split_backward=True, compile=True)
    split = partition.plan(model, (3, eq.SIDE, eq.SIDE), 4, 2, "1f1b", 2, split_backward=True)
    with pytest.raises(GemsError, match="make the plan with --compile"):
        loopback.run(2, lambda comm: gems.Engine(copy.deepcopy(model), copy.deepcopy(split), optimizer=eq.optimizer,
                                                 loss_fn=nn.CrossEntropyLoss(), comm=comm, compile=True))


def test_without_a_cpp_compiler_one_sentence(monkeypatch):
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "cxx", (None, "/nonexistent/c++"))
    with pytest.raises(GemsError) as error:
        compiler.check_backend("cpu")
    message = str(error.value)
    assert "C++ compiler" in message and "/nonexistent/c++" in message and "drop --compile" in message
    assert message.count(". ") == 0 and "\n" not in message
