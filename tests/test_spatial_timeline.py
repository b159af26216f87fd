"""A tile group's waits on the step's timeline (``TileGroup.timer``): every halo, statistics and
gather wait a span labelled with its kind and layer, forward and backward, which
``gems.obs.trace`` files under its own kinds."""
from __future__ import annotations

import copy

import pytest
import torch

from gems.comm import loopback
from gems.graph import graph_units
from gems.obs import trace
from gems.pipeline.timing import ActionTimer
from gems.spatial import TileGroup, flatten, tile_stage
from spatial_models import BatchNormNet

pytestmark = pytest.mark.timeout(60)


def test_halo_statistics_and_gather_waits_are_spans_named_by_layer():
    torch.manual_seed(0)
    units = graph_units(BatchNormNet(), (3, 24, 24), 1)
    copies = [copy.deepcopy(units) for _ in range(2)]
    for u in copies:
        for unit in u:
            flatten(unit)
    x = torch.randn(1, 3, 24, 24)

    def rank(comm):
        u = copies[comm.rank]
        timer = ActionTimer(torch.device("cpu"))
        timer.begin_step()
        tiles = TileGroup(comm, [0, 1], (2, 1), comm.rank, comm.group([0, 1]), timer=timer)
        end = u.unit_names.index("adaptive_avg_pool2d")   # the last tiled unit's output gathered on the leader
        stage = tile_stage(u[0:len(u)], 0, end, u.unit_names, tiles, x.shape)
        out = stage(tiles.tile(x))
        torch.autograd.backward(out.sum() if tiles.leader else list(out))
        return timer.timeline()

    for spans in loopback.run(2, rank, semantics="nccl", timeout=30.0):
        labels = {label for label, _, _ in spans}
        kinds = {trace.kind(label) for label in labels}
        assert kinds == {"halo wait", "statistics wait", "gather wait"}, labels
        assert all(0 <= end - start < 30 for _, start, end in spans)
        assert {"halo stem", "halo pool", "halo b1.c1", "halo-grad b1.c1", "stats gn", "stats-grad b2.n2", "gather",
                "gather-grad"} <= labels, labels
        assert "halo-grad stem" not in labels   # the image takes no gradient: nothing goes back
