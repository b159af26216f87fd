"""Skip connections are delivered, not relayed, and every message is one packed buffer.

- A tensor made in stage i and read in stage j > i + 1 travels once per micro-batch, straight
  from i to j (a U-Net at K = 4: every message of a step recorded and its tensors named); no
  stage receives a tensor it does not read.
- A message carries any number of tensors of any dtype: 20 floating tensors, a bool mask and
  int64 indices across one cut train exactly like one process.
- The planner holds a skip tensor only on the stages that make, read or save it.
"""
from __future__ import annotations

import copy
import dataclasses
import threading
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gems
from gems import partition
from gems.comm import loopback
from gems.errors import GemsError
from gems.graph import graph_units, stage_routes
from gems.graph.split import LIVE_IN
from gems.partition.profile import profile
from gems.pipeline.p2p import Messenger
from gems.pipeline.packing import Layout
from gems.pipeline.routes import Routes
from gems.schedule import ir
from gems.schedule import generators as sch

from equivalence import check_reference
from test_any_model import UNet

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

SIDE, STEPS = 12, 2


def _data(batch: int, step: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(batch, 3, SIDE, SIDE, generator=g), torch.randint(0, classes, (batch, SIDE, SIDE), generator=g)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _train(model: nn.Module, plan, classes: int, record=None) -> None:
    """Train on loopback ranks and compare with one process on the same batches."""
    units = graph_units(model, plan.input_shape, plan.micro_batch_size)
    copies = [copy.deepcopy(units) for _ in range(plan.stages)]
    reference = copy.deepcopy(model)

    def rank(comm):
        engine = gems.Engine(copies[comm.rank], copy.deepcopy(plan), optimizer=_sgd,
                             loss_fn=nn.CrossEntropyLoss(), comm=comm)
        losses = [engine.step(*_data(plan.batch_size, step, classes)) for step in range(STEPS)]
        return engine.state_dict(), losses

    results = loopback.run(plan.stages, rank, timeout=60)
    opt, ref_losses = _sgd(reference.parameters()), []
    for step in range(STEPS):
        x, y = _data(plan.batch_size, step, classes)
        loss = F.cross_entropy(reference(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    for state, losses in results:
        check_reference(plan.model_name, state, losses, reference.state_dict(), ref_losses)


def test_a_unet_at_k4_sends_each_skip_tensor_once_per_micro_batch(monkeypatch):
    torch.manual_seed(0)
    model = UNet()
    plan = partition.plan(model, (3, SIDE, SIDE), batch_size=4, stages=4, schedule="mast", micro_batches=1)
    units = graph_units(model, plan.input_shape, plan.micro_batch_size)
    routes = Routes.of(plan, units)
    assert routes.skips, "the U-Net's skips should join stages that are not neighbours"
    names = [units[plan.cuts[s + 1]].meta[LIVE_IN] for s in range(plan.stages - 1)]   # stage s's output tuple
    sent: list[tuple[ir.Message, tuple[str, ...]]] = []
    lock = threading.Lock()
    send = Messenger.send

    def recording(self, a, tensors):
        msg = a.message(self.position)
        if msg.kind == "act":
            with lock:
                sent.append((msg, tuple(names[msg.producer][s] for s in routes.edges[msg.edge].sources)))
        return send(self, a, tensors)

    monkeypatch.setattr(Messenger, "send", recording)
    _train(model, plan, classes=3)
    per_micro = Counter()
    for msg, carried in sent:
        for name in carried:
            per_micro[(msg.replica, msg.micro, name, msg.consumer)] += 1
    # every (tensor, stage reading it) once per replica, micro-batch and step, and nothing else
    reads = {(name, s) for s in range(1, plan.stages) for (i, q, _), name in
             zip(plan.routes[s], units[plan.cuts[s]].meta[LIVE_IN]) if i >= 0}
    expected = {(r, 0, name, s) for r in range(2) for name, s in reads}
    assert set(per_micro) == expected
    assert set(per_micro.values()) == {STEPS}
    skipping = {name for (_, _, name, s) in per_micro for e in routes.skips if s == e[1]
                and name in names[e[0]]}
    assert "x" in skipping                      # the input goes straight to the logits' stage
    # relaying would have moved every live tensor across every cut: strictly more
    relayed = sum(len(names[s]) for s in range(plan.stages - 1))
    assert len(reads) < relayed


class ManyTensors(nn.Module):
    """Twenty channels cross the cut as twenty tensors, with a bool mask and int64 indices."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 20, 3, padding=1)
        self.b = nn.Conv2d(20, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        mask = x[:, :1] > 0
        idx = h.argmax(1, keepdim=True) % 4
        parts = [p * (i + 1) for i, p in enumerate(h.split(1, dim=1))]
        logits = self.b(torch.cat(parts, 1))
        return logits * mask + logits.gather(1, idx)


def test_a_message_packs_many_tensors_of_any_dtype():
    torch.manual_seed(0)
    model = ManyTensors()
    plan = partition.plan(model, (3, SIDE, SIDE), batch_size=4, stages=2, schedule="mast", micro_batches=1,
                          split_points=["cat"])
    dtypes = Counter(plan.stage_output_dtypes[0])
    assert dtypes["float32"] >= 20 and dtypes["bool"] == 1 and dtypes["int64"] == 1
    _train(model, plan, classes=4)


def test_layouts_round_trip_and_check_the_header():
    layout = Layout([(3, 4, 4), (2,), (5,)], [torch.float32, torch.int64, torch.bool], rows=2)
    tensors = (torch.randn(2, 3, 4, 4), torch.arange(4).view(2, 2), torch.rand(2, 5) > 0.5)
    flat = layout.pack(tensors, "act d0.s0>s1", torch.device("cpu"))
    assert flat.dtype == torch.uint8 and flat.numel() == layout.nbytes
    for got, want in zip(layout.unpack(flat.clone(), "act d0.s0>s1"), tensors):
        assert got.dtype == want.dtype and torch.equal(got, want)
    with pytest.raises(GemsError, match="act d0.s0>s2 arrived with a header for another message"):
        layout.unpack(flat, "act d0.s0>s2")
    with pytest.raises(GemsError, match="has 2 tensors where its layout has 3"):
        layout.pack(tensors[:2], "act d0.s0>s1", torch.device("cpu"))


def test_skip_actions_sit_beside_their_computations_and_validate():
    from gems.schedule.validate import validate   # noqa: PLC0415

    for name, K, m in [("mast", 4, 2), ("1f1b", 4, 4), ("gpipe", 3, 2), ("mast", 3, 1)]:
        skips = [(0, K - 1)] + ([(1, 3)] if K > 3 else [])
        lists = sch.schedule(name, K, m, skips)
        validate(name, K, m, lists)
        for p, actions in enumerate(lists):
            for k, a in enumerate(actions):
                if a.other >= 0 and a.op == ir.SEND_ACT:    # right after the producer's forward
                    assert any(b.op == ir.FORWARD and (b.replica, b.micro, b.stage) == (a.replica, a.micro, a.stage)
                               for b in actions[max(0, k - 3):k])
    with pytest.raises(ValueError, match="skip edges"):
        sch.schedule("mast", 3, 1, [(0, 1)])


def test_the_planner_holds_a_skip_only_where_it_is_made_or_read():
    torch.manual_seed(0)
    units = graph_units(UNet(), (3, SIDE, SIDE), 2)
    direct = profile(units, (3, SIDE, SIDE), 2)
    relay = dataclasses.replace(direct, storages=[dataclasses.replace(s, readers=None) for s in direct.storages])
    n = len(units)
    A = direct.activation_matrix()
    middle = [i for i, name in enumerate(units.unit_names) if name.startswith("middle.")]
    lo, hi = middle[0], middle[-1] + 1
    for a, b in [(lo, hi), (0, n), (1, n - 1), (lo - 1, hi + 2)]:
        assert A[a, b] == direct.activation_bytes(a, b)             # the vectorised prices agree
    passing = sum(s.nbytes for s in direct.storages if (lo - 1) in s.boundaries and (hi - 1) in s.boundaries
                  and not any(lo <= u < hi for u in s.touchers()))
    assert passing > 0                                               # the encoder's skips pass the middle
    assert relay.activation_bytes(lo, hi) - direct.activation_bytes(lo, hi) == passing
    routes = stage_routes(units, [0, lo, hi, n])
    assert len(routes[1]) == 4 and sum(i >= 0 for i, _, _ in routes[1]) == 1   # of 4 live tensors, it gets 1
