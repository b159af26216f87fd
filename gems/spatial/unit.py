"""Units on tiles: which of a unit's values are tiled, and the unit's graph run tile by tile.

A value of the spatial part is *tiled* (each rank holds its tile of an (N, C, H, W) activation)
when it depends on the image, and *replicated* (every rank holds the same whole value) when it
does not -- a parameter, a constant -- or when it comes out of a global pooling, which sums the
tiles over the group. Operations on replicated values alone run as they are. An operation on a
tiled value runs through its handler in ``gems.spatial.ops`` (``gems.spatial.norm``) when it has one (convolutions,
transposed ones, pooling, interpolation, padding and cropping, BatchNorm and GroupNorm, global
average pooling), tile-locally when it acts per pixel (activations, residual adds, channel
concatenation, products with a replicated (N, C, 1, 1) scale), and not at all otherwise: a
unit holding such an operation (a flatten, attention over the whole image) ends the spatial part
before it, with a sentence naming the unit (``analyse``).

Global sizes come from one fake-tensor pass of the units (``record_sizes``): every handler knows
the whole activation's height and width, so tiles of any size, odd and uneven ones, are exact.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from gems.errors import GemsError
from gems.graph.trace import TRACING
from gems.spatial import norm, ops

POINTWISE_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh,
                     nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.PReLU, nn.Identity, nn.Dropout)
POINTWISE_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.iadd,
                       operator.imul, torch.add, torch.sub, torch.mul, torch.div, torch.relu, torch.relu_,
                       torch.sigmoid, torch.tanh, torch.clamp, F.relu, F.relu6, F.leaky_relu, F.elu, F.gelu,
                       F.silu, F.mish, F.hardswish, F.hardsigmoid, F.hardtanh, F.sigmoid, F.tanh, F.dropout}
POINTWISE_METHODS = {"relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "add", "add_", "mul", "mul_", "sub",
                     "sub_", "div", "div_", "clamp", "clamp_", "contiguous", "clone", "float", "to"}


@dataclass
class Node:
    """What one node of a unit with a tiled input does: ``run(tiles, node, args, kwargs, module)``,
    the global (H, W) of its first tiled input and of its output."""

    run: Callable
    size_in: tuple[int, int]
    size_out: tuple[int, int]
    tiled: bool   # whether its result is tiled


class Unsized(GemsError):
    """A unit's graph, traced on its own, does not run on what the units before it made (a forward
    that branches on its input's type, such as an AmoebaNet cell taking a tensor or a pair, traces
    one branch only): ``unit`` is its index among the units sized, ``found`` the shapes of those
    before it."""

    def __init__(self, unit: int, found: list[dict[fx.Node, tuple]], error: Exception) -> None:
        self.cause = f"{type(error).__name__}: {' '.join(str(error).split()[:20])}"
        super().__init__(f"unit {unit} of the spatial part does not run as traced on its own ({self.cause}); end "
                         "the spatial part before it")
        self.unit, self.found = unit, found


def record_sizes(units: Sequence[fx.GraphModule], image: torch.Size,
                 before: Sequence[nn.Module] = ()) -> list[dict[fx.Node, tuple]]:
    """Per unit, the global shape of every tensor value of its graph, from a fake pass of the
    units in order from an image batch of ``image`` shape, after the units ``before`` them (run
    as they are; eval mode: nothing is updated). ``Unsized`` where a unit's graph fails. Under the
    tracing lock: while fx traces, it sends every module call of the process through its tracer,
    so ranks run as threads (the loopback) must not run modules here meanwhile."""
    found: list[dict[fx.Node, tuple]] = []
    modes = [(m, m.training) for u in [*before, *units] for m in u.modules()]
    try:
        for u in [*before, *units]:
            u.eval()
        # the units' own device: a model built on the meta device (the planner's) is sized there
        device = next((p.device for u in units for p in u.parameters()), torch.device("cpu"))
        with TRACING, FakeTensorMode(allow_non_fake_inputs=True) as mode:
            x = mode.from_tensor(torch.empty(image, device=device))
            for u in before:
                x = u(x)
            for k, u in enumerate(units):
                shapes: dict[fx.Node, tuple] = {}
                try:
                    x = _Recorder(u, shapes).run(x)
                except (RuntimeError, IndexError, TypeError, ValueError, AttributeError) as error:
                    raise Unsized(k, found, error) from None
                found.append(shapes)
    finally:
        for m, training in modes:
            m.training = training
    return found


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, shapes: dict) -> None:
        super().__init__(gm)
        self.shapes = shapes

    def run_node(self, n: fx.Node):
        value = super().run_node(n)
        if isinstance(value, torch.Tensor):
            self.shapes[n] = tuple(value.shape)
        return value


def analyse(unit: fx.GraphModule, name: str, shapes: dict, tiled_in: Sequence[bool]) -> tuple[dict, list[bool]]:
    """{node: Node} for every tiled node of ``unit`` (its inputs tiled as ``tiled_in`` says), and
    which of its outputs are tiled. GemsError naming the unit if an operation cannot be tiled."""
    tiled: set[fx.Node] = set()
    plan: dict[fx.Node, Node] = {}
    placeholder = next(n for n in unit.graph.nodes if n.op == "placeholder")
    for n in unit.graph.nodes:
        if n.op == "placeholder":
            if len(tiled_in) == 1 and tiled_in[0]:
                tiled.add(n)
            continue
        if n.op == "get_attr":
            continue
        if n.op == "output":
            outs = n.args[0] if isinstance(n.args[0], (tuple, list)) else (n.args[0],)
            return plan, [isinstance(o, fx.Node) and o in tiled for o in outs]
        if n.target is operator.getitem and n.args[0] is placeholder and len(tiled_in) > 1:   # the i-th input
            if tiled_in[n.args[1]]:
                tiled.add(n)
            continue
        inputs = [a for a in n.all_input_nodes if a in tiled]
        if not inputs:
            continue
        if len(shapes.get(n, ())) != 4 or any(len(shapes[a]) != 4 for a in inputs):
            raise GemsError(_refusal(name, _describe(unit, n), "turns an image into something else"))
        try:
            run, keeps_tiles = _handler(unit, n)
        except _Refused as why:
            raise GemsError(_refusal(name, _describe(unit, n), str(why))) from None
        plan[n] = Node(_labelled(run, n.target if n.op == "call_module" else f"{name}.{n.name}"),
                       shapes[inputs[0]][2:], shapes[n][2:], keeps_tiles)
        if keeps_tiles:
            tiled.add(n)
    raise AssertionError("a graph without output")


def _labelled(run: Callable, layer: str) -> Callable:
    """``run`` naming its layer to the tile group first: the waits of its exchanges are labelled
    with it on the timeline (``TileGroup.layer``)."""
    def labelled(tiles, node: Node, args, kwargs, module=None):
        tiles.layer = layer
        return run(tiles, node, args, kwargs, module)
    return labelled


def _refusal(name: str, what: str, why: str) -> str:
    return (f"unit {name} cannot run on tiles: {what} {why}; end the spatial part before unit {name} "
            f"(a smaller spatial prefix, or no --spatial)")


def _describe(unit: fx.GraphModule, n: fx.Node) -> str:
    if n.op == "call_module":
        return f"{type(unit.get_submodule(n.target)).__name__} ({n.target})"
    return getattr(n.target, "__name__", str(n.target))


MIXES = "mixes the pixels of the image (or is unknown to the spatial path)"


def _handler(unit: fx.GraphModule, n: fx.Node) -> tuple[Callable, bool]:
    """(run(tiles, node, args, kwargs, module), whether the result is tiled) for the tiled node
    ``n``; ``_Refused`` with the reason when it cannot run on tiles."""
    if n.op == "call_module":
        m = unit.get_submodule(n.target)
        for kinds, make in _MODULES:
            if isinstance(m, kinds):
                return make(m)
        _refuse("is not a layer the spatial path knows how to split")
    if n.op == "call_method":
        if n.target in POINTWISE_METHODS:
            return _pointwise(lambda x, *a, **k: getattr(x, n.target)(*a, **k)), True
        if n.target == "mean":
            return _mean(n), False
        _refuse(MIXES)
    fn = n.target
    if fn in POINTWISE_FUNCTIONS:
        return _pointwise(fn), True
    if fn in _FUNCTIONS:
        return _FUNCTIONS[fn](n)
    if fn is torch.cat and (n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else 0) in (1, -3)):
        return _pointwise(torch.cat), True
    if fn is operator.getitem:
        return _getitem(n), True
    _refuse(MIXES)


def _sized(fn):
    """A handler calling ``fn(x, tiles, size_in, size_out, *rest)``."""
    def run(tiles, node: Node, args, kwargs, module=None):
        return fn(args[0], tiles, node.size_in, node.size_out, *args[1:], **kwargs)
    return run


def _pointwise(fn):
    def run(tiles, node: Node, args, kwargs, module=None):
        for a in [*args, *kwargs.values()]:
            if isinstance(a, torch.Tensor) and a.dim() >= 1 and a.shape[-1] != 1 and a.dim() != 4:
                raise GemsError(f"a tensor of shape {tuple(a.shape)} broadcast over an image's columns cannot run on "
                                "tiles; end the spatial part before it")
        return fn(*args, **kwargs)
    return run


def _mean(n: fx.Node):
    """``x.mean((2, 3), keepdim=True)`` (without keepdim its result is not 4-D: ``analyse`` refuses it)."""
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    if dims is None or sorted(d % 4 for d in (dims if isinstance(dims, (tuple, list)) else [dims])) != [2, 3]:
        _refuse("takes a mean over other axes than the image's")
    return _mean_of_image


def _mean_of_image(tiles, node: Node, args, kwargs, module=None):
    """Global average pooling: the tiles' sums added over the group, over the whole image's pixels."""
    return ops.spatial_sum(args[0], tiles) / (node.size_in[0] * node.size_in[1])


class _Refused(Exception):
    """Why an operation cannot run on tiles."""


def _refuse(why: str):
    raise _Refused(why)


def _module(fn):
    """A handler running ``fn(x, tiles, size_in, size_out, module)``."""
    def run(tiles, node: Node, args, kwargs, module):
        return fn(args[0], tiles, node.size_in, node.size_out, module)
    return run


def _conv(m: nn.Conv2d):
    if m.padding_mode != "zeros":
        _refuse(f"pads with {m.padding_mode!r} (only zero padding splits)")
    return _module(lambda x, t, i, o, m: ops.conv2d(x, t, i, o, m.weight, m.bias, m.stride, m.padding, m.dilation,
                                                     m.groups)), True


def _conv_t(m: nn.ConvTranspose2d):
    if m.padding_mode != "zeros":
        _refuse(f"pads with {m.padding_mode!r} (only zero padding splits)")
    return _module(lambda x, t, i, o, m: ops.conv_transpose2d(x, t, i, o, m.weight, m.bias, m.stride, m.padding,
                                                               m.output_padding, m.groups, m.dilation)), True


def _max_pool(m: nn.MaxPool2d):
    if m.return_indices:
        _refuse("returns indices")
    return _module(lambda x, t, i, o, m: ops.max_pool2d(x, t, i, o, m.kernel_size, m.stride, m.padding,
                                                         m.dilation)), True


def _avg_pool(m: nn.AvgPool2d):
    if m.ceil_mode:
        _refuse("uses ceil_mode (its last windows' divisor is not split)")
    return _module(lambda x, t, i, o, m: ops.avg_pool2d(x, t, i, o, m.kernel_size, m.stride, m.padding, False,
                                                         m.count_include_pad, m.divisor_override)), True


def _adaptive(m: nn.AdaptiveAvgPool2d):
    size = m.output_size if isinstance(m.output_size, (tuple, list)) else (m.output_size, m.output_size)
    if tuple(size) != (1, 1):
        _refuse("pools to a grid other than 1x1")
    return _mean_of_image, False


def _upsample(m: nn.Upsample):
    if m.mode not in ("nearest", "bilinear"):
        _refuse(f"interpolates with mode {m.mode!r} (nearest and bilinear split)")
    return _module(lambda x, t, i, o, m: ops.interpolate(x, t, i, o, m.size, m.scale_factor, m.mode, m.align_corners,
                                                          m.recompute_scale_factor)), True


def _bn(m: nn.BatchNorm2d):
    return _module(lambda x, t, i, o, m: norm.batch_norm(x, t, i, m)), True


def _gn(m: nn.GroupNorm):
    return _module(lambda x, t, i, o, m: norm.group_norm(x, t, i, m.num_groups, m.weight, m.bias, m.eps)), True


def _as_is(m: nn.Module):
    if isinstance(m, nn.Dropout2d) and m.training and m.p > 0:
        _refuse("drops whole channels (one mask per image, not per tile)")
    return (lambda tiles, node, args, kwargs, module: module(*args, **kwargs)), True


def _zero_pad(m: nn.ZeroPad2d):
    return _module(lambda x, t, i, o, m: ops.pad(x, t, i, o, m.padding, "constant", getattr(m, "value", 0.0))), True


_MODULES = [(nn.Conv2d, _conv), (nn.ConvTranspose2d, _conv_t), (nn.MaxPool2d, _max_pool), (nn.AvgPool2d, _avg_pool),
            (nn.AdaptiveAvgPool2d, _adaptive), (nn.Upsample, _upsample), (nn.BatchNorm2d, _bn),
            (nn.GroupNorm, _gn), ((nn.ZeroPad2d, nn.ConstantPad2d), _zero_pad),
            (POINTWISE_MODULES + (nn.Dropout2d,), _as_is)]


def _function_pad(n: fx.Node):
    mode = n.kwargs.get("mode", n.args[2] if len(n.args) > 2 else "constant")
    if mode != "constant":
        _refuse(f"pads with mode {mode!r}")
    return _sized(ops.pad), True


def _function_interpolate(n: fx.Node):
    mode = n.kwargs.get("mode", n.args[3] if len(n.args) > 3 else "nearest")
    if mode not in ("nearest", "bilinear"):
        _refuse(f"interpolates with mode {mode!r}")
    return _sized(ops.interpolate), True


def _function_adaptive(n: fx.Node):
    size = n.kwargs.get("output_size", n.args[1] if len(n.args) > 1 else None)
    if size not in (1, (1, 1), [1, 1]):
        _refuse("pools to a grid other than 1x1")
    return _mean_of_image, False


def _function_gn(n: fx.Node):
    return (lambda tiles, node, args, kwargs, module=None: norm.group_norm(args[0], tiles, node.size_in, *args[1:], **kwargs)), True


def _getitem(n: fx.Node):
    index = n.args[1]
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis or not isinstance(i, slice) for i in index) or len(index) > 4 or \
            any(i.step not in (None, 1) for i in index):
        _refuse("indexes an image other than by plain slices")
    spatial = list(index[2:]) + [slice(None)] * (4 - max(len(index), 2))
    rest = index[:2]

    def run(tiles, node: Node, args, kwargs, module=None):
        x = args[0][rest] if rest else args[0]
        starts = tuple(slice(s.start, s.stop).indices(size)[0] for s, size in zip(spatial, node.size_in))
        return ops.crop(x, tiles, node.size_in, node.size_out, starts)
    return run


def _functions() -> dict:
    table = {F.conv2d: lambda n: (_sized(ops.conv2d), True), torch.conv2d: lambda n: (_sized(ops.conv2d), True),
             F.conv_transpose2d: lambda n: (_sized(ops.conv_transpose2d), True),
             F.max_pool2d: lambda n: (_sized(ops.max_pool2d), True),
             torch.max_pool2d: lambda n: (_sized(ops.max_pool2d), True),
             F.avg_pool2d: lambda n: (_sized(ops.avg_pool2d), True), F.pad: _function_pad,
             F.interpolate: _function_interpolate, F.adaptive_avg_pool2d: _function_adaptive,
             F.group_norm: _function_gn}
    return table


_FUNCTIONS = _functions()
