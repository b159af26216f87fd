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

With a spatial part, a skip from stage 0's tiled prefix to the last stage's tiled suffix that no
unit between reads (``gems.spatial.stage.tile_skips``) travels tile to tile: on its edge, the
message of the rank holding tile t carries tile t of it (``tile``: 0 is the leader, whose message
carries the edge's other tensors whole beside its tile), to the rank holding tile t of the
consumer's tile group (``gems.schedule.members``).
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

import torch

from gems.errors import GemsError
from gems.graph import stage_routes
from gems.graph.split import LIVE_IN
from gems.pipeline.packing import Layout
from gems.plan.edges import edge_tensors
from gems.schedule import ir
from gems.schedule.members import member_lists
from gems.schedule.topology import Topology
from gems.spatial.geometry import parts
from gems.spatial.stage import tile_skips


class Edge(NamedTuple):
    producer: int
    consumer: int
    sources: tuple[int, ...]     # positions in the producer's output tuple
    targets: tuple[int, ...]     # positions in the consumer's input tuple
    grads: tuple[bool, ...]      # per tensor: whether its gradient goes back
    tiled: tuple[bool, ...]      # per tensor: whether it travels tile to tile


class Routes:
    """The edges of a plan (module docstring)."""

    def __init__(self, routes: list, shapes: list, dtypes: list[list[str]], memory_format: str = "contiguous",
                 tiled: Collection[int] = (), grid: Sequence[int] = (1, 1)) -> None:
        """``routes``, ``shapes``, ``dtypes``, ``memory_format``: a plan's ``routes``, ``stage_output_shapes``,
        ``stage_output_dtypes`` (per stage; routes may be empty: relay) and ``memory_format``;
        ``tiled``: the places in stage 0's output of the tensors that go tile to tile to the last
        stage (``tiled_sources``), on ``grid``."""
        self.routes, self.shapes, self.names, self.memory_format = routes, shapes, dtypes, memory_format
        self.grid = tuple(grid)
        self.dtypes = [[getattr(torch, d) for d in ds] for ds in dtypes]
        # input tuples: stage 0 takes the images; without routes, each its neighbour's whole output
        self.widths = [1] + ([len(r) for r in routes[1:]] if routes else [len(d) for d in dtypes[:-1]])
        self.edges: dict[tuple[int, int], Edge] = {}
        for (i, j), items in edge_tensors(routes, [len(d) for d in dtypes]).items():
            grads = tuple(g and self.dtypes[i][src].is_floating_point for src, _, g in items)
            skip = tuple(i == 0 and j == len(dtypes) - 1 and src in tiled for src, _, _ in items)
            self.edges[(i, j)] = Edge(i, j, tuple(s for s, _, _ in items), tuple(t for _, t, _ in items), grads, skip)

    @classmethod
    def of(cls, plan, units: torch.nn.Sequential | None = None) -> Routes:
        """A plan's routes; ``units``: the model's chain, checked against them when given (and
        needed to find the skips that go tile to tile)."""
        if units is not None and plan.routes and plan.routes != stage_routes(units, plan.cuts):
            raise GemsError("the plan's routes between stages are not this model's: make the plan from this "
                            "model, at this image size and batch")
        tiled = tiled_sources(units, plan.cuts, plan.spatial_end, plan.spatial_start) if units is not None else ()
        return cls(plan.routes, plan.stage_output_shapes, plan.stage_output_dtypes, plan.memory_format, tiled,
                   plan.spatial_grid or (1, 1))

    def message_bytes(self, rows: int, tile: int = 0) -> dict[tuple[int, int], int]:
        """Bytes of each edge's forward message for micro-batches of ``rows`` images, as the rank
        holding ``tile`` sends it."""
        return {edge: self.layout("act", edge, rows, tile).nbytes for edge in self.edges}

    @property
    def tile_edges(self) -> set[tuple[int, int]]:
        """The edges that carry a tensor tile to tile (a tile group's members exchange their messages)."""
        return {edge for edge, e in self.edges.items() if any(e.tiled)}

    def carried(self, edge: tuple[int, int], tile: int) -> list[int]:
        """The tensors of ``edge`` (places in it) that the message of the rank holding ``tile``
        carries: a leader's (tile 0) every one, a member's the tiled ones."""
        return [k for k, tiled in enumerate(self.edges[edge].tiled) if tiled or not tile]

    @property
    def skips(self) -> list[tuple[int, int]]:
        """Edges between stages that are not neighbours."""
        return [e for e in self.edges if e[1] > e[0] + 1]

    def layout(self, kind: str, edge: tuple[int, int], rows: int, tile: int = 0) -> Layout:
        """The packed layout of an edge's ``act`` or ``grad`` message of ``rows`` images, as the
        rank holding ``tile`` sends or receives it."""
        e = self.edges[edge]
        carried = [k for k in self.carried(edge, tile) if kind == "act" or e.grads[k]]
        return Layout([self._shape(e, k, tile) for k in carried],
                      [self.dtypes[e.producer][e.sources[k]] for k in carried], rows, self.memory_format)

    def received_bytes(self, lists: list[list[ir.Action]], topology: Topology, rows: int) -> list[list[int]]:
        """Per position, the message bytes each of its ranks -- its leader, then each member of its
        tile group -- receives in one step of ``lists`` (what ``Comm.received`` counts below the
        tile tag), for micro-batches of ``rows`` images."""
        members = member_lists(lists, topology, self.tile_edges)
        return [[sum(self.layout(msg.kind, msg.edge, rows, t).nbytes
                     for msg in (a.message(p) for a in (members if t else lists)[p] if a.op in ir.RECVS))
                 for t in range(topology.width(p))] for p in range(topology.stages)]

    def _shape(self, e: Edge, k: int, tile: int) -> tuple[int, ...]:
        """Tensor ``k`` of an edge without its batch dimension: whole, or ``tile`` of a tiled one."""
        shape = tuple(self.shapes[e.producer][e.sources[k]])
        if not e.tiled[k]:
            return shape
        (i, j), (rows, cols) = divmod(tile, self.grid[1]), self.grid
        (r0, r1), (c0, c1) = parts(shape[-2], rows)[i], parts(shape[-1], cols)[j]
        return (*shape[:-2], r1 - r0, c1 - c0)

    def assemble(self, stage: int, received: dict[tuple[int, int], tuple[torch.Tensor, ...]],
                 device: torch.device, tile: int = 0, fill: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Stage ``stage``'s input tuple from its incoming edges' tensors (``received[edge]``, as
        ``tile``'s rank receives them); positions no edge fills get ``fill`` (default an empty
        placeholder)."""
        inputs: list[torch.Tensor | None] = [None] * self.widths[stage]
        for edge, tensors in received.items():
            targets = self.edges[edge].targets
            for k, t in zip(self.carried(edge, tile), tensors):
                inputs[targets[k]] = t
        fill = torch.empty(0, device=device) if fill is None else fill
        return tuple(fill if t is None else t for t in inputs)

    def sent(self, edge: tuple[int, int], outputs: tuple[torch.Tensor, ...], tile: int = 0) -> tuple[torch.Tensor, ...]:
        """The producer's output tensors an edge carries (from the rank holding ``tile``)."""
        sources = self.edges[edge].sources
        return tuple(outputs[sources[k]] for k in self.carried(edge, tile))

    def input_grads(self, edge: tuple[int, int], tensors: tuple[torch.Tensor, ...],
                    tile: int = 0) -> tuple[torch.Tensor, ...]:
        """The gradients an edge sends back for its received ``tensors`` (zeros for unused ones)."""
        grads = self.edges[edge].grads
        return tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                     for t, k in zip(tensors, self.carried(edge, tile)) if grads[k])

    def output_grads(self, stage: int, outputs: tuple[torch.Tensor, ...],
                     received: dict[tuple[int, int], tuple[torch.Tensor, ...]],
                     tile: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(output, its gradient) pairs for a backward of ``stage``: the gradients received on its
        outgoing edges (as ``tile``'s rank receives them), summed where several stages read one output."""
        total: dict[int, torch.Tensor] = {}
        for edge, grads in received.items():
            e = self.edges[edge]
            for source, g in zip([e.sources[k] for k in self.carried(edge, tile) if e.grads[k]], grads):
                total[source] = g if source not in total else total[source] + g
        return [(outputs[s], g) for s, g in sorted(total.items()) if outputs[s].requires_grad]


def tiled_sources(units, cuts: Sequence[int], end: int, start: int) -> set[int]:
    """The places in stage 0's output tuple of the skips that go tile to tile (``tile_skips``)."""
    skips = tile_skips(units, cuts, end, start) if len(cuts) > 2 and cuts[1] < len(units) else frozenset()
    return {k for k, name in enumerate(units[cuts[1]].meta[LIVE_IN]) if name in skips} if skips else set()
