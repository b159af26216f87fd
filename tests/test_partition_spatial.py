"""The planner's spatial part (gems.partition.spatial, gems.spatial.limit): how far a model can be
tiled and why not further, the grid with the least halo traffic, the leader's memory at about 1/P
on the tiled units, JSON, gems-plan's flags and their bad input, and ResNet-50 at 16384^2 under
80 GiB per rank. Fake tensors only; a plan asked for alike by several tests is made once (``_plan``)."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from gems.cli.plan import main
from gems.errors import GemsError
from gems.graph import graph_units
from gems.partition import Plan, plan
from gems.partition.spatial import parse_spatial
from gems.spatial.limit import spatial_limit
from spatial_models import GroupNormNet

BASE = dict(batch_size=1, stages=1, schedule="mp")
NET = ["--model", "tests/spatial_models.py:GroupNormNet", "--image-size", "64", "--batch-size", "1", "--stages", "1",
       "--schedule", "mp"]


@functools.cache
def _planned(net, shape, **options) -> Plan:
    return plan(net(), shape, **options)


def _plan(net, shape, **options) -> Plan:
    """``plan(net(), shape, **options)``, made once per module: a copy of it."""
    return copy.deepcopy(_planned(net, tuple(shape), **options))


class Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 2, 3), nn.Linear(2 * 10 * 10, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def test_the_reach_ends_before_a_unit_that_mixes_pixels_and_says_why():
    units = graph_units(Flat(), (3, 12, 12), 1)
    reach = spatial_limit(list(units), units.unit_names, (1, 3, 12, 12))
    assert units.unit_names[reach.end] == "flatten"
    assert reach.reason.startswith("unit flatten cannot run on tiles") and "end the spatial part before unit flatten" \
        in reach.reason
    assert [(w.unit, w.kernel, w.size_in, w.size_out) for w in reach.windows] == [(0, (3, 3), (12, 12), (10, 10))]
    with pytest.raises(GemsError, match="end the spatial part before unit flatten"):
        plan(Flat(), (3, 12, 12), spatial=2, spatial_end=reach.end + 1, **BASE)


def test_the_reach_ends_after_a_global_pooling():
    units = graph_units(GroupNormNet(), (3, 64, 64), 1)
    reach = spatial_limit(list(units), units.unit_names, (1, 3, 64, 64))
    assert units.unit_names[reach.end - 1] == "adaptive_avg_pool2d" and "leaves no value tiled" in reach.reason


def test_the_reach_ends_before_a_unit_whose_traced_graph_does_not_run_on_its_own():
    """An AmoebaNet cell takes a tensor (after the stem) or a pair: traced on its own it keeps the
    pair's branch, so the planner cannot size it on tiles. The reach ends before it, in a sentence,
    and a spatial plan tiles the stem (a traceback from the sizing pass, before)."""
    from gems import models  # noqa: PLC0415

    net = models.build("amoebanet-d", num_classes=4, num_layers=3, num_filters=16)
    units = graph_units(net, (3, 64, 64), 1)
    reach = spatial_limit(list(units), units.unit_names, (1, 3, 64, 64))
    assert reach.end == 1 and reach.reason.startswith(f"unit {units.unit_names[1]} does not run as traced on its own")
    assert "end the spatial part at most 1 units in" in reach.reason
    tiled = plan(net, (3, 64, 64), 4, 2, "mast", spatial=2, device="cpu")
    assert tiled.spatial_grid == [2, 1] and tiled.spatial_end == 1


@pytest.mark.parametrize("size, grid", [((32, 256), [1, 4]), ((256, 32), [4, 1]), ((128, 128), [2, 2])])
def test_the_grid_with_the_least_halo_traffic(size, grid):
    # cutting along the long side exchanges the short side's borders; a square image: 2 x 2
    assert _plan(GroupNormNet, (3, *size), spatial=4, **BASE).spatial_grid == grid
    assert _plan(GroupNormNet, (3, *size), spatial="2x2", **BASE).spatial_grid == [2, 2]


@pytest.mark.parametrize("tiles", [2, 4, 8])
def test_the_leader_keeps_about_a_tile_of_the_tiled_units(tiles):
    size = 256
    whole = _plan(GroupNormNet, (3, size, size), **BASE)
    tiled = _plan(GroupNormNet, (3, size, size), spatial=tiles, **BASE)
    assert tiled.spatial_end == len(tiled.unit_names) - 2   # through the pooling, before flatten and head
    share = tiled.stage_estimates[0].activation_bytes / whole.stage_estimates[0].activation_bytes
    assert 1 / tiles <= share <= 1.1 / tiles    # a tile each (of the images too), plus the halo rows fetched
    assert tiled.stage_estimates[0].forward_flops == pytest.approx(whole.stage_estimates[0].forward_flops / tiles,
                                                                    rel=1e-3)
    assert tiled.positions[0].static_bytes == whole.positions[0].static_bytes   # parameters: full on every rank
    assert tiled.stage_estimates[0].spatial_seconds > 0 and tiled.step_seconds > 0


def test_recompute_segments_stop_at_the_spatial_end():
    p = _plan(GroupNormNet, (3, 128, 128), spatial=2, spatial_end=5, recompute="all", **BASE)
    assert p.spatial_end == 5 and p.policies[0].recompute
    assert not any(a < 5 < b for a, b in p.policies[0].recompute)
    p.check()


def test_json_round_trip():
    p = _plan(GroupNormNet, (3, 64, 64), spatial="1x2", spatial_end=4, batch_size=2, stages=2, schedule="mast")
    back = Plan.from_json(p.to_json())
    assert (back.spatial_grid, back.spatial_end, back.tiles) == ([1, 2], 4, 2)
    assert back.stage_estimates[0].spatial_seconds == p.stage_estimates[0].spatial_seconds
    assert "world 4 ranks = 1 group(s) x (2 + 1 x 2)" in back.table()


def _unet():
    from gems.models.unet import UNet

    return UNet(num_classes=5, width=4, depth=3, groups=2)


def test_a_unet_suffix_is_priced_as_tiles_and_kept_inside_the_last_stage():
    """The zoo U-Net (units: encoder [0, 14), middle, full-resolution decoder from unit 28): with the
    decoder tail as a suffix the leader keeps less than with the same prefix alone; under mast the
    suffix stays inside the last stage and no recompute segment crosses its start."""
    prefix = _plan(_unet, (3, 64, 64), spatial=2, spatial_end=14, spatial_start=0, **BASE)
    both = _plan(_unet, (3, 64, 64), spatial=2, spatial_end=14, spatial_start=28, **BASE)
    assert (prefix.spatial_start, both.spatial_start) == (0, 28)
    assert both.positions[0].activation_bytes < 0.8 * prefix.positions[0].activation_bytes
    assert both.stage_estimates[0].spatial_seconds > prefix.stage_estimates[0].spatial_seconds   # the scatter, gather
    mast = _plan(_unet, (3, 64, 64), spatial=2, spatial_end=14, spatial_start=28, batch_size=2, stages=2,
                schedule="mast", recompute="all")
    assert mast.cuts[1] >= 14 and mast.cuts[1] <= 28 and mast.spatial_start == 28
    assert not any(a < 28 < b for a, b in mast.policies[1].recompute)
    mast.check()
    back = Plan.from_json(mast.to_json())
    assert back.spatial_start == 28 and "the last stage's units [28, 37)" in back.table()


def test_the_planner_finds_a_suffix_for_a_unet_and_none_for_a_classifier():
    assert _plan(_unet, (3, 64, 64), spatial=2, spatial_end=14, spatial_start=0, **BASE).spatial_start == 0
    auto = _plan(_unet, (3, 64, 64), spatial=2, batch_size=2, stages=2, schedule="mast")
    assert auto.spatial_start >= auto.cuts[1] and auto.spatial_end <= auto.cuts[1]
    assert auto.spatial_start > 0   # the decoder's full-resolution tail is worth tiling
    assert _plan(GroupNormNet, (3, 64, 64), spatial=2, **BASE).spatial_start == 0
    given = _plan(_unet, (3, 64, 64), spatial=2, spatial_start=28, **BASE)   # the prefix's end chosen before it
    assert given.spatial_start == 28 and given.spatial_end < 28


def test_a_one_replica_pipeline_tiles_a_suffix_only_from_a_given_start():
    """1f1b with K = 2: no suffix searched (it would make the last position a tile group: more
    ranks); from a given start the last position is one, and the table counts its ranks."""
    one = dict(spatial_end=14, batch_size=2, stages=2, schedule="1f1b", micro_batches=2)
    assert _plan(_unet, (3, 64, 64), spatial=2, **one).spatial_start == 0
    given = _plan(_unet, (3, 64, 64), spatial=2, spatial_start=28, **one)
    assert given.spatial_start == 28 and given.tiled_stages == (0, 1)
    assert "at position(s) 0,1" in given.table() and "world 4 ranks = 1 group(s) x (2 + 1 x 2)" in given.table()
    given.check()


def test_a_tile_groups_other_ranks_are_estimated_on_their_own():
    """A member holds its stages' tiled units only: under 1f1b with a suffix the last position's
    member holds the suffix alone, less than its leader; positions that are no tile group, and
    plans without tiles, have no member estimate; the JSON keeps it."""
    one = dict(spatial_end=14, batch_size=2, stages=2, schedule="1f1b", micro_batches=2)
    made = _plan(_unet, (3, 64, 64), spatial=2, spatial_start=28, **one)
    first, last = made.positions
    assert 0 < first.member_peak_bytes < first.peak_bytes
    assert 0 < last.member_peak_bytes < 0.8 * last.peak_bytes
    assert [p.member_peak_bytes for p in _plan(_unet, (3, 64, 64), spatial=2, **one).positions][1] == 0
    assert all(p.member_peak_bytes == 0 for p in _plan(_unet, (3, 64, 64), **BASE).positions)
    assert Plan.from_json(made.to_json()).positions[1].member_peak_bytes == last.member_peak_bytes


def test_a_sharded_optimizer_shares_tiled_units_over_the_tiles_too():
    """SGD with momentum, K = 1 on one tile group of 2 (no other copy): sharded, each rank keeps half
    the tiled units' momentum and all of the untiled rest's."""
    plain, sharded = (_plan(_unet, (3, 64, 64), spatial=2, spatial_end=14, spatial_start=0, optimizer="sgd",
                           shard_optimizer=shard, **BASE) for shard in (False, True))
    tiled = 4 * sum(p.numel() for u in list(graph_units(_unet(), (3, 64, 64), 1))[:14] for p in u.parameters())
    saved = plain.positions[0].static_bytes - sharded.positions[0].static_bytes
    assert tiled // 2 <= saved <= tiled // 2 + 14   # each unit's half rounded up
    assert 0 < sharded.positions[0].member_peak_bytes < plain.positions[0].member_peak_bytes


def test_recompute_cut_at_the_spatial_edges_is_never_worse_than_none(capsys):
    """Segments cut at a prefix's end and a suffix's start keep those boundaries, and may keep more
    than no policy: the planner then recomputes nothing there (it raised ValueError: the zoo U-Net
    at 256^2, mast, 16 tiles, recompute auto under a budget)."""
    main(["--model", "unet", "--image-size", "256", "--batch-size", "2", "--stages", "2", "--schedule", "mast",
          "--spatial", "16", "--num-classes", "2", "--recompute", "auto", "--memory-budget", "64MiB"])
    out = capsys.readouterr().out
    assert "spatial: stage 0's units" in out and ("fits" in out or "does not fit" in out)


@pytest.mark.parametrize("kwargs, message", [
    (dict(spatial_end=14, spatial_start=10, **BASE), "the spatial suffix cannot start at unit 10"),
    (dict(spatial_end=14, spatial_start=37, **BASE), "the spatial suffix cannot start at unit 37"),
    (dict(spatial_end=14, spatial_start=-1, **BASE), "a spatial suffix needs --spatial and a positive start unit"),
])
def test_a_suffix_that_cannot_be_names_the_fix(kwargs, message):
    with pytest.raises(GemsError, match=message):
        plan(_unet(), (3, 64, 64), spatial=2, **kwargs)


@pytest.mark.parametrize("value", [0, "0", "2x", "x2", "2x0", "four", 2.5, True])
def test_parse_spatial_refuses(value):
    with pytest.raises(GemsError, match="--spatial must be"):
        parse_spatial(value)


@pytest.mark.parametrize("extra, message", [
    (["--spatial", "0"], "--spatial must be a tile count"),
    (["--spatial", "2x"], "--spatial must be a tile count"),
    (["--spatial", "64"], "larger than the tile side allows"),
    (["--spatial", "2", "--spatial-end", "30"], "end the spatial part at most 21 units in"),
    (["--spatial", "2", "--spatial-end", "0"], "not a positive integer"),
    (["--spatial", "2", "--spatial-start", "x"], "is not a whole number"),
    (["--spatial", "2", "--spatial-start", "20"], "the spatial suffix cannot start at unit 20"),
])
def test_bad_input_is_one_sentence_and_exit_2(capsys, extra, message):
    try:
        status = main(NET + extra)
    except SystemExit as exit_:   # argparse
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2 and message in err
    assert len(err.strip().splitlines()) == 1 or err.strip().splitlines()[-1].startswith("gems-plan: error: ")
    assert "Traceback" not in err


def test_resnet50_at_16384_fits_80gib_per_rank_on_8_ranks(capsys):
    # plain: no K fits (the position holding layer1.0 needs >= 112 GiB); mast K = 2 with 4 tiles: 2 x 4 ranks
    status = main(["--model", "torchvision:resnet50", "--image-size", "16384", "--batch-size", "2", "--stages", "2",
                   "--schedule", "mast", "--recompute", "auto", "--memory-budget", "80GiB", "--spatial", "4"])
    out = capsys.readouterr().out
    assert status == 0
    assert "world 8 ranks = 1 group(s) x (2 + 3 x 2)" in out and "fits: the largest peak" in out
    assert "predicted step" in out
