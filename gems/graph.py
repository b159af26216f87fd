"""The graph front-end: any ``nn.Module`` as a chain of units the planner may cut between.

    units = graph_units(torchvision.models.resnet50(), input_shape=(3, 2048, 2048), batch=1)
    units.unit_names[:3]     # ['conv1', 'bn1', 'relu']
    units(images)            # the model's own forward, unit after unit

``torch.fx`` traces the model's forward symbolically with its usual leaves (the modules of
``torch.nn``, plus ``leaf_modules`` the caller names); one propagation on fake tensors at the
plan's micro-batch shape (nothing allocated, no real forward) gives every value of the graph.
Then:

* values that are not tensors -- sizes, ``x.shape[2:]``, counts -- become constants of the plan
  (shapes are static for a plan: batch and image size fixed), so no cut ever has to carry one;
* the nodes, in the traced (topological) order, are grouped into units: a node starts a new unit
  unless a value that is not a tensor (a tuple a module returned, a dtype) would cross the
  boundary before it, so every boundary between units is one the planner may cut;
* each unit becomes a small ``GraphModule`` that takes the tensors alive before it and returns
  the tensors alive after it (its own results and the ones it passes on). The result is an
  ``nn.Sequential`` of those units (``GraphUnits``): what the planner profiles and the engine
  runs, unchanged, for any model.

A tensor produced early and used much later (a U-Net's skip connection) is therefore relayed: it
is part of every boundary between its producer and its consumer. The units' parameters are the
model's own (shared, not copied) and keep their names: a unit's state-dict key ``7.layer1.0.conv1.weight``
is the model's ``layer1.0.conv1.weight`` (``model_key``).

Why not ``torch.fx.passes.split_module``: it splits at fixed partitions, while the planner needs
every possible cut priced first; units with explicit live sets give exactly that. The module sits
below both the planner (which prices the units) and the runtime (which runs them): the two must
build the same chain from the same model and plan shape.
"""
from __future__ import annotations

import difflib
import operator
import threading
import traceback
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from gems.errors import GemsError

TORCH_DIR = str(Path(torch.__file__).parent)
_CONSTANT_TYPES = (int, float, bool, type(None), str)


class GraphUnits(nn.Sequential):
    """The units of a traced model, in order; ``unit_names`` are module paths of the model
    (``encoder.layer3.2.conv1``; a function between modules is named after the module whose
    forward calls it, plus the function: ``layer1.0:add``)."""

    def __init__(self, units: Sequence[nn.Module], names: Sequence[str], model: nn.Module) -> None:
        super().__init__(*units)
        self.unit_names = list(names)
        state = model.state_dict()
        self.model_keys = list(state)   # the model's own state-dict keys, in its order
        used = {self.model_key(k) for k in self.state_dict()}
        # what no unit uses (an unused head, say): not trained, kept so state dicts stay whole
        self.extras = {k: v for k, v in state.items() if k not in used}

    def __getitem__(self, idx):
        """A unit, or a slice as a plain ``nn.Sequential`` that keeps the units' numbers (so a
        stage's state-dict keys still map back through ``model_key``)."""
        if isinstance(idx, slice):
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)

    def model_key(self, key: str) -> str:
        """The model's own state-dict key for one of this chain's keys ("7.layer1.0.conv1.weight")."""
        return key.split(".", 1)[1]


def graph_units(model: nn.Module, input_shape: Sequence[int], batch: int,
                leaf_modules: Iterable[type[nn.Module] | str] = ()) -> GraphUnits:
    """``model`` as ``GraphUnits`` for inputs of ``batch`` x ``input_shape`` (see module docstring).

    ``leaf_modules``: module classes, class names or module paths traced as one call (never cut
    inside).
    GemsError naming the offending line and the fix when the forward cannot be traced.
    ``torch.fx`` patches ``nn.Module`` process-wide while it traces: trace before starting other
    threads that run models (one trace at a time is enforced).
    """
    tracer = _Tracer(model, tuple(leaf_modules))
    try:
        with _TRACING:
            graph = tracer.trace(model, (batch, *input_shape))
    except GemsError:
        raise
    except Exception as exc:  # noqa: BLE001 -- any tracing failure becomes one sentence
        raise GemsError(_untraceable(model, exc)) from None
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    values = {n: n.meta[VALUE] for n in gm.graph.nodes if VALUE in n.meta}
    _fold_constants(gm.graph, values)
    return _split(gm, values, model)


VALUE = "gems_value"   # node.meta key: the node's value on the fake input
_TRACING = threading.Lock()
# GraphModule.meta key (kept by deepcopy): positions of a unit's inputs that some unit writes in place
INPLACE_INPUTS = "gems_inplace_inputs"


class _Tracer(fx.Tracer):
    """``torch.fx`` symbolic tracing that also knows every value on a fake input of the plan's
    shape, so a forward may branch on shapes (``if h.shape[-1] != skip.shape[-1]``), unpack
    them (``n, c, h, w = x.shape``) or loop over them: static for a plan, such code takes the
    one path those shapes give. Branching on data (``if x.sum() > 0``) still fails, in one
    sentence. Values are computed with ``FakeTensorMode`` on fake copies of the parameters and
    buffers (so nothing is allocated and no BatchNorm statistic moves), each op as it is traced."""

    def __init__(self, model: nn.Module, leaves: tuple) -> None:
        super().__init__()
        self.leaf_types = tuple(c for c in leaves if isinstance(c, type))
        self.leaf_paths = {p for p in leaves if isinstance(p, str)}
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.fake = {name: self.mode.from_tensor(t) for name, t in
                     [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]}
        self.computing = False     # running real code on fake values: no nodes
        self._forward = None       # the original call of the leaf module being traced
        self._shape: tuple[int, ...] = ()

    def trace(self, root: nn.Module, shape: tuple[int, ...]) -> fx.Graph:  # type: ignore[override]
        self._shape = shape
        return super().trace(root)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return (isinstance(m, self.leaf_types) or qualname in self.leaf_paths or type(m).__name__ in self.leaf_paths
                or super().is_leaf_module(m, qualname))

    def call_module(self, m, forward, args, kwargs):
        if self.computing:
            return forward(*args, **kwargs)
        outer, self._forward = self._forward, (m, forward)
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self._forward = outer

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self.computing:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        node = proxy.node
        if kind == "placeholder":
            device = next(iter(self.fake.values())).device if self.fake else torch.device("cpu")
            node.meta[VALUE] = self.mode.from_tensor(torch.empty(self._shape, device=device))
        elif kind == "get_attr":
            if target in self.fake:
                node.meta[VALUE] = self.fake[target]
            else:   # a plain tensor attribute, not a parameter or buffer
                self.computing = True
                try:
                    node.meta[VALUE] = operator.attrgetter(target)(self.root)
                finally:
                    self.computing = False
        elif kind in ("call_function", "call_method", "call_module"):
            self._compute(node, kind, target, args, kwargs)
        return proxy

    def _compute(self, node: fx.Node, kind: str, target, args, kwargs) -> None:
        known = True

        def value(a):
            nonlocal known
            if isinstance(a, fx.Proxy):
                if VALUE not in a.node.meta:
                    known = False
                return a.node.meta.get(VALUE)
            return a

        a, k = fx.node.map_aggregate(args, value), fx.node.map_aggregate(kwargs, value)
        if not known:
            return
        self.computing = True
        try:
            with self.mode, torch.no_grad():
                if kind == "call_function":
                    node.meta[VALUE] = target(*a, **k)
                elif kind == "call_method":
                    node.meta[VALUE] = getattr(a[0], target)(*a[1:], **k)
                else:
                    module, _ = self._forward
                    state = {n[len(target) + 1:]: t for n, t in self.fake.items() if n.startswith(target + ".")}
                    node.meta[VALUE] = torch.func.functional_call(module, state, a, k)
        except Exception:  # noqa: BLE001 -- unknown value: only branching on it fails
            pass
        finally:
            self.computing = False

    def to_bool(self, obj: fx.Proxy) -> bool:
        value = obj.node.meta.get(VALUE)
        if isinstance(value, (bool, int, float)):
            return bool(value)
        return super().to_bool(obj)   # data-dependent: fx's own TraceError

    def iter(self, obj: fx.Proxy):
        value = obj.node.meta.get(VALUE)
        if isinstance(value, (tuple, list, torch.Size)):
            return iter([obj[i] for i in range(len(value))])
        return super().iter(obj)


def _untraceable(model: nn.Module, exc: Exception) -> str:
    """One sentence: what fx could not trace, where in the user's code, and the fix."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(TORCH_DIR)
              and not f.filename == __file__]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({(frames[-1].line or '').strip()})" if frames else ""
    reason = " ".join(str(exc).split())[:200]
    return (f"cannot trace {type(model).__name__}.forward{where}: {type(exc).__name__}: {reason}; remove data-"
            f"dependent control flow from the forward, or pass the module that holds it in leaf_modules "
            f"(--leaf-module) so that it runs as one unit")


def _constant(value: object) -> tuple[bool, object]:
    """(whether ``value`` can be a constant of the plan, the constant): numbers, strings, None,
    sizes and (nested) tuples or lists of them."""
    if isinstance(value, torch.Size):
        return True, tuple(int(v) for v in value)
    if isinstance(value, _CONSTANT_TYPES):
        return True, value
    if isinstance(value, (tuple, list)):
        parts = [_constant(v) for v in value]
        if all(ok for ok, _ in parts):
            return True, type(value)(c for _, c in parts)
    return False, None


def _fold_constants(graph: fx.Graph, values: dict[fx.Node, object]) -> None:
    """Replace every node whose value is a constant (``_constant``) by that value in its users."""
    for node in list(graph.nodes):
        if node.op in ("placeholder", "output") or node not in values:
            continue
        ok, constant = _constant(values[node])
        if not ok:
            continue
        for user in list(node.users):
            user.args = fx.node.map_aggregate(user.args, lambda a: constant if a is node else a)
            user.kwargs = fx.node.map_aggregate(user.kwargs, lambda a: constant if a is node else a)
        graph.erase_node(node)
    graph.eliminate_dead_code()


def _split(gm: fx.GraphModule, values: dict[fx.Node, object], model: nn.Module) -> GraphUnits:
    graph = gm.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    # What does not depend on the input -- a parameter used by a function (get_attr), a layer
    # scale reshaped from it -- is no unit: each unit that uses it computes it itself, so nothing
    # without a batch dimension crosses a boundary, and a parameter's gradient stays in its stage.
    static: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "get_attr" or (n.op.startswith("call_") and all(a in static for a in n.all_input_nodes)):
            static.add(n)
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output") and n not in static]
    if len(inputs) != 1:
        raise GemsError(f"{gm._get_name()}.forward takes {len(inputs)} inputs; gems feeds it one image batch: "
                        f"give the other arguments defaults")
    position = {n: i for i, n in enumerate(body)}
    last_use = {n: max((position.get(u, len(body)) for u in n.users), default=-1) for n in [*inputs, *body]}
    if inputs[0] not in values or not isinstance(values[inputs[0]], torch.Tensor):
        raise GemsError(f"{gm._get_name()}.forward does not take the image batch as a tensor")

    def tensor(n: fx.Node) -> bool:
        return n.op == "placeholder" or isinstance(values.get(n), torch.Tensor)

    groups: list[list[fx.Node]] = []
    alive = [inputs[0]]
    for i, node in enumerate(body):
        crossing = [n for n in alive if last_use[n] >= i]
        if not groups or all(tensor(n) for n in crossing):
            groups.append([])
        groups[-1].append(node)
        alive = [n for n in crossing + [node] if last_use[n] > i]
    written = {n for n in [*inputs, *body] if any(_writes_in_place(gm, u, n) for u in n.users)}
    units, names, live_in = [], [], [inputs[0]]
    for k, group in enumerate(groups):
        last = k + 1 == len(groups)   # the last unit returns the model's output instead
        end = position[group[-1]]
        live_out = [] if last else [n for n in [*live_in, *group] if last_use[n] > end]
        units.append(_unit(gm, group, live_in, live_out, output if last else None, static))
        units[-1].meta[INPLACE_INPUTS] = tuple(i for i, n in enumerate(live_in) if n in written)
        names.append(_name(group))
        live_in = live_out
    return GraphUnits(units, _unique(names), model)


def _unit(gm: fx.GraphModule, group: list[fx.Node], live_in: list[fx.Node], live_out: list[fx.Node],
          output: fx.Node | None, static: set[fx.Node]) -> fx.GraphModule:
    """A GraphModule computing ``group`` from the tensors ``live_in`` (one argument: the tensor,
    or a tuple of them, as every unit of gems takes what the previous one returned): returns
    ``live_out`` as a tuple (one tensor alone), or, for the last unit, the model's output."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    x = graph.placeholder("x")   # a unit takes one value: a tensor, or a tuple of the tensors alive
    for i, n in enumerate(live_in):
        env[n] = x if len(live_in) == 1 else graph.call_function(operator.getitem, (x, i))
    def arg(a: fx.Node) -> fx.Node:
        if a not in env and a in static:   # computed here from parameters (see _split)
            env[a] = graph.node_copy(a, arg)
        return env[a]

    for n in group:
        env[n] = graph.node_copy(n, arg)
    if output is not None:
        graph.output(fx.node.map_arg(output.args[0], arg))
    else:
        outs = [env[n] for n in live_out]
        graph.output(outs[0] if len(outs) == 1 else tuple(outs))
    return fx.GraphModule(gm, graph, "Unit")


def _writes_in_place(gm: fx.GraphModule, user: fx.Node, value: fx.Node) -> bool:
    """Whether ``user`` overwrites ``value`` (its first argument): a method ending in "_"
    (``add_``), a function or module called with ``inplace=True`` (``F.relu``, ``nn.ReLU``)."""
    if not user.args or user.args[0] is not value:
        return False
    if user.op == "call_method":
        return str(user.target).endswith("_") and not str(user.target).startswith("_")
    if user.op == "call_function":
        return bool(user.kwargs.get("inplace")) or getattr(user.target, "__name__", "").endswith("_")
    if user.op == "call_module":
        return bool(getattr(gm.get_submodule(str(user.target)), "inplace", False))
    return False


def _name(group: list[fx.Node]) -> str:
    """A unit's name: the module path of its first module call, else the enclosing module's
    path and the function's name."""
    for n in group:
        if n.op == "call_module":
            return str(n.target)
    n = group[0]
    stack = list((n.meta.get("nn_module_stack") or {}).values())
    owner = stack[-1][0] if stack else ""
    what = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
    if n.target is operator.getitem:
        what = "getitem"
    return f"{owner}:{what}" if owner else str(what)


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


def check_tied(units: nn.Sequential, cuts: Sequence[int]) -> None:
    """GemsError if a parameter is used by units of two stages (tied weights cut apart): each
    stage would train its own copy. Keep such units in one stage (split points, or the plan)."""
    owner: dict[int, tuple[int, str]] = {}
    for s in range(len(cuts) - 1):
        for i in range(cuts[s], cuts[s + 1]):
            for name, p in units[i].named_parameters():
                first = owner.setdefault(id(p), (s, name))
                if first[0] != s:
                    raise GemsError(f"parameter {name} is used in stage {first[0]} and stage {s}: tied weights "
                                    f"must stay in one stage; cut elsewhere (e.g. --split-points)")


def balance_at(unit_names: Sequence[str], split_points: Sequence[str], stages: int) -> list[int]:
    """Units per stage when stage s+1 begins at the first unit inside module ``split_points[s]``
    (a unit is inside "encoder.layer3" when its name is that path or starts with it and "." or
    ":"). GemsError for a point that names no unit, points out of order, or the wrong count."""
    points = list(split_points)
    if len(points) != stages - 1:
        raise GemsError(f"{stages} stages need {stages - 1} split points, got {len(points)}: {points}")
    starts = [0]
    for point in points:
        inside = [i for i, name in enumerate(unit_names)
                  if name == point or name.startswith((point + ".", point + ":", point + "#"))]
        if not inside:
            close = difflib.get_close_matches(point, sorted({n.split(":")[0] for n in unit_names}), 3)
            raise GemsError(f"split point {point!r} names no module of the model"
                            + (f"; did you mean {', '.join(close)}?" if close else ""))
        if inside[0] <= starts[-1]:
            raise GemsError(f"split point {point!r} does not come after the previous one: give the split points "
                            f"in the order of the forward")
        starts.append(inside[0])
    return [b - a for a, b in zip(starts, [*starts[1:], len(unit_names)])]
