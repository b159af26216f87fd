"""channels_last (gems.plan.formats): stages train in NHWC exactly as one NCHW process does.

Loopback ranks (tests/equivalence.py's harness): every schedule, D = 2, the sharded optimizer,
memory policies, the split backward and tuple boundaries after 3 SGD steps against the one-process
NCHW reference (1e-5 relative per tensor), with every 4-D parameter and its gradient still
channels_last after the steps. Two real MPI ranks: tests/test_engine.py; tiles and halos:
tests/test_spatial_engine.py.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import equivalence as eq
import gems
from gems import partition
from gems.comm import loopback
from gems.pipeline.packing import Layout
from gems.plan import formats

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


def _all_nhwc(results) -> bool:
    return all(r.channels_last and all(r.channels_last) for r in results)


@pytest.mark.parametrize("schedule, K, m, D", [("mp", 2, 1, 1), ("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1),
                                               ("mast", 2, 2, 1), ("mast", 4, 1, 1), ("gpipe", 2, 2, 2),
                                               ("mast", 2, 1, 2)])
@pytest.mark.parametrize("kind", ["transparency", "batchnorm"])
def test_channels_last_trains_as_one_nchw_process(kind, schedule, K, m, D):
    assert _all_nhwc(eq.run_loopback(kind, schedule, K, m, D, memory_format="channels_last"))


@pytest.mark.parametrize("shard", [False, True])
def test_parameters_stay_channels_last_with_and_without_a_sharded_optimizer(shard):
    """The bucket's gradient views and the sharded optimizer's flat parameter buffer take each
    parameter's strides."""
    assert _all_nhwc(eq.run_loopback("transparency", "mast", 2, 1, 2, shard=shard, memory_format="channels_last"))


@pytest.mark.parametrize("policy, split", [("recompute+offload", False), ("segment", True), ("none", True)])
def test_channels_last_with_policies_and_a_split_backward(policy, split):
    assert _all_nhwc(eq.run_loopback("transparency", "mast", 2, 2, 1, policy=policy, split=split,
                                     memory_format="channels_last"))


def test_channels_last_with_tuple_boundaries():
    """AmoebaNet-D: several tensors per message, each with its strides in the packed layout."""
    assert _all_nhwc(eq.run_loopback("tuples", "1f1b", 2, 2, 1, memory_format="channels_last"))


def test_activations_arrive_channels_last_without_a_permuting_copy():
    """A received activation is a view of the message buffer with NHWC strides; the images enter NHWC."""
    copies, plans = eq.per_rank("transparency", "1f1b", 2, 1, 1, memory_format="channels_last")

    def rank(comm):
        engine = gems.Engine(copies[comm.rank], plans[comm.rank], optimizer=eq.optimizer,
                             loss_fn=nn.CrossEntropyLoss(), comm=comm)
        seen = []
        stage = next(iter(engine.stages.values()))
        stage.register_forward_pre_hook(lambda module, args: seen.append(
            args[0].is_contiguous(memory_format=torch.channels_last)))
        engine.step(*eq.data(plans[0].batch_size, 0))
        return seen

    assert loopback.run(2, rank) == [[True], [True]]


def test_a_layout_carries_its_format():
    """The receive views have the format's strides, and the digest tells the formats apart."""
    nchw, nhwc = (Layout([(8, 4, 4), (5,)], [torch.float32, torch.int64], 2, f) for f in ("contiguous", "channels_last"))
    assert nchw.digest("m") != nhwc.digest("m") and nchw.nbytes == nhwc.nbytes
    x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    y = torch.arange(10).reshape(2, 5)
    a, b = nhwc.unpack(nhwc.pack([x, y], "m", torch.device("cpu")), "m")
    assert a.is_contiguous(memory_format=torch.channels_last) and torch.equal(a, x) and torch.equal(b, y)
    assert nchw.unpack(nchw.pack([x, y], "m", torch.device("cpu")), "m")[0].is_contiguous()


def test_a_model_without_4d_weights_trains_in_the_default_format():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 8), nn.ReLU(), nn.Linear(8, eq.CLASSES))
    plan = partition.plan(model, input_shape=(3, 4, 4), batch_size=2, stages=1, schedule="mp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = loopback.run(1, lambda comm: gems.Engine(copy.deepcopy(model), plan, optimizer=eq.optimizer,
                                                          loss_fn=nn.CrossEntropyLoss(), comm=comm,
                                                          memory_format=torch.channels_last))[0]
    assert engine.plan.memory_format == "contiguous"
    assert any("without 4-D parameters" in str(w.message) for w in caught)


def test_formats_by_tensor():
    w = torch.randn(8, 3, 3, 3).to(memory_format=torch.channels_last)
    flat = torch.zeros(w.numel())
    view = formats.like(flat, w)
    assert view.stride() == w.stride() and view.data_ptr() == flat.data_ptr()
    assert formats.format_of(w) is torch.channels_last and formats.format_of(torch.randn(2, 8, 3, 3)) is \
        torch.contiguous_format
    assert formats.empty_as(w, (1, 8, 5, 5)).is_contiguous(memory_format=torch.channels_last)
    assert formats.strides((2, 8, 4, 4), "channels_last") == torch.empty(
        2, 8, 4, 4, memory_format=torch.channels_last).stride()
    with pytest.raises(gems.GemsError, match="not one of"):
        formats.name_of("nhwc")
