"""Any nn.Module trains exactly like one process: a hand-written U-Net (GroupNorm, concatenated
skips at every level, a 1x1 residual from the input to the logits, per-pixel cross-entropy),
torchvision's convnext_tiny, timm's convnext_atto and segmentation_models_pytorch's Unet
(resnet18 encoder, BatchNorm in eval mode), and a network whose forward torch.fx cannot trace
(sizes through len and math, attention called with three arguments: torch.export's fallback),
split by the graph front-end (gems.graph) and run on loopback ranks (one thread each) under mast,
gpipe and 1f1b, K up to 4, m up to 4, D up to 2.

Compared with one process training the same model on the same global batches: parameters and
losses within 1e-5 (relative), three SGD-momentum steps; the engine's state dict has exactly the
model's own keys.
"""
from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gems
from gems import partition
from gems.comm import loopback
from gems.errors import GemsError
from gems.graph import graph_units
from gems.schedule import generators as sch

from equivalence import check_reference

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

CLASSES, STEPS = 3, 3


class UNet(nn.Module):
    """Three levels; the decoder concatenates the encoder's features of each level; a 1x1
    convolution of the input is added to the logits (a skip across the whole network)."""

    def __init__(self, width: int = 4, classes: int = CLASSES) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.ReLU())

        w = width
        self.down = nn.ModuleList([block(3, w), block(w, 2 * w), block(2 * w, 4 * w)])
        self.middle = block(4 * w, 4 * w)
        self.up = nn.ModuleList([block(8 * w, 2 * w), block(4 * w, w), block(2 * w, w)])
        self.logits = nn.Conv2d(w, classes, 1)
        self.shortcut = nn.Conv2d(3, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips, h = [], x
        for i, down in enumerate(self.down):
            h = down(h)
            skips.append(h)
            if i < len(self.down) - 1:
                h = F.max_pool2d(h, 2)
        h = self.middle(h)
        for up, skip in zip(self.up, reversed(skips)):
            if h.shape[-1] != skip.shape[-1]:
                h = F.interpolate(h, size=skip.shape[2:], mode="nearest")
            h = up(torch.cat([h, skip], dim=1))
        return self.logits(h) + self.shortcut(x)


class Untraceable(nn.Module):
    """A forward fx cannot trace symbolically but torch.export can: ``len`` of a batch,
    ``math.sqrt`` of a size; BatchNorm (collapsed back into its module call), attention
    called with three arguments (kept as ATen ops, never cut apart), a skip across the attention."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        h = self.stem(x)
        tokens = h.reshape(len(x), h.shape[1], -1).transpose(1, 2) / math.sqrt(h.shape[1])  # a token a pixel
        mixed, _ = self.attention(tokens, tokens, tokens)
        return self.head(mixed.mean(1) + h.mean((2, 3)))


class ViewWrite(nn.Module):
    """An in-place activation on a view of a stage's input (torchvision's EfficientNet: flatten,
    then Dropout(inplace=True)): the stage must write a copy, not the received tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.act = nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True)
        self.head = nn.Linear(4 * 8 * 8, CLASSES)

    def forward(self, x):
        return self.head(self.act(torch.flatten(self.conv(x), 1)))


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "view-write":
        return ViewWrite()
    if kind == "unet":
        return UNet()
    if kind == "untraceable":
        return Untraceable().eval()   # BatchNorm frozen: statistics of the global batch otherwise
    if kind == "torchvision-convnext":
        import torchvision  # noqa: PLC0415
        return torchvision.models.convnext_tiny(num_classes=CLASSES, stochastic_depth_prob=0.0)
    if kind == "timm-convnext":
        timm = pytest.importorskip("timm")
        return timm.create_model("convnext_atto", num_classes=CLASSES, drop_path_rate=0.0)
    if kind == "smp-unet":
        smp = pytest.importorskip("segmentation_models_pytorch")
        return smp.Unet("resnet18", encoder_weights=None, classes=CLASSES).eval()   # BatchNorm frozen
    raise ValueError(kind)


SEGMENTATION = {"unet", "smp-unet"}
SIDE = {"unet": 12, "torchvision-convnext": 32, "timm-convnext": 32, "smp-unet": 32, "untraceable": 8, "view-write": 8}


def data(kind: str, batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    side = SIDE[kind]
    x = torch.randn(batch, 3, side, side, generator=g)
    shape = (batch, side, side) if kind in SEGMENTATION else (batch,)
    return x, torch.randint(0, CLASSES, shape, generator=g)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@functools.lru_cache(maxsize=None)
def reference(kind: str, batch: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = build(kind)
    opt = sgd(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = data(kind, batch, step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def run(kind: str, schedule: str, K: int, m: int, D: int, split_points: list[str] | None = None) -> None:
    batch = D * sch.replicas(schedule) * m * 2
    model = build(kind)
    plan = partition.plan(model, input_shape=(3, SIDE[kind], SIDE[kind]), batch_size=batch, stages=K,
                          schedule=schedule, micro_batches=m, groups=D, split_points=split_points)
    # torch.fx patches nn.Module process-wide while it traces, so the loopback ranks (threads of
    # this process) get the traced units, made here; ranks that are processes pass the model.
    units = graph_units(model, plan.input_shape, plan.micro_batch_size)
    copies = [copy.deepcopy(units) for _ in range(K * D)]

    def rank(comm):
        engine = gems.Engine(copies[comm.rank], copy.deepcopy(plan), optimizer=sgd,
                             loss_fn=nn.CrossEntropyLoss(), comm=comm)
        losses = [engine.step(*data(kind, batch, step)) for step in range(STEPS)]
        return engine.state_dict(), losses

    results = loopback.run(K * D, rank, timeout=60)
    ref_state, ref_losses = reference(kind, batch)
    where = f"{kind} {schedule} K={K} m={m} D={D}"
    for state, losses in results:
        check_reference(where, state, losses, ref_state, ref_losses)


LAYOUTS = [("mast", 2, 1, 1), ("mast", 3, 1, 1), ("mast", 4, 1, 1), ("gpipe", 2, 4, 1), ("1f1b", 3, 4, 1),
           ("mast", 2, 2, 2)]


@pytest.mark.parametrize("schedule,K,m,D", LAYOUTS, ids=lambda v: str(v))
def test_a_unet_with_long_skips_trains_like_one_process(schedule, K, m, D):
    run("unet", schedule, K, m, D)


# The library models are larger (convnext_tiny: 28M parameters): a few layouts each, together
# covering mast K = 2, 3, 4 and 1f1b with m = 4 (the U-Net above covers D = 2 and gpipe too).
@pytest.mark.parametrize("kind,schedule,K,m,D", [
    ("torchvision-convnext", "mast", 2, 1, 1),
    ("timm-convnext", "mast", 4, 1, 1), ("timm-convnext", "1f1b", 2, 4, 1),
    ("smp-unet", "mast", 3, 1, 1)], ids=lambda v: str(v))
def test_library_models_train_like_one_process(kind, schedule, K, m, D):
    run(kind, schedule, K, m, D)


@pytest.mark.parametrize("schedule,K,m,D", [("mast", 2, 1, 1), ("1f1b", 3, 2, 1), ("mast", 2, 1, 2)],
                         ids=lambda v: str(v))
def test_a_forward_only_torch_export_traces_trains_like_one_process(schedule, K, m, D):
    run("untraceable", schedule, K, m, D)


@pytest.mark.parametrize("schedule", ["mast", "gpipe"])
def test_a_stage_writing_in_place_through_a_view_of_its_input_trains_like_one_process(schedule):
    run("view-write", schedule, 2, 2, 1, split_points=["flatten"])


def test_torch_export_is_the_fallback_and_its_units_are_the_modules_calls():
    model, twin = build("untraceable").train(), build("untraceable").train()
    with pytest.raises(GemsError, match=r"cannot trace Untraceable.forward at .*len\(x\)"):
        graph_units(model, (3, 8, 8), batch=2, tracer="fx")
    units = graph_units(model, (3, 8, 8), batch=2)
    names = units.unit_names
    assert names[:3] == ["stem.0", "stem.1", "stem.2"] and names.count("attention") == 1 and names[-1] == "head"
    assert isinstance(units[1].get_submodule("stem.1"), nn.BatchNorm2d)   # the engine's batch-norm modes apply
    assert {units.model_key(k) for k in units.state_dict()} == set(model.state_dict())
    x = torch.randn(2, 3, 8, 8)
    ours, theirs = units(x), twin(x)
    assert torch.equal(ours, theirs)
    ours.square().sum().backward()
    theirs.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert torch.equal(model.stem[1].running_var, twin.stem[1].running_var)   # the model's own buffers moved


def test_both_tracers_cut_a_torchvision_model_into_the_same_units():
    import torchvision  # noqa: PLC0415
    model = torchvision.models.resnet18(num_classes=CLASSES).eval()
    by_fx = graph_units(model, (3, 32, 32), batch=2, tracer="fx")
    by_export = graph_units(model, (3, 32, 32), batch=2, tracer="export")
    assert by_fx.unit_names == by_export.unit_names and len(by_fx) == 69
    assert [u.meta for u in by_fx] == [u.meta for u in by_export] or \
        [u.meta["gems_reads"] for u in by_fx] == [u.meta["gems_reads"] for u in by_export]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(by_fx(x), by_export(x))


def test_units_are_named_by_module_path_and_run_the_models_forward():
    model = UNet().eval()
    units = graph_units(model, (3, 12, 12), batch=2)
    assert units.unit_names[:3] == ["down.0.0", "down.0.1", "down.0.2"]
    # functions are named by the module whose forward calls them (none for the model's own)
    assert "up.0.0" in units.unit_names and "max_pool2d" in units.unit_names and units.unit_names[-1] == "add"
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        assert torch.equal(units(x), model(x))
    keys = {units.model_key(k) for k in units.state_dict()}
    assert keys == set(model.state_dict())


def test_split_points_fix_where_stages_begin():
    plan = partition.plan(UNet(), input_shape=(3, 12, 12), batch_size=2, stages=3, schedule="gpipe",
                          split_points=["middle", "up.1"])
    names = plan.unit_names
    assert names[plan.cuts[1]].startswith("middle") and names[plan.cuts[2]].startswith("up.1")
    with pytest.raises(GemsError, match="split point 'midle' names no module of the model; did you mean middle"):
        partition.plan(UNet(), input_shape=(3, 12, 12), batch_size=2, stages=2, schedule="gpipe",
                       split_points=["midle"])
    with pytest.raises(GemsError, match="3 stages need 2 split points"):
        partition.plan(UNet(), input_shape=(3, 12, 12), batch_size=2, stages=3, schedule="gpipe",
                       split_points=["middle"])


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        if x.sum() > 0:   # data-dependent control flow: no static graph
            return self.conv(x)
        return x


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.inner = nn.Conv2d(3, 3, 1), DataDependent()

    def forward(self, x):
        return self.inner(self.stem(x))


def test_an_untraceable_forward_is_one_sentence_naming_the_line():
    with pytest.raises(GemsError) as info:
        graph_units(Holder(), (3, 8, 8), batch=1)
    message = str(info.value)
    assert message.startswith("cannot trace Holder.forward at ") and "test_any_model.py" in message
    assert "if x.sum() > 0" in message and "leaf_modules" in message
    assert "torch.export failed too" in message   # the fallback was tried
    units = graph_units(Holder(), (3, 8, 8), batch=1, leaf_modules=[DataDependent])   # the fix works
    assert units.unit_names == ["stem", "inner"]


class WithOptions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x, scale=2.0, mask=None):
        y = self.conv(x) * scale
        return y if mask is None else y * mask


class NeedsTwo(nn.Module):
    def forward(self, x, y):
        return x + y


def test_other_forward_arguments_take_their_defaults():
    model = WithOptions()
    units = graph_units(model, (3, 4, 4), batch=2)
    x = torch.randn(2, 3, 4, 4)
    assert units.unit_names == ["conv", "mul"] and torch.allclose(units(x), model(x))
    with pytest.raises(GemsError, match="NeedsTwo.forward needs y besides the image batch; .* give the other "
                                        "arguments defaults"):
        graph_units(NeedsTwo(), (3, 4, 4), batch=1)


class Pair(nn.Module):
    def forward(self, x):
        return x, 2 * x


class Both(nn.Module):
    def forward(self, pair):
        a, b = pair
        return a + b, b


class Sum(nn.Module):
    def forward(self, pair):
        return pair[0] - pair[1]


def test_a_sequential_takes_the_same_path_with_its_children_as_units():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Pair(), Both(), Sum(), nn.Flatten(), nn.LazyLinear(3))
    model(torch.randn(2, 3, 6, 6))   # materialise the lazy head
    units = graph_units(model, (3, 6, 6), batch=2)
    assert units.unit_names == ["0", "1", "2", "3", "4", "5"]
    # a tuple crosses a boundary as its tensors, and each consumer takes it whole again
    assert [len(u.meta["gems_live_in"]) for u in units] == [1, 1, 2, 2, 1, 1]
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        assert torch.equal(units(x), model(x))
    assert {units.model_key(k) for k in units.state_dict()} == set(model.state_dict())
    plan = partition.plan(model, input_shape=(3, 6, 6), batch_size=2, stages=3, schedule="gpipe", balance=[2, 1, 3])
    # pairs, neighbour to neighbour
    assert plan.routes[1:] == [[[0, 0, True], [0, 1, True]], [[1, 0, True], [1, 1, True]]]
