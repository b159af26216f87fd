"""The Engine's promises about misuse and failure, on loopback ranks (one thread per rank).

- ``engine.optimizer.zero_grad()`` is safe (it zeroes the gradient bucket in place); replacing a
  parameter's ``.grad`` makes the next step raise GemsError before it communicates.
- Bad input (the wrong rows) raises GemsError before the step communicates, and the engine
  stays usable.
- An exception once a step communicates ends the job: every rank stops, none hangs, and the
  caller sees the original exception.
- A step whose loss is not finite is skipped and leaves no trace.
"""
from __future__ import annotations

import copy
import math
import threading
import time

import pytest
import torch
from torch import nn

import gems
from gems.comm import loopback
from gems.comm.loopback import Aborted, PeerFailed
from gems.errors import GemsError

from equivalence import batch_size, build, check_reference, data, optimizer, per_rank, reference, run_loopback

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

COMM_CALLS = ("isend", "irecv", "ibatch", "iallreduce", "ibroadcast", "iallgather_bytes", "iallgather_runs", "ibarrier")


def make_engine(comm, copies, plans, **kwargs) -> gems.Engine:
    return gems.Engine(copies[comm.rank], plans[comm.rank], optimizer=optimizer, loss_fn=nn.CrossEntropyLoss(),
                       comm=comm, **kwargs)


def count_comm(comm) -> dict[str, int]:
    """Count this rank's communication calls from now on (``counts["calls"]``)."""
    counts = {"calls": 0}
    for name in COMM_CALLS:
        method = getattr(comm, name)

        def counted(*args, _method=method, **kwargs):
            counts["calls"] += 1
            return _method(*args, **kwargs)
        setattr(comm, name, counted)
    return counts


def snapshot(engine: gems.Engine) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers, and its optimizer's momentum, by name."""
    state = {k: v.detach().clone() for s in engine.stages.values() for k, v in s.state_dict().items()}
    for i, st in engine.optimizer.state_dict()["state"].items():
        state.update({f"optimizer.{i}.{k}": v.clone() for k, v in st.items() if torch.is_tensor(v)})
    return state


def assert_equal_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], where: str = "") -> None:
    assert list(a) == list(b), where
    for k in a:
        assert torch.equal(a[k], b[k]), f"{where}{k} differs"


# ---------------------------------------------------------------- zero_grad and .grad
@pytest.mark.parametrize("schedule,D", [("mast", 1), ("1f1b", 2)])
def test_zero_grad_is_safe(schedule, D):
    """zero_grad() (set_to_none=True by default) before and after every step trains exactly as
    without it: the gradients stay views of the bucket, so the allreduce still sums them."""
    K, m = 2, 2
    copies, plans = per_rank("transparency", schedule, K, m, D)
    batch = batch_size(schedule, m, D)

    def rank(comm):
        engine = make_engine(comm, copies, plans)
        views = [p.grad for s in engine.stages.values() for p in s.parameters()]
        losses = []
        for step in range(3):
            engine.optimizer.zero_grad()
            losses.append(engine.step(*data(batch, step)))
            engine.optimizer.zero_grad(set_to_none=True)
        assert all(p.grad is v for p, v in zip((p for s in engine.stages.values() for p in s.parameters()), views))
        return losses, engine.state_dict()

    with_zero_grad = loopback.run(K * D, rank)
    without = run_loopback("transparency", schedule, K, m, D, steps=3)
    for (losses, state), plain in zip(with_zero_grad, without):
        assert losses == plain.losses
        assert_equal_states(state, plain.state)


@pytest.mark.parametrize("schedule,D,split", [("1f1b", 2, False), ("mast", 1, True)])
def test_after_a_step_grad_holds_its_summed_gradients(schedule, D, split):
    """``.grad`` after a step: the step's gradients summed over the copies, in the bucket (its view), as
    one process's ``loss.backward()`` leaves them -- each step's first gradient is copied over the last
    step's, with and without a split backward (whose weight half accumulates outside autograd's engine);
    a parameter no gradient reached holds zeros. A second engine on the same parameters takes them over."""
    K, m = 2, 2
    copies, plans = per_rank("transparency", schedule, K, m, D, split=split)
    batch = batch_size(schedule, m, D)
    unused = nn.Linear(2, 2)   # in no forward

    def rank(comm):
        copies[comm.rank][0][0].add_module("unused", copy.deepcopy(unused))   # held by a convolution
        make_engine(comm, copies, plans)   # its hooks on the same parameters are replaced by the next engine's
        engine = make_engine(comm, copies, plans)
        views = {n: p.grad for s in engine.stages.values() for n, p in s.named_parameters()}
        for step in range(2):
            engine.step(*data(batch, step))
            for n, p in (x for s in engine.stages.values() for x in s.named_parameters()):
                if step == 0 and "unused" in n:
                    p.grad.fill_(1.0)   # what the next step must not leave there
        grads = {}
        for s, stage in engine.stages.items():
            for n, p in stage.named_parameters():
                assert p.grad is views[n], n
            grads[s] = [p.grad.clone() for n, p in stage.named_parameters() if "unused" not in n]
            grads[s, "unused"] = [p.grad.clone() for n, p in stage.named_parameters() if "unused" in n]
        return grads

    found = {k: v for grads in loopback.run(K * D, rank) for k, v in grads.items()}
    model = build("transparency")
    opt = optimizer(model.parameters())
    for step in range(2):   # the reference's second step: its gradients are those of the state after the first
        opt.zero_grad()
        x, y = data(batch, step)
        nn.functional.cross_entropy(model(x), y).backward()
        if step == 0:
            opt.step()
    cuts = plans[0].cuts
    for s in range(K):
        expected = [p.grad for p in model[cuts[s]:cuts[s + 1]].parameters()]
        assert len(found[s]) == len(expected)
        for got, want in zip(found[s], expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert found[0, "unused"] and all(torch.count_nonzero(g) == 0 for g in found[0, "unused"])


def replace_a_grad(engine: gems.Engine) -> None:
    """A user's ``p.grad = torch.zeros_like(p)``: a tensor outside the sync bucket."""
    p = next(p for s in engine.stages.values() for p in s.parameters())
    p.grad = torch.zeros_like(p)


def drop_a_grad(engine: gems.Engine) -> None:
    """What a user's ``p.grad = None`` (or a foreign optimizer's zero_grad) does."""
    next(p for s in engine.stages.values() for p in s.parameters()).grad = None


def test_a_replaced_grad_raises_before_communicating():
    K, m, D = 2, 2, 1
    copies, plans = per_rank("transparency", "mast", K, m, D)
    batch = batch_size("mast", m, D)

    def rank(comm):
        engine = make_engine(comm, copies, plans)
        engine.step(*data(batch, 0))
        replace_a_grad(engine)
        counts = count_comm(comm)
        try:
            engine.step(*data(batch, 1))
        except GemsError as exc:
            return str(exc), counts["calls"]
        return None, counts["calls"]

    for message, calls in loopback.run(K * D, rank):
        assert message is not None and "engine.optimizer.zero_grad()" in message
        assert "never assign .grad" in message
        assert calls == 0


def test_the_engine_is_usable_after_a_replaced_grad():
    K, m, D = 2, 2, 1
    copies, plans = per_rank("transparency", "mast", K, m, D)
    batch = batch_size("mast", m, D)

    def rank(comm):
        engine = make_engine(comm, copies, plans)
        losses = [engine.step(*data(batch, 0))]
        replace_a_grad(engine)
        with pytest.raises(GemsError):
            engine.step(*data(batch, 1))
        engine.optimizer.zero_grad()   # what the message says to use: gradients back in the bucket
        losses.append(engine.step(*data(batch, 1)))
        drop_a_grad(engine)            # None is re-attached at the next step (exact: the bucket is zero)
        losses.append(engine.step(*data(batch, 2)))
        return losses, engine.state_dict()

    losses, state = loopback.run(K * D, rank)[0]
    ref_state, ref_losses, _ = reference("transparency", batch, 3)
    check_reference("after a replaced .grad", state, losses, ref_state, ref_losses)


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("schedule,m,D", [("mp", 1, 1), ("gpipe", 2, 2), ("1f1b", 2, 1), ("mast", 1, 2)])
@pytest.mark.parametrize("bad", ["too few rows", "none"])
def test_bad_input_raises_before_communicating_and_the_engine_goes_on(bad, schedule, m, D):
    """K = 2: every rank needs images or labels, so every rank raises in the same call."""
    K = 2
    copies, plans = per_rank("transparency", schedule, K, m, D)
    batch = batch_size(schedule, m, D)

    def rank(comm):
        engine = make_engine(comm, copies, plans)
        losses = [engine.step(*data(batch, 0))]
        images, labels = data(batch, 1)
        counts = count_comm(comm)
        with pytest.raises(GemsError, match=f"rank {comm.rank} (needs|was given) (images|labels)"):
            if bad == "none":
                engine.step(None, None)
            else:
                engine.step(images[:batch // D - 1], labels[:batch // D - 1])
        assert counts["calls"] == 0
        losses += [engine.step(*data(batch, step)) for step in (1, 2)]
        return losses, engine.state_dict()

    ref_state, ref_losses, _ = reference("transparency", batch, 3)
    for losses, state in loopback.run(K * D, rank):
        check_reference(f"{schedule} after bad input", state, losses, ref_state, ref_losses)


def test_bad_input_on_every_rank_of_a_three_stage_pipeline():
    K, m, D = 3, 1, 1
    copies, plans = per_rank("transparency", "mp", K, m, D)
    batch = batch_size("mp", m, D)

    def rank(comm):
        engine = make_engine(comm, copies, plans)
        images, labels = data(batch, 0)
        try:
            engine.step(images[:-1], labels[:-1])
            raised = False
        except GemsError:
            raised = True
        losses = [engine.step(*data(batch, step)) for step in (0, 1)]
        return raised, losses, engine.state_dict()

    ref_state, ref_losses, _ = reference("transparency", batch, 2)
    for raised, losses, state in loopback.run(K * D, rank, timeout=10):
        assert raised
        check_reference("mp K=3 after bad input", state, losses, ref_state, ref_losses)


# ---------------------------------------------------------------- failures inside a step
@pytest.mark.parametrize("schedule,K,D", [("mast", 2, 1), ("1f1b", 4, 1), ("mast", 2, 2)])
def test_an_exception_inside_a_step_ends_the_job(schedule, K, D):
    """The last rank raises in its second forward, after the step has communicated: the Engine
    hands it to comm.fail, every other rank stops promptly, and run() raises it."""
    m = 1
    copies, plans = per_rank("transparency", schedule, K, m, D)
    batch = batch_size(schedule, m, D)
    seen: dict[int, BaseException] = {}
    lock = threading.Lock()
    failing = K * D - 1

    def rank(comm):
        engine = make_engine(comm, copies, plans)
        calls = 0

        def forward_hook(module, inputs):
            nonlocal calls
            calls += 1
            if comm.rank == failing and calls == 2:
                raise RuntimeError("injected failure in forward")

        for stage in engine.stages.values():
            stage.register_forward_pre_hook(forward_hook)
        try:
            for step in range(3):
                engine.step(*data(batch, step))
        except BaseException as exc:
            with lock:
                seen[comm.rank] = exc
            raise
        return "finished although a rank failed"

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="injected failure in forward") as info:
        loopback.run(K * D, rank, timeout=20)
    assert time.monotonic() - start < 10
    assert type(info.value) is RuntimeError
    assert f"on loopback rank {failing}" in info.value.__notes__
    assert sorted(seen) == list(range(K * D))   # every rank stopped, none returned
    assert seen[failing] is info.value or isinstance(seen[failing], Aborted)
    for r, exc in seen.items():
        if r != failing:
            assert isinstance(exc, (Aborted, PeerFailed)), (r, exc)


# ---------------------------------------------------------------- non-finite loss
@pytest.mark.parametrize("schedule,m,D", [("mast", 2, 1), ("1f1b", 2, 2), ("gpipe", 1, 2)])
def test_a_non_finite_step_is_skipped_and_leaves_no_trace(schedule, m, D):
    """NaN images (only group 1's under D = 2: the loss is global) make the step's loss NaN: the
    parameters, BatchNorm running statistics, num_batches_tracked and momentum are as before it,
    last_step_applied is False, and the next step is applied -- the run ends as one that never
    saw the bad batch."""
    K = 2
    copies, plans = per_rank("batchnorm", schedule, K, m, D)
    batch = batch_size(schedule, m, D)

    def rank(comm):
        engine = make_engine(comm, copies, plans)
        losses = [engine.step(*data(batch, 0))]
        assert engine.last_step_applied
        before = snapshot(engine)
        images, labels = data(batch, 1)
        images[batch - batch // D:] = float("nan")
        losses.append(engine.step(images, labels))
        applied_bad = engine.last_step_applied
        after_bad = snapshot(engine)
        losses.append(engine.step(*data(batch, 2)))
        changed = any(not torch.equal(v, snapshot(engine)[k]) for k, v in after_bad.items())
        return losses, applied_bad, engine.last_step_applied, before, after_bad, changed, engine.state_dict()

    results = loopback.run(K * D, rank)
    clean = run_loopback("batchnorm", schedule, K, m, D, steps=(0, 2))
    for r, (losses, applied_bad, applied_next, before, after_bad, changed, state) in enumerate(results):
        assert math.isnan(losses[1]) and math.isfinite(losses[2])
        assert applied_bad is False and applied_next is True
        assert any(k.endswith("num_batches_tracked") for k in before)
        assert_equal_states(after_bad, before, f"rank {r}: ")
        assert changed
        assert [losses[0], losses[2]] == clean[r].losses
        assert_equal_states(state, clean[r].state, f"rank {r}: ")
