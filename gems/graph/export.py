"""The fallback tracer of the graph front-end: ``torch.export`` for forwards ``torch.fx`` cannot
trace symbolically (``len(x)``, ``range(x.size(0))``, ``math.sqrt(x.shape[1])`` on sizes, calls fx
cannot record). See ``gems.graph`` for what is built from the graph.

Export runs the forward on fake tensors (its example batch is allocated, never read) and records
ATen ops, each tagged with the stack of module calls it came from. They are grouped back by the
outermost leaf module call (the same leaves as the fx tracer: ``torch.nn`` modules and the
caller's ``leaf_modules``): a call that takes one tensor and gives one becomes that module's call
again (``call_module``), so units, costs and cuts mean the same whichever tracer ran -- and a
BatchNorm stays an ``nn.BatchNorm2d`` that the engine's batch-norm modes govern. A leaf call with
several inputs or outputs keeps its ATen ops, which are then never cut apart (``together``). The
graph's parameters and buffers are the model's own tensors (export does not copy them).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from gems.errors import GemsError
from .trace import fake_state, state_of

# node -> (the leaf call it belongs to, the module's path): nodes of one call stay in one unit,
# which is named after the module
Together = dict[fx.Node, tuple[str, str]]


def export_graph(model: nn.Module, shape: tuple[int, ...], is_leaf: Callable[[nn.Module, str], bool]
                 ) -> tuple[fx.GraphModule, dict[fx.Node, object], Together]:
    """The graph of ``model``'s forward on one batch of ``shape`` by ``torch.export``, with every
    node's (fake) value and the leaf calls that keep their ATen ops."""
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    example = torch.empty(shape, device=device)   # export fakes it: never read
    gm = torch.export.export(model, (example,), strict=False).module()
    graph = gm.graph
    for node in list(graph.nodes):   # the input-shape guard: shapes are the plan's by construction
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            graph.erase_node(node)
    output = next(n for n in graph.nodes if n.op == "output")
    tree = pytree.tree_unflatten(list(output.args[0]), gm._out_spec)
    if not all(isinstance(leaf, fx.Node) for leaf in pytree.tree_leaves(tree)):
        raise GemsError(f"{type(model).__name__}.forward returns values that are not tensors")
    output.args = (tree,)
    values = {n: n.meta["val"] for n in graph.nodes if "val" in n.meta}
    for path, holder in gm.named_modules():   # export's holders train by default; the model's may not
        holder.training = model.get_submodule(path).training if _has(model, path) else model.training
    together = _collapse(gm, model, values, is_leaf)
    graph.lint()
    return gm, values, together


def _leaf_call(node: fx.Node, model: nn.Module, is_leaf: Callable[[nn.Module, str], bool]
               ) -> tuple[str, str] | None:
    """(the call's key, the module path) of the outermost leaf module call ``node`` belongs to."""
    for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
        if not path:
            continue
        if not _has(model, path):
            return None
        if is_leaf(model.get_submodule(path), path):
            return key, path
    return None


def _collapse(gm: fx.GraphModule, model: nn.Module, values: dict[fx.Node, object],
              is_leaf: Callable[[nn.Module, str], bool]) -> Together:
    """Replace each leaf call of one tensor in and one out by ``call_module``; return the nodes of
    the other leaf calls, keyed by call."""
    graph = gm.graph
    calls: list[tuple[str, str, list[fx.Node]]] = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        found = _leaf_call(node, model, is_leaf)
        if found is None:
            continue
        if calls and calls[-1][0] == found[0] and calls[-1][2][-1].next is node:
            calls[-1][2].append(node)
        else:
            calls.append((*found, [node]))
    together: Together = {}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = fake_state(mode, model)
    for key, path, nodes in calls:
        inside = set(nodes)
        inputs = {a for n in nodes for a in n.all_input_nodes if a not in inside and a.op != "get_attr"}
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        source = next(iter(inputs)) if len(inputs) == 1 else None
        if source is None or len(outputs) != 1 or not _maps(
                mode, model.get_submodule(path), state_of(state, path), values.get(source), values.get(outputs[0])):
            together.update((n, (key, path)) for n in nodes)
            continue
        _set_submodule(gm, path, model.get_submodule(path))
        with graph.inserting_before(nodes[0]):
            call = graph.call_module(path, (source,))
        call.meta["nn_module_stack"] = nodes[0].meta.get("nn_module_stack", {})
        values[call] = values[outputs[0]]
        outputs[0].replace_all_uses_with(call)
        for n in reversed(nodes):
            graph.erase_node(n)
            values.pop(n, None)
    graph.eliminate_dead_code()
    return together


def _maps(mode: FakeTensorMode, module: nn.Module, state: dict[str, torch.Tensor], value: object,
          result: object) -> bool:
    """Whether calling ``module`` on a tensor like ``value`` alone gives a tensor like ``result``
    (so the call can stand for the ATen ops): tried on fake tensors and ``state``, fake copies of
    its parameters and buffers."""
    if not isinstance(value, torch.Tensor) or not isinstance(result, torch.Tensor):
        return False
    try:
        with mode, torch.no_grad():
            fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
            out = torch.func.functional_call(module, state, (fake,))
    except Exception:  # noqa: BLE001 -- takes other arguments, or fails alone: keep its ATen ops
        return False
    return isinstance(out, torch.Tensor) and out.shape == result.shape and out.dtype == result.dtype


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put the user's own module at ``path`` (export's module holds only its tensors, the same ones)."""
    owner = root
    for name in path.split(".")[:-1]:
        if not hasattr(owner, name):   # export keeps only modules that hold tensors
            owner.add_module(name, nn.Module())
        owner = getattr(owner, name)
    setattr(owner, path.split(".")[-1], module)
