"""The edges of a plan: which tensors each stage sends to which later stage, and back.

``plan.routes`` (made by ``gems.graph.stage_routes``) says where every input of every stage comes
from. ``Routes`` turns that into edges ``producer -> consumer``: one per pair of neighbouring
stages (possibly empty, so the chain of dependencies the schedules are built on stays whole) and
one per pair of stages a skip connection joins (``skips``: extra messages in the schedule, see
``gems.schedule.generators.schedule``). A plan without routes (a plain ``nn.Sequential``, or made
before routes existed) relays: every stage takes its neighbour's whole output.

Each edge carries, per micro-batch, one packed message forward (``act``: the tensors it names,
in the producer's dtypes) and one back (``grad``: the gradients of the floating-point ones that
are not the model's input). A stage's input tuple is assembled from its incoming edges; a
position no edge fills -- a tensor the stage only passes on -- holds an empty placeholder that
its units pass on untouched, and a gradient for a tensor read by several stages is summed over
their edges.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from gems.errors import GemsError
from gems.graph import stage_routes
from gems.pipeline.packing import Layout
from gems.plan.edges import edge_tensors


class Edge(NamedTuple):
    producer: int
    consumer: int
    sources: tuple[int, ...]     # positions in the producer's output tuple
    targets: tuple[int, ...]     # positions in the consumer's input tuple
    grads: tuple[bool, ...]      # per tensor: whether its gradient goes back


class Routes:
    """The edges of a plan (module docstring)."""

    def __init__(self, routes: list, shapes: list, dtypes: list[list[str]], memory_format: str = "contiguous") -> None:
        """``routes``, ``shapes``, ``dtypes``, ``memory_format``: a plan's ``routes``, ``stage_output_shapes``,
        ``stage_output_dtypes`` (per stage; routes may be empty: relay) and ``memory_format``."""
        self.routes, self.shapes, self.names, self.memory_format = routes, shapes, dtypes, memory_format
        self.dtypes = [[getattr(torch, d) for d in ds] for ds in dtypes]
        # input tuples: stage 0 takes the images; without routes, each its neighbour's whole output
        self.widths = [1] + ([len(r) for r in routes[1:]] if routes else [len(d) for d in dtypes[:-1]])
        self.edges: dict[tuple[int, int], Edge] = {}
        for (i, j), items in edge_tensors(routes, [len(d) for d in dtypes]).items():
            grads = tuple(g and self.dtypes[i][src].is_floating_point for src, _, g in items)
            self.edges[(i, j)] = Edge(i, j, tuple(s for s, _, _ in items), tuple(t for _, t, _ in items), grads)

    @classmethod
    def of(cls, plan, units: torch.nn.Sequential | None = None) -> Routes:
        """A plan's routes; ``units``: the model's chain, checked against them when given."""
        if units is not None and plan.routes and plan.routes != stage_routes(units, plan.cuts):
            raise GemsError("the plan's routes between stages are not this model's: make the plan from this "
                            "model, at this image size and batch")
        return cls(plan.routes, plan.stage_output_shapes, plan.stage_output_dtypes, plan.memory_format)

    def message_bytes(self, rows: int) -> dict[tuple[int, int], int]:
        """Bytes of each edge's forward message for micro-batches of ``rows`` images."""
        return {edge: self.layout("act", edge, rows).nbytes for edge in self.edges}

    @property
    def skips(self) -> list[tuple[int, int]]:
        """Edges between stages that are not neighbours."""
        return [e for e in self.edges if e[1] > e[0] + 1]

    def layout(self, kind: str, edge: tuple[int, int], rows: int) -> Layout:
        """The packed layout of an edge's ``act`` or ``grad`` message of ``rows`` images."""
        e = self.edges[edge]
        sources = e.sources if kind == "act" else [s for s, g in zip(e.sources, e.grads) if g]
        return Layout([self.shapes[e.producer][s] for s in sources], [self.dtypes[e.producer][s] for s in sources],
                      rows, self.memory_format)

    def assemble(self, stage: int, received: dict[tuple[int, int], tuple[torch.Tensor, ...]],
                 device: torch.device) -> tuple[torch.Tensor, ...]:
        """Stage ``stage``'s input tuple from its incoming edges' tensors (``received[edge]``);
        positions no edge fills get an empty placeholder."""
        inputs: list[torch.Tensor | None] = [None] * self.widths[stage]
        for edge, tensors in received.items():
            for target, t in zip(self.edges[edge].targets, tensors):
                inputs[target] = t
        empty = torch.empty(0, device=device)
        return tuple(empty if t is None else t for t in inputs)

    def sent(self, edge: tuple[int, int], outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The producer's output tensors an edge carries."""
        return tuple(outputs[s] for s in self.edges[edge].sources)

    def input_grads(self, edge: tuple[int, int], tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The gradients an edge sends back for its received ``tensors`` (zeros for unused ones)."""
        return tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                     for t, g in zip(tensors, self.edges[edge].grads) if g)

    def output_grads(self, stage: int, outputs: tuple[torch.Tensor, ...],
                     received: dict[tuple[int, int], tuple[torch.Tensor, ...]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(output, its gradient) pairs for a backward of ``stage``: the gradients received on its
        outgoing edges, summed where several stages read one output."""
        total: dict[int, torch.Tensor] = {}
        for edge, grads in received.items():
            e = self.edges[edge]
            for source, g in zip([s for s, keep in zip(e.sources, e.grads) if keep], grads):
                total[source] = g if source not in total else total[source] + g
        return [(outputs[s], g) for s, g in sorted(total.items()) if outputs[s].requires_grad]
