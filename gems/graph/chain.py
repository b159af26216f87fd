"""The graph of an ``nn.Sequential``: its children called one after another, each one unit.

A ``Sequential`` says what its units are (its children, as gems's zoo and users' factories build
them), so it is not traced: its graph is written down, and one propagation on fake tensors at the
plan's micro-batch shape gives every child's value (nothing allocated, no real forward). From
there it goes the way of every traced model (``gems.graph``). Writing the graph rather than
tracing also keeps ``torch.fx`` from patching ``nn.Module`` while other threads run models.
"""
from __future__ import annotations

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from gems.errors import GemsError
from .trace import fake_state, state_of


def chain_graph(model: nn.Sequential, shape: tuple[int, ...], model_name: str | None = None
                ) -> tuple[fx.GraphModule, dict[fx.Node, object]]:
    """``model``'s children as one ``call_module`` each, and every node's fake value on a batch of
    ``shape``. GemsError (``input_error``) where a child cannot take what the previous one gives."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = fake_state(mode, model)
    device = next(iter(state.values())).device if state else torch.device("cpu")
    graph = fx.Graph()
    node = graph.placeholder("x")
    with mode:
        value = torch.empty(shape, device=device)
    values: dict[fx.Node, object] = {node: value}
    for name, child in model.named_children():
        node = graph.call_module(name, (node,))
        try:
            values[node] = _fake_call(mode, child, state_of(state, name), value)
        except GemsError:
            raise
        except (RuntimeError, ValueError, IndexError, TypeError) as error:
            raise input_error(model_name or type(model).__name__, name, shape[1:], error) from None
        value = values[node]
    graph.output(node)
    return fx.GraphModule(model, graph, type(model).__name__), values


def _fake_call(mode: FakeTensorMode, child: nn.Module, state: dict, value: object) -> object:
    """``child``'s output on fake tensors. Only its structure and shapes matter here, so a child
    whose training forward reads a tensor's value (BatchNorm with momentum=None divides by its
    counter) is followed in eval mode."""
    with mode, torch.no_grad():
        try:
            return torch.func.functional_call(child, state, (value,))
        except (DataDependentOutputException, DynamicOutputShapeException):
            if not child.training:
                raise
        modes = {m: m.training for m in child.modules()}
        try:
            child.eval()
            return torch.func.functional_call(child, state, (value,))
        finally:
            for m, training in modes.items():
                m.training = training


def input_error(model_name: str, unit: str, input_shape: tuple[int, ...], error: Exception) -> GemsError:
    """The sentence for a unit that fails on fake tensors of the plan's shape: it decides shapes
    or control flow from tensor values, or the input does not fit the model (too small an image)."""
    if isinstance(error, (DataDependentOutputException, DynamicOutputShapeException)):
        return GemsError(f"unit {unit} of {model_name} reads tensor values to decide shapes or control flow "
                         f"({error}), which a fake-tensor profile cannot follow: make its forward depend on "
                         "tensor shapes only")
    shape = "x".join(str(d) for d in input_shape)
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    small = any(words in reason.lower() for words in ("small", "more than 1 value", "greater than", "less than"))
    fix = "use a larger image size" if small else "use an input shape the model accepts"
    return GemsError(f"{model_name} cannot take {shape} input (unit {unit}: {reason}); {fix}")
