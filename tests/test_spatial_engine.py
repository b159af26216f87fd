"""Plans with a spatial part train exactly as one process (gems.pipeline.tiled, gems.spatial).

In process (loopback ranks): a GroupNorm CNN with a 5x5 stride-2 stem, max pooling and residual
blocks, and the zoo's U-Net (long skips, bilinear upsampling, concatenation; per-pixel labels),
at sides that are not powers of two, 2 SGD steps with momentum (the second applies the first's
momentum to weights the first updated); the model's state after them must equal one process
training on the same global batches (1e-5 relative). Layouts: spatial only (K = 1, P = 2
and 4, strips and a 2x2 grid), spatial + gpipe and 1f1b (P = 2, K = 2, m = 2: 3 ranks), spatial +
mast (P = 2, K = 2: 4 ranks; the U-Net's skips leave the tiled stage 0 gathered on the leaders), a
U-Net's tiled suffix under K = 1, mast and one-replica pipelines (its own tile group at position K-1),
spatial with data parallelism, and a prefix tiled with the rest of stage 0 on the leader.

Tests that plan the same model alike share one plan, one trace of its units (each rank gets a deep
copy, its flattened units with it) and one reference run (``_made``, ``_reference``).
"""
from __future__ import annotations

import copy
import functools
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import gems
from gems import partition
from gems.comm import loopback
from gems.graph import graph_units
from gems.schedule.topology import ranks_per_group
from gems.spatial import flatten
from gems.spatial.stage import _FLAT
from models.unet import UNet
from conftest import DISTRIBUTED
from spatial_models import BatchNormNet, GroupNormNet

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]
CLASSES = 5
STEPS = 2


def _unet() -> nn.Module:
    return UNet(num_classes=CLASSES, width=4, depth=3, groups=2)


def _data(batch: int, side: int, step: int, per_pixel: bool = False):
    g = torch.Generator().manual_seed(100 + step)
    labels = (batch, side, side) if per_pixel else (batch,)
    return torch.randn(batch, 3, side, side, generator=g), torch.randint(0, CLASSES, labels, generator=g)


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@functools.cache
def _reference(batch: int, side: int, steps: int, net=GroupNormNet):
    """One process training the whole batches (shared by the tests that compare against the same run;
    the caller only reads it)."""
    torch.manual_seed(0)
    model = net() if net is _unet else net(CLASSES)
    opt = _optimizer(model.parameters())
    losses = []
    for step in range(steps):
        x, y = _data(batch, side, step, net is _unet)
        opt.zero_grad()
        loss = nn.CrossEntropyLoss()(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


class _Made:
    """A model as seeded and planned, kept for every test that plans it alike: handed out as copies."""

    def __init__(self, side: int, net, **options) -> None:
        torch.manual_seed(0)
        self.side, self.model = side, net() if net is _unet else net(CLASSES)
        self.plan = partition.plan(self.model, (3, side, side), device="cpu", **options)
        self._traced = None

    def copies(self, world: int) -> list:
        """``world`` independent copies of the model's units, each flattened: traced and flattened
        once, here in the main thread (fx patches nn.Module while tracing), then deep-copied with
        their flattened units (which share the copy's modules) registered as ``flatten`` keeps them,
        so that no rank's thread traces."""
        if self._traced is None:
            units = graph_units(copy.deepcopy(self.model), (3, self.side, self.side), self.plan.micro_batch_size)
            self._traced = units, [flatten(unit) for unit in units]
        out = []
        for _ in range(world):
            units, flats = copy.deepcopy(self._traced)
            for unit, flat in zip(units, flats):
                _FLAT[unit] = flat
            out.append(units)
        return out


@functools.cache
def _made(side: int, batch: int, K: int, schedule: str, **options) -> _Made:
    return _Made(side, batch_size=batch, stages=K, schedule=schedule, **options)


def _plan(side: int, batch: int, K: int, schedule: str, grid, end=None, groups: int = 1, split: bool = False,
          net=GroupNormNet, m: int = 1, start: int = 0, split_points=None, recompute=None, shard: bool = False):
    """The shared ``_Made`` and a copy of its plan with this spatial part and these recompute segments."""
    made = _made(side, batch, K, schedule, net=net, groups=groups, split_backward=split, micro_batches=m,
                 split_points=tuple(split_points or ()) or None, shard_optimizer=shard)
    plan = copy.deepcopy(made.plan)
    plan.spatial_grid = list(grid)
    plan.spatial_end = plan.cuts[1] if end is None else end
    plan.spatial_start = start
    for s, segments in (recompute or {}).items():
        plan.policies[s].recompute = segments
    plan.check()
    return made, plan


def _train(side: int, batch: int, K: int, schedule: str, grid, end=None, groups: int = 1, steps: int = STEPS,
           split: bool = False, net=GroupNormNet, m: int = 1, start: int = 0, split_points=None, recompute=None,
           made=None, batch_norm: str = "micro-batch", shard: bool = False, probe=None,
           memory_format: str = "contiguous"):
    """Each rank's (state, losses) after ``steps`` steps, and with ``probe`` ``probe(engine)`` third."""
    made, plan = made or _plan(side, batch, K, schedule, grid, end, groups, split, net, m, start, split_points,
                               recompute, shard)
    plan = copy.deepcopy(plan)
    plan.memory_format = memory_format
    world = ranks_per_group(K, schedule, plan.tiles, bool(plan.spatial_start)) * groups
    copies = made.copies(world)

    def rank(comm):
        engine = gems.Engine(copies[comm.rank], copy.deepcopy(plan), optimizer=_optimizer,
                             loss_fn=nn.CrossEntropyLoss(), comm=comm, batch_norm=batch_norm)
        losses = []
        for step in range(steps):
            x, y = _data(batch, side, step, net is _unet)
            losses.append(engine.step(x, y))
        return (engine.state_dict(), losses) + ((probe(engine),) if probe else ())

    return loopback.run(world, rank, semantics="nccl", timeout=60.0)


def _check(results, batch: int, side: int, steps: int = STEPS, net=GroupNormNet):
    ref_state, ref_losses = _reference(batch, side, steps, net)
    state, losses = results[0][:2]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k, v in ref_state.items():
        assert torch.allclose(state[k], v, rtol=1e-5, atol=1e-6 * v.abs().max().item()), k
    for other in results[1:]:
        assert other[1] == losses


@pytest.mark.parametrize("grid", [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_spatial_only_equals_one_process(grid):
    """K = 1: the whole model on one tile group (the pooling sums the tiles)."""
    _check(_train(36, 2, 1, "mp", grid), 2, 36)


def test_spatial_prefix_then_leader():
    """The conv trunk tiled, gathered on the leader before the pooled head."""
    units = _plan(100, 2, 1, "mp", (2, 1))[1].unit_names   # the units graph_units makes of the model
    end = next(i for i, n in enumerate(units) if "adaptive" in n)
    _check(_train(100, 2, 1, "mp", (2, 1), end=end), 2, 100)


@pytest.mark.parametrize("split", [False, True])
def test_spatial_with_mast(split):
    """P = 2, K = 2 under mast: both end positions are tile groups (4 ranks)."""
    _check(_train(36, 4, 2, "mast", (2, 1), split=split), 4, 36)


def _nhwc(engine) -> bool:
    """Whether every 4-D parameter of the rank, and its gradient, is channels_last."""
    return all(p.is_contiguous(memory_format=torch.channels_last) and p.grad.is_contiguous(
        memory_format=torch.channels_last) for s in engine.stages.values() for p in s.parameters() if p.dim() == 4)


@pytest.mark.parametrize("net, K, schedule, batch, grid", [(GroupNormNet, 2, "mast", 4, (2, 1)),
                                                           (_unet, 1, "mp", 2, (2, 2))])
def test_channels_last_on_tiles(net, K, schedule, batch, grid):
    """Tiles, halos, gathers and the skips' concatenations keep NHWC (parameters and gradients are still
    channels_last after the steps on every rank) and train as one process."""
    results = _train(36, batch, K, schedule, grid, net=net, probe=_nhwc, memory_format="channels_last")
    _check(results, batch, 36, net=net)
    assert all(r[2] for r in results)


@pytest.mark.parametrize("grid", [(2, 1), (2, 2)])
def test_a_unet_spatial_only_equals_one_process(grid):
    """The whole U-Net on one tile group: pooling, upsampling and the skips' concatenations on tiles."""
    _check(_train(36, 2, 1, "mp", grid, net=_unet), 2, 36, net=_unet)


def test_a_unet_spatial_with_mast():
    """Stage 0's tiled units hand the decoder's long skips to stage 1 through the leaders' gathers."""
    _check(_train(36, 4, 2, "mast", (1, 2), net=_unet), 4, 36, net=_unet)


# The zoo U-Net's units: the encoder down.0 (full resolution) and down.1, pooled, down.2 at the bottom,
# then interpolate, cat, up.0, and interpolate#2 (unit 28), cat#2, up.1 and the head at full resolution.
UNET_PREFIX, UNET_SUFFIX = 14, 28


@pytest.mark.parametrize("grid", [(2, 1), (2, 2)])
def test_a_unet_with_a_tiled_suffix_equals_one_process(grid):
    """K = 1: the encoder and the full-resolution decoder on tiles, the low-resolution middle on the
    leader (the suffix's inputs, the upsampled map and the long skip, scattered from it)."""
    _check(_train(36, 2, 1, "mp", grid, end=UNET_PREFIX, start=UNET_SUFFIX, net=_unet), 2, 36, net=_unet)


@pytest.mark.parametrize("split", [False, True])
def test_a_unet_with_a_tiled_suffix_under_mast(split):
    """K = 2, mast: stage 0's prefix and stage 1's suffix on the tile groups of both end positions (each
    member holds both stages' tiled units), recompute segments on both sides of the suffix's start."""
    _check(_train(36, 4, 2, "mast", (2, 1), end=UNET_PREFIX, start=UNET_SUFFIX, net=_unet, split=split,
                  split_points=["up.0.0"], recompute={1: [[22, 28], [28, 33]]}), 4, 36, net=_unet)


@pytest.mark.parametrize("K, recompute", [(2, "all"), (4, "none")])
def test_a_planned_unet_suffix_under_mast_equals_one_process(K, recompute):
    """The planner's own choice of prefix, suffix, cuts and policies: K = 2 recomputing on every
    stage; K = 4, where the middle positions are single ranks between the two tile groups."""
    made = _made(36, 4, K, "mast", net=_unet, spatial=(2, 1), recompute=recompute)
    plan = made.plan
    assert 0 < plan.spatial_end <= plan.cuts[1] and plan.cuts[-2] <= plan.spatial_start
    _check(_train(36, 4, K, "mast", None, net=_unet, made=(made, plan)), 4, 36, net=_unet)


def test_recompute_segments_that_start_with_an_in_place_unit():
    """No spatial part: the U-Net under mast with recompute on every stage, whose segments start at
    its ReLU(inplace=True) units (checkpoint keeps a segment's input to recompute from; the
    segment runs on a copy of it)."""
    made = _made(36, 4, 2, "mast", net=_unet, recompute="all")
    plan = made.plan
    names = plan.unit_names
    assert any(names[a].endswith((".2", ".5")) for policy in plan.policies for a, _ in policy.recompute)
    _check(_train(36, 4, 2, "mast", None, net=_unet, made=(made, plan)), 4, 36, net=_unet)


@pytest.mark.parametrize("K, schedule, split", [(2, "1f1b", True), (3, "gpipe", False)])
def test_a_unet_with_a_tiled_suffix_under_one_replica_pipelines(K, schedule, split):
    """Position K-1 a tile group of its own (P = 2: 4 ranks), two micro-batches; with split backward
    the suffix's members walk their tiles' backward in the input half, with their leader (they left
    it to the weight half, and the leader's halos met a member's next scatter); K = 3: a single-rank
    middle position."""
    points = ["up.0.0"] if K == 2 else ["down.2", "up.0.0"]
    _check(_train(36, 4, K, schedule, (2, 1), end=UNET_PREFIX, start=UNET_SUFFIX, net=_unet, m=2, split=split,
                  split_points=points), 4, 36, net=_unet)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_spatial_with_one_replica_pipelines(schedule):
    """P = 2, K = 2, two micro-batches: position 0 a tile group, position 1 one rank (3 ranks)."""
    _check(_train(36, 4, 2, schedule, (2, 1), m=2), 4, 36)


def test_spatial_with_data_parallelism():
    _check(_train(36, 4, 1, "mp", (2, 1), groups=2), 4, 36)


@pytest.mark.parametrize("K, schedule, unet", [(1, "mp", False), (2, "mast", False), (1, "mp", True),
                                               (2, "mast", True)])
def test_predict_on_a_spatial_plan(K, schedule, unet):
    """Forward-only steps: the leader of position 0 returns the model's own outputs; members None
    (the U-Net with a tiled suffix: its outputs gathered from the tiles)."""
    if unet:
        made, plan = _plan(36, 4, K, schedule, (2, 1), end=UNET_PREFIX, start=UNET_SUFFIX, net=_unet,
                           split_points=["up.0.0"] if K == 2 else None)
    else:
        made, plan = _plan(36, 4, K, schedule, (2, 1))
    world = ranks_per_group(K, schedule, 2)
    copies = made.copies(world)
    x, _ = _data(4, 36, 0)

    def rank(comm):
        engine = gems.Engine(copies[comm.rank], copy.deepcopy(plan), optimizer=_optimizer,
                             loss_fn=nn.CrossEntropyLoss(), comm=comm)
        return engine.predict(x)

    outputs = loopback.run(world, rank, semantics="nccl", timeout=60.0)
    with torch.no_grad():
        expected = copy.deepcopy(made.model).eval()(x)
    assert torch.allclose(outputs[0], expected, rtol=1e-5, atol=1e-5)
    assert all(o is None for o in outputs[1:])


def _deferred_reference(batch: int, rows: int, side: int, steps: int):
    """One process, BatchNormNet: each step's micro-batches of ``rows`` images in turn, each
    normalised with its own statistics and writing nothing; after the optimizer step the running
    statistics are updated once from the float64 Σx, Σx², count of the whole global batch."""
    torch.manual_seed(0)
    model = BatchNormNet(CLASSES)
    opt = _optimizer(model.parameters())
    layers = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    sums: dict = {}
    for layer in layers:
        layer.register_forward_pre_hook(lambda m, args: sums.setdefault(m, []).append(args[0].detach().double()))
    for step in range(steps):
        x, y = _data(batch, side, step)
        sums.clear()
        opt.zero_grad()
        for layer in layers:
            layer.track_running_stats = False
        for i in range(0, batch, rows):
            (nn.CrossEntropyLoss()(model(x[i:i + rows]), y[i:i + rows]) * rows / batch).backward()
        opt.step()
        with torch.no_grad():
            for layer in layers:
                layer.track_running_stats = True
                seen = torch.cat([t.transpose(0, 1).reshape(t.shape[1], -1) for t in sums[layer]], 1)
                n = seen.shape[1]
                mean, var = seen.mean(1), (seen.pow(2).sum(1) - n * seen.mean(1) ** 2) / (n - 1)
                layer.num_batches_tracked += 1
                layer.running_mean.copy_(0.9 * layer.running_mean.double() + 0.1 * mean)
                layer.running_var.copy_(0.9 * layer.running_var.double() + 0.1 * var)
    return model.state_dict()


@pytest.mark.parametrize("K, schedule, batch, end", [(1, "mp", 2, 12), (2, "mast", 4, None)])
def test_deferred_batch_norm_with_a_spatial_part(K, schedule, batch, end):
    """--batch-norm deferred: tiled BatchNorm layers add their whole images' statistics once per
    tile group (its first tile), summed over every tile of every copy; the untiled rest over the
    leaders. K = 1 with b2 untiled on the leader (end 12); mast K = 2 (4 ranks, two images per
    micro-batch). Every rank's copy of every layer ends with the running statistics of one batch
    of the whole global batch, parameters as one process."""
    made, plan = _plan(36, batch, K, schedule, (2, 1), end=end, net=BatchNormNet)
    assert any(n.endswith((".n1", ".n2")) for n in plan.unit_names[plan.spatial_end:plan.cuts[1]]) == (K == 1)
    world = ranks_per_group(K, schedule, plan.tiles)
    copies = made.copies(world)

    def rank(comm):
        engine = gems.Engine(copies[comm.rank], copy.deepcopy(plan), optimizer=_optimizer,
                             loss_fn=nn.CrossEntropyLoss(), comm=comm, batch_norm="deferred")
        for step in range(STEPS):
            engine.step(*_data(batch, 36, step))
        own = {(s, k): v.clone() for s, m in engine.stages.items() for k, v in m.state_dict().items()}
        return engine.state_dict(), own

    results = loopback.run(world, rank, semantics="nccl", timeout=60.0)
    ref = _deferred_reference(batch, plan.micro_batch_size, 36, STEPS)
    state = results[0][0]
    assert state.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.allclose(state[k].double(), v.double(), rtol=1e-5, atol=1e-6 * v.abs().max().item()), k
    leaders = {}
    for r, (_, own) in enumerate(results):   # every copy, a member's tiled units too, as its leader's
        for key, v in own.items():
            assert torch.equal(v, leaders.setdefault(key, v)), (r, key)


@pytest.mark.parametrize("K, schedule, batch, end, groups", [(1, "mp", 2, 12, 2), (2, "mast", 4, None, 1)])
def test_a_sharded_optimizer_with_a_spatial_part(K, schedule, batch, end, groups):
    """--shard-optimizer: each part of a tiled stage shares its optimizer over its own sync group --
    the tiled units over every tile of every copy, the leader's untiled rest over the leaders -- and
    equals one process: K = 1 with b2 untiled and two data-parallel groups (tiled units over 4
    ranks, b2 over the 2 leaders), mast K = 2 (tiled units over 4 ranks, stage 1 over 2)."""
    def owned(engine):   # the names of the parameters this rank's optimizer updates
        mine = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
        return [n for m in engine.stages.values() for n, p in m.named_parameters() if id(p) in mine]

    results = _train(36, batch, K, schedule, (2, 1), end=end, groups=groups, shard=True, probe=owned)
    _check(results, batch, 36)
    names = [n for _, _, ranks in results for n in ranks]
    whole = _plan(36, batch, K, schedule, (2, 1), end=end, groups=groups, shard=True)[0].copies(1)[0]
    assert sorted(names) == sorted(n for n, _ in whole.named_parameters())   # each updated by one rank


def test_tiles_on_real_processes_train_like_one_process(run_mpi):
    """The loopback's threads above, as two MPI processes: tests/distributed/spatial_worker.py on
    a 2x1 grid (the worker make gpu-check runs on CUDA) equals one process after three steps."""
    result = run_mpi(2, DISTRIBUTED / "spatial_worker.py", "--device", "cpu", timeout=120)
    assert "ok spatial 2x1 on 2 ranks (cpu)" in result.stdout


def test_loopback_ranks_refuse_a_spatial_plan_on_cuda():
    """Two loopback ranks on CUDA would deadlock in their tiles' backward (one autograd thread per
    device and process): the engine says so before touching the device (checked without a GPU)."""
    made, plan = _plan(36, 2, 1, "mp", (2, 1))
    copies = made.copies(2)

    def build(comm):
        gems.Engine(copies[comm.rank], plan, optimizer=_optimizer,
                    loss_fn=nn.CrossEntropyLoss(), comm=comm, device="cuda")

    with pytest.raises(gems.GemsError, match="spatial plan on CUDA needs one process per rank"):
        loopback.run(2, build, timeout=30.0)


def test_a_unet_on_tiles_uses_the_memory_its_plan_estimates(run_mpi):
    """gems-train, U-Net 256^2 batch 2 on a 2x1 tile group: each rank's measured peak over the second
    step within 10% of its estimate (-0.5% when written). The first step's is about 9% under it:
    the optimizer makes its state (SGD's momentum, the size of the parameters) in its update, at
    that step's end (its summary says so, tests/test_memory.py)."""
    train = Path(sys.executable).parent / "gems-train"
    result = run_mpi(2, train, "--model", "unet", "--task", "segmentation", "--image-size", "256", "--batch-size", "2",
                     "--stages", "1", "--schedule", "mp", "--spatial", "2", "--steps", "2", "--workers", "0",
                     "--no-progress", timeout=180)
    errors = [float(e) for e in re.findall(r"MiB estimated \(([+-][\d.]+)%\)", result.stdout)]
    assert len(errors) == 2 and all(abs(e) <= 10 for e in errors), result.stdout
