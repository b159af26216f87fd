"""A tile group's memory against its plan (gems.partition.spatial): every rank of a spatial plan,
its tile groups' members included, peaks at what the plan estimates for it
(``PositionEstimate.peak_bytes`` for a leader, ``member_peak_bytes`` for a member): never more than
3% above the estimate, nor more than 10% below it.

In process: the ranks are loopback threads, and the CPU peak meter (``gems.obs.memory``) records
the allocator's reports per thread, so each rank meters its own step -- what it holds between
steps (parameters, gradients, optimizer state) plus the high-water mark of the step, as
gems-train's summary measures it -- up to its gradient sync: the loopback's allreduce snapshots
each rank's whole gradient bucket (MPI's ring sums it in place, in a buffer kept across steps),
so the reduces are held back to the sync (``overlaps_collectives`` off) and the meter stops
there. Layouts: a ResNet whose last blocks' working memory is mostly their weights' gradients
and kernel copies, which every tile holds whole (K = 1, P = 2), convolutions whose backward joins
each tile's region (K = 1, P = 2), and the zoo's U-Net under mast (K = 2, P = 2: 4 ranks) as the
planner lays it out, and with a long skip going tile to tile.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gems
from gems import models, partition
from gems.comm import loopback
from gems.graph import graph_units
from gems.obs import memory
from gems.schedule.topology import ranks_per_group
from gems.spatial import flatten
from gems.spatial.stage import _FLAT

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]
CLASSES = 4


def _measured(model: nn.Module, side: int, batch: int, per_pixel: bool, **options) -> list[tuple[int, int]]:
    """Per rank of ``model``'s plan, (estimated, measured) peak bytes of its second step (the first
    allocates the gradients and the optimizer's state)."""
    plan = partition.plan(model, (3, side, side), batch_size=batch, device="cpu", **options)
    world = ranks_per_group(plan.stages, plan.schedule, plan.tiles, bool(plan.spatial_start))
    units = graph_units(copy.deepcopy(model), (3, side, side), plan.micro_batch_size)
    flats = [flatten(unit) for unit in units]    # traced here, in one thread (fx patches nn.Module)
    copies = []
    for _ in range(world):
        mine, flat = copy.deepcopy((units, flats))
        _FLAT.update(zip(mine, flat))
        copies.append(mine)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, side, side, generator=g)
    y = torch.randint(0, CLASSES, (batch, side, side) if per_pixel else (batch,), generator=g)
    with memory.PeakMeter("cpu"):   # spends the profiler's one warning in this thread, not in a rank's
        pass

    def rank(comm):
        comm.overlaps_collectives = False   # every reduce posted at the sync (module docstring)
        engine = gems.Engine(copies[comm.rank], copy.deepcopy(plan), loss_fn=nn.CrossEntropyLoss(), comm=comm,
                             optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9))
        engine.step(x, y)
        meter, sync, measured = memory.PeakMeter(engine.device), engine.grads.sync, []

        def metered(loss):
            measured.append(meter.stop())
            return sync(loss)
        engine.grads.sync = metered
        meter.start(memory.engine_tensors(engine))
        engine.step(x, y)
        return memory.rank_estimate(plan.positions[engine.position], engine.tile), measured[0]

    return loopback.run(world, rank, semantics="nccl", timeout=50.0)


def _within(results: list[tuple[int, int]], over: float = 0.10, under: float = 0.03) -> None:
    """Each rank's estimate at most ``under`` below its measured peak and ``over`` above it."""
    errors = [estimated / measured - 1 for estimated, measured in results]
    assert all(-under <= e <= over for e in errors), [f"{e:+.1%}" for e in errors]


@pytest.mark.parametrize("placement", ["device", "host-optimizer", "host"])
def test_a_resnet_on_one_tile_group_peaks_as_estimated(placement):
    """resnet18 at 256^2 on 2 tiles: the peak falls in layer4's backward, 9 MiB weight gradients and
    their kernels' copies whole on each tile beside a tile of small activations (priced at a
    tile's share, the estimate was 5% low). With the optimizer on the host, the member's estimate
    leaves its state out too (it was the device's, 72% high); with the parameters there too, it counts
    the resident weight group (it was 56% low)."""
    _within(_measured(models.build("resnet18", num_classes=CLASSES), 256, 2, False, stages=1, schedule="mp",
                      spatial=2, state_placement=placement))


def test_a_window_that_joins_its_region_in_backward_peaks_as_estimated():
    """Convolutions of 64 filters on 2 tiles of 24 x 48: too few outputs per filter weight to take
    the border's gradients apart (``gems.spatial.window.border_first``), so each backward rebuilds
    its region and makes the region's gradient: copies of the tile PyTorch's own layer does not make,
    priced by ``gems.spatial.limit`` (``copies``): -0.5% when written, 7% low without them."""
    layers = [nn.Conv2d(3, 64, 3, 1, 1), nn.GroupNorm(4, 64), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Conv2d(64, 64, 3, 1, 1), nn.GroupNorm(4, 64), nn.ReLU()]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, CLASSES))
    _within(_measured(model, 48, 4, False, stages=1, schedule="mp", spatial=2))


def test_a_unet_under_mast_peaks_as_estimated_on_every_rank():
    """The U-Net at 128^2 under mast K = 2 on tile groups of 2 (4 ranks), leaders and members, as
    the planner lays it out (a prefix and a suffix on tiles, each group's leader between)."""
    results = _measured(models.build("unet", num_classes=CLASSES, width=8, depth=4, groups=4), 128, 4, True,
                        stages=2, schedule="mast", spatial=2)
    assert len(results) == 4
    _within(results)


def test_a_unet_whose_skip_goes_tile_to_tile_peaks_as_estimated():
    """Cut at up.0.0, the encoder's full-resolution output goes tile to tile (tests/test_tile_skips.py).
    Priced 2-4% high under MPI; here up to 15%: the loopback completes a send as soon as it is
    received, where MPI keeps its buffer until the sender next tests it, as the plan prices it
    (``gems.partition.forward.message_buffers``)."""
    results = _measured(models.build("unet", num_classes=CLASSES, width=8, depth=3, groups=4), 128, 4, True,
                        stages=2, schedule="mast", spatial=2, spatial_end=14, spatial_start=28,
                        split_points=("up.0.0",))
    _within(results, over=0.18)
