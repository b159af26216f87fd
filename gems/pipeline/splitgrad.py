"""The backward in two halves: input gradients now, weight gradients later (zero-bubble pipelines).

``input_half`` runs autograd from the stage's outputs to its received inputs only (what the
previous stage waits for), keeping the graph. On the way it captures the gradient arriving at
every *meeting node*: a node of the graph that lies on the path to the inputs and that a
parameter feeds directly or through nodes off that path (a convolution's backward, for its
weight). ``weight_half`` later starts autograd at those nodes with the captured gradients and asks
only for the parameters, so it computes each layer's weight gradient once and never walks the
input path again: together the halves cost about one backward (``benchmarks/split_backward.py``).

Parameters that meet the input path at one node are taken together from it (one
``torch.autograd.grad`` call per node: a convolution's weight and bias, a norm's scale and shift).
A parameter that meets it at several nodes (a weight used twice) or at none (an output computed
from parameters alone) cannot be split out this way: the weight half runs autograd from the
outputs again for those, restricted to them -- exact, at the cost of a second walk. A stage whose
inputs carry no gradient (the first stage, or integer inputs only) has no input half: its whole
backward runs as the weight half.

The idea is torch.distributed.pipelining's ``stage_backward_input``/``stage_backward_weight``;
it is written here against gems's stage (its received leaves, its parameters) because that API is
private to torch's pipeline stages.
"""
from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


@dataclass
class Pending:
    """What the weight half needs, kept from the input half of one micro-batch."""

    outputs: list[torch.Tensor]
    grads: list[torch.Tensor | None] | None
    groups: list[tuple[Node, list[torch.nn.Parameter]]] = field(default_factory=list)   # meeting node, its params
    captured: dict[Node, tuple] = field(default_factory=dict)   # gradient arriving at each meeting node
    rest: list[torch.nn.Parameter] = field(default_factory=list)   # from the outputs again


def _node(t: torch.Tensor) -> Node | None:
    """A tensor's autograd node: its grad_fn, or for a leaf its gradient accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]


def _consumers(roots: list[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from ``roots`` -> the nodes that take its output (reversed edges)."""
    users: dict[Node, list[Node]] = defaultdict(list)
    queue, seen = deque(roots), set(roots)
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            users[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    return users


def _downstream(starts: list[Node], users: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reached from ``starts`` along reversed edges, not entering ``stop``; and the nodes of
    ``stop`` met on the way."""
    seen, met = set(starts), set()
    queue = deque(starts)
    while queue:
        for user in users.get(queue.popleft(), ()):
            if user in seen:
                continue
            if user in stop:
                met.add(user)
                continue
            seen.add(user)
            queue.append(user)
    return seen, met


def input_half(outputs: list[torch.Tensor], grads: list[torch.Tensor] | None, inputs: list[torch.Tensor],
               params: list[torch.nn.Parameter]) -> Pending:
    """Gradients of ``inputs`` (added to their ``.grad``) from ``outputs`` with ``grads`` (None: a
    scalar loss); returns what ``weight_half`` needs."""
    pending = Pending(outputs, grads)
    inputs = [t for t in inputs if t.requires_grad]
    roots = [n for n in map(_node, outputs) if n is not None]
    if not inputs or not roots:
        pending.rest = list(params)
        return pending
    users = _consumers(roots)
    on_input_path, _ = _downstream([_node(t) for t in inputs], users, set())
    meets: dict[torch.nn.Parameter, set[Node]] = {}
    for p in params:
        acc = _node(p)
        if acc in users:   # else it does not reach the outputs: no gradient, as in one backward
            meets[p] = _downstream([acc], users, on_input_path)[1]
    shared: dict[Node, list[torch.nn.Parameter]] = defaultdict(list)
    for p, met in meets.items():
        if len(met) == 1:
            shared[next(iter(met))].append(p)
        else:   # uncovered, or meeting the input path more than once (a weight used twice)
            pending.rest.append(p)
    pending.groups = list(shared.items())
    handles = [node.register_prehook(lambda grad_outputs, node=node: pending.captured.__setitem__(node, grad_outputs))
               for node in shared]
    try:
        found = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for t, g in zip(inputs, found):
        _accumulate(t, g)
    return pending


def _accumulate(t: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Add ``grad`` into ``t.grad`` in place, as autograd does: the engine's gradient buckets
    hold ``.grad`` as views (``gems.pipeline.gradsync``), which must stay the same tensors."""
    if grad is None:
        return
    if t.grad is None:
        t.grad = grad
    else:
        t.grad.add_(grad)


def weight_half(pending: Pending, hand_over: Callable[[torch.Tensor, torch.Tensor | None], bool] | None = None) -> None:
    """Accumulate the parameters' gradients into ``.grad``; frees the graph. ``hand_over(p, grad)``:
    takes a gradient elsewhere instead, returning True (a stage whose parameters live on the host
    hands each to the host tier: ``gems.pipeline.hostweights``)."""
    if pending.rest and pending.outputs:   # no outputs: nothing of this stage reaches a loss
        torch.autograd.backward(pending.outputs, pending.grads, inputs=pending.rest, retain_graph=bool(pending.groups))
    for node, params in pending.groups:
        captured = pending.captured.get(node) or ()
        edges = [GradientEdge(node, i) for i, g in enumerate(captured) if g is not None]
        if not edges:
            continue
        found = torch.autograd.grad(edges, [GradientEdge(_node(p), 0) for p in params],
                                    [g for g in captured if g is not None], retain_graph=True, allow_unused=True)
        for p, grad in zip(params, found):
            if hand_over is None or not hand_over(p, grad):
                _accumulate(p, grad)
    pending.groups.clear()
    pending.captured.clear()
    pending.outputs.clear()
