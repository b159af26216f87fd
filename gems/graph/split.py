"""From a traced graph to units: constants folded, calls grouped so every boundary carries only
tensors, one GraphModule per unit over the tensors alive before and after it.

See ``gems.graph`` for the whole front-end.
"""
from __future__ import annotations

import operator

import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef

from gems.errors import GemsError

# GraphModule.meta key (kept by deepcopy): positions of a unit's inputs that some unit writes in place
INPLACE_INPUTS = "gems_inplace_inputs"
# GraphModule.meta keys: the names of the values a unit takes (its input tuple, in order) and the
# positions among them its own computation reads (the others it only passes on)
LIVE_IN, READS = "gems_live_in", "gems_reads"
_CONSTANT_TYPES = (int, float, bool, type(None), str)


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


def fold_constants(graph: fx.Graph, values: dict[fx.Node, object]) -> None:
    """Replace every node whose value is a constant (``_constant``) by that value in its users,
    the forward's arguments after the image batch (their defaults) included."""
    first = next(n for n in graph.nodes if n.op == "placeholder")
    for node in list(graph.nodes):
        if node.op == "output" or node is first or node not in values:
            continue
        ok, constant = _constant(values[node])
        if not ok:
            continue
        for user in list(node.users):
            user.args = fx.node.map_aggregate(user.args, lambda a: constant if a is node else a)
            user.kwargs = fx.node.map_aggregate(user.kwargs, lambda a: constant if a is node else a)
        graph.erase_node(node)
    graph.eliminate_dead_code()


def pack(*parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tuple a module returned, rebuilt from its tensors where a consumer takes it whole."""
    return parts


def unpack_tuples(graph: fx.Graph, values: dict[fx.Node, object]) -> None:
    """Let a tuple of tensors cross unit boundaries (an AmoebaNet cell returns ``(prev, cur)`` and
    the next cell takes it whole): its tensors are taken out right where it is made, and each
    consumer that takes it whole gets it rebuilt (``pack``) right before it, so what crosses a
    boundary is the tensors."""
    for node in list(graph.nodes):
        value = values.get(node)
        if node.op == "output" or not isinstance(value, (tuple, list)) or not value \
                or not all(isinstance(v, torch.Tensor) for v in value):
            continue
        whole = [u for u in node.users if not (u.target is operator.getitem and u.args[0] is node)]
        if not whole:
            continue
        with graph.inserting_after(node):
            parts = []
            for i in reversed(range(len(value))):
                parts.insert(0, graph.call_function(operator.getitem, (node, i)))
                values[parts[0]] = value[i]
        for user in whole:
            with graph.inserting_before(user):
                rebuilt = graph.call_function(pack if isinstance(value, tuple) else _pack_list, tuple(parts))
            values[rebuilt] = value
            user.args = fx.node.map_aggregate(user.args, lambda a: rebuilt if a is node else a)
            user.kwargs = fx.node.map_aggregate(user.kwargs, lambda a: rebuilt if a is node else a)


def _pack_list(*parts: torch.Tensor) -> list[torch.Tensor]:
    return list(parts)


def split(gm: fx.GraphModule, values: dict[fx.Node, object],
          together: dict[fx.Node, tuple[str, str]] | None = None) -> tuple[list[fx.GraphModule], list[str]]:
    """The units of ``gm`` and their names; nodes that ``together`` maps to one (call, module path)
    stay in one unit, named after the module."""
    together = together or {}
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
        inside = i and together.get(node) is not None and together.get(node) == together.get(body[i - 1])
        if not groups or (all(tensor(n) for n in crossing) and not inside):
            groups.append([])
        groups[-1].append(node)
        alive = [n for n in crossing + [node] if last_use[n] > i]
    written = {n for n in [*inputs, *body] if any(_writes_in_place(gm, u, n) for u in n.users)}
    for n in reversed([*inputs, *body]):   # a write through a view (flatten, then an in-place dropout) writes its base
        if n in written:
            written.update(a for a in n.all_input_nodes if _aliases(values.get(a), values.get(n)))
    units, names, live_in = [], [], [inputs[0]]
    for k, group in enumerate(groups):
        last = k + 1 == len(groups)   # the last unit returns the model's output instead
        end = position[group[-1]]
        live_out = [] if last else [n for n in [*live_in, *group] if last_use[n] > end]
        units.append(_unit(gm, group, live_in, live_out, output if last else None, static))
        units[-1].meta[INPLACE_INPUTS] = tuple(i for i, n in enumerate(live_in) if n in written)
        units[-1].meta[LIVE_IN] = tuple(n.name for n in live_in)
        read = {a for n in group for a in n.all_input_nodes}
        if last:
            read.update(output.all_input_nodes)
        units[-1].meta[READS] = tuple(i for i, n in enumerate(live_in) if n in read)
        names.append(together[group[0]][1] if group[0] in together else _name(group))
        live_in = live_out
    return units, _unique(names)


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


def _aliases(a: object, b: object) -> bool:
    """Whether two values are tensors over one storage (one a view of the other)."""
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
        StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage())


def writes_inputs(unit: nn.Module) -> bool:
    """Whether a traced ``unit`` overwrites a tensor it is given (``nn.ReLU(inplace=True)`` first
    thing); False for a module that is not a traced graph."""
    if not isinstance(unit, fx.GraphModule):
        return False
    given = {n for n in unit.graph.nodes if n.op == "placeholder"}
    given |= {n for n in unit.graph.nodes if n.target is operator.getitem and n.args and n.args[0] in given}
    return any(_writes_in_place(unit, user, n) for n in given for user in n.users)


def _writes_in_place(gm: fx.GraphModule, user: fx.Node, value: fx.Node) -> bool:
    """Whether ``user`` overwrites ``value`` (its first argument): a method ending in "_"
    (``add_``), a function or module called with ``inplace=True`` (``F.relu``, ``nn.ReLU``)."""
    if not user.args or user.args[0] is not value:
        return False
    if user.op == "call_method":
        return str(user.target).endswith("_") and not str(user.target).startswith("_")
    if isinstance(user.target, torch._ops.OpOverload):   # an ATen op (torch.export): its schema says
        alias = user.target._schema.arguments[0].alias_info if user.target._schema.arguments else None
        return alias is not None and alias.is_write
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
    if isinstance(n.target, torch._ops.OpOverload):
        what = n.target._opname.rstrip("_")   # add_ (in place) is named add, as fx names it
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
