"""Skips that go tile to tile (gems.spatial.stage.tile_skips, gems.pipeline.routes, gems.schedule.members):
a U-Net's full-resolution skip made by stage 0's tiled prefix and read by the last stage's tiled
suffix on another position travels from each tile's rank to the rank holding the same tile, its
gradient back the same way; no rank gathers it whole. Each rank receives per step what the plan
prices for it (``PositionEstimate.received_bytes``, held against ``Comm.received``), and training
equals one process.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gems
from gems.comm import loopback
from gems.graph import graph_units
from gems.pipeline.routes import Routes, tiled_sources
from gems.schedule import generators as sch
from gems.schedule.ir import RECVS, SENDS, replay
from gems.schedule.members import member_lists
from gems.schedule.topology import Topology
from gems.spatial import TiledUnit
from gems.spatial.stage import tile_skips
from gems.spatial.tiles import TILE_TAG
from test_spatial_engine import UNET_PREFIX, UNET_SUFFIX, _check, _data, _made, _optimizer, _unet

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]
SIDE, BATCH, STEPS = 36, 4, 2
CUTS = [0, 22, 37]   # split at up.0.0: the encoder's full-resolution output down_0_5 crosses to stage 1


@pytest.mark.parametrize("semantics", ["mpi", "nccl"])
def test_the_communicator_counts_the_bytes_each_rank_receives_per_tag(semantics):
    """``Comm.received``: a posted receive's buffers, per tag (the MPI and torch backends: the comm worker)."""
    def rank(comm):
        if comm.rank == 0:
            comm.wait(comm.isend((torch.ones(3, 5), torch.ones(2, dtype=torch.int64)), 1, 4), "send")
            return dict(comm.received)
        comm.wait(comm.irecv((torch.empty(3, 5), torch.empty(2, dtype=torch.int64)), 0, 4), "recv")
        return dict(comm.received)

    assert loopback.run(2, rank, semantics=semantics) == [{}, {4: 3 * 5 * 4 + 2 * 8}]


def test_only_the_skips_no_unit_between_reads_go_tile_to_tile():
    """The U-Net tiled up to unit 14 and from unit 28: down_0_5 passes every unit between untouched;
    down_1_5 is read by the leader's untiled decoder (gathered as before). No suffix, or one stage: none."""
    units = graph_units(_unet(), (3, SIDE, SIDE), 2)
    assert tile_skips(units, CUTS, UNET_PREFIX, UNET_SUFFIX) == {"down_0_5"}
    assert tile_skips(units, CUTS, UNET_PREFIX, 0) == set()
    assert tile_skips(units, [0, 37], UNET_PREFIX, UNET_SUFFIX) == set()
    assert tiled_sources(units, CUTS, UNET_PREFIX, UNET_SUFFIX) == {0}


def test_a_members_list_holds_its_tiles_messages_and_completes():
    """mast K = 2 with the edge (0, 1) carrying tiles: each member list sends and receives the
    activations and gradients of that edge for both replicas, matched between the two positions,
    and runs to its end with buffered sends (as its leader's does)."""
    lists = sch.schedule("mast", 2, 2, (), True)
    members = member_lists(lists, Topology(4, 2, "mast", 2, suffix=True), {(0, 1)})
    replay(members)
    for p, actions in enumerate(members):
        messages = [a.message(p) for a in actions if a.op in SENDS or a.op in RECVS]
        assert len(messages) == 2 * 2 * 2 and {m.edge for m in messages} == {(0, 1)}   # replicas, micro, act/grad
        assert [a for a in actions if a.op not in SENDS and a.op not in RECVS] == \
            [a for a in lists[p] if a.op not in SENDS and a.op not in RECVS]
    assert not [a for a in member_lists(lists, Topology(4, 2, "mast", 2), set())[0] if a.op in SENDS or a.op in RECVS]


def test_a_unet_skip_goes_tile_to_tile_under_mast():
    """mast K = 2, P = 2 (4 ranks), planned with its prefix, suffix and cut: per step each rank
    receives exactly its plan's ``received_bytes`` in pipeline messages -- a member its tile of the
    skip and of its gradient, the leader the rest -- the prefix gathers nothing of full resolution
    and the suffix scatters only what the leader's decoder made; the model trains as one process."""
    made = _made(SIDE, BATCH, 2, "mast", net=_unet, spatial=(2, 1), spatial_end=UNET_PREFIX,
                 spatial_start=UNET_SUFFIX, split_points=("up.0.0",))
    plan = made.plan
    assert plan.cuts == CUTS and (plan.spatial_end, plan.spatial_start) == (UNET_PREFIX, UNET_SUFFIX)
    copies = made.copies(4)

    def rank(comm):
        engine = gems.Engine(copies[comm.rank], copy.deepcopy(plan), optimizer=_optimizer,
                             loss_fn=nn.CrossEntropyLoss(), comm=comm)
        losses, received = [], []
        for step in range(STEPS):
            losses.append(engine.step(*_data(BATCH, SIDE, step, per_pixel=True)))
            received.append(sum(b for tag, b in comm.received.items() if tag < TILE_TAG))
        tiled = [u for s in engine.stages.values() for u in s if isinstance(u, TiledUnit)]
        gathered = {tuple(size for k, size in enumerate(u.gathers) if k not in u.kept) for u in tiled if u.gathers}
        scattered = [shape for u in tiled if u.scatters for k, shape in enumerate(u.scatters) if k not in u.given]
        return engine.state_dict(), losses, received, engine.position, engine.tile, gathered, scattered

    results = loopback.run(4, rank, semantics="nccl", timeout=60.0)
    _check([r[:2] for r in results], BATCH, SIDE, STEPS, net=_unet)
    for _, _, received, position, tile, gathered, scattered in results:
        assert received == [plan.positions[position].received_bytes[tile]] * STEPS
        assert gathered == {((18, 18), (9, 9)), ((SIDE, SIDE),)}   # the prefix's end, the model's output
        assert [s[1:] for s in scattered] == [(8, 18, 18)]             # up_0_5, not the skip
    routes = Routes.of(plan, graph_units(_unet(), (3, SIDE, SIDE), 2))
    tile = routes.layout("act", (0, 1), plan.micro_batch_size, 1)
    assert tile.shapes == [(2, 4, 18, SIDE)]
    # a member: its tile of one replica's skip and of the other's gradient
    assert plan.positions[0].received_bytes[1] == plan.positions[1].received_bytes[1] == 2 * tile.nbytes
