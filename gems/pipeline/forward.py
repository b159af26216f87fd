"""Forward-only steps on the training ranks: evaluation and prediction, nothing kept for backward.

``schedule.forward_only`` keeps a training step's forwards and their messages, so under
``mast`` both mirrored replicas compute from the first moment and a K = 2 pipeline runs two
micro-batches at once on its two ranks. Each forward runs under ``torch.no_grad`` with the
stages in eval mode (BatchNorm uses its running statistics, dropout is off; the modes are put
back afterwards): nothing is saved for a backward and no memory policy applies, so a forward
step needs the parameters, one micro-batch's working activations and its boundaries -- less
than the training step the plan was priced for.

The batch size is free (it need not be the plan's): the boundary shapes scale with the rows
of a micro-batch, and one ``Forwards`` serves one batch size (the engine keeps one per size).
"""
from __future__ import annotations

from typing import Callable

import torch

from gems.pipeline.batches import MicroBatches
from gems.pipeline.p2p import Messenger
from gems.pipeline.routes import Routes
from gems.pipeline.stage import StageRunner, unpack
from gems.schedule import ir
from gems.schedule import generators as sch
from gems.schedule.members import member_lists
from gems.schedule.topology import Topology

# sink(replica, micro, rows of the group's shard, output of the last stage)
Sink = Callable[[int, int, slice, torch.Tensor], None]


class Forwards:
    """Runs the forward-only action list of one position for global batches of ``batch_size``."""

    def __init__(self, comm, topology: Topology, plan, routes: Routes, position: int, group: int,
                 runners: dict[int, StageRunner], batch_size: int, device: torch.device,
                 autocast: torch.dtype | None, prefetch: int, tile: int,
                 arrive: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.runners, self.device, self.autocast = runners, device, autocast
        self.last_stage = plan.stages - 1
        self.routes = routes
        lists = sch.forward_only(plan.schedule, plan.stages, plan.micro_batches, self.routes.skips, plan.order)
        # tile > 0: a tile group's member: its tiled stages' forwards and its tiles' skips only (gems.pipeline.tiled)
        self.tile, self.member = tile, tile > 0
        self.arrive = arrive   # rows of the images -> stage 0's input on the device (the engine's)
        lists = member_lists(lists, topology, routes.tile_edges) if self.member else lists
        self.actions = lists[position]
        self.batches = MicroBatches(batch_size, topology.groups, group, sch.replicas(plan.schedule),
                                    plan.micro_batches, comm.rank)
        self.messenger = Messenger(comm, topology, lists, position, self.routes, self.batches.rows_per_micro, device,
                                   prefetch, tile)
        self._sends: dict[tuple[int, int, int], int] = {}   # key -> sends of its output in a step
        for a in self.actions:
            if a.op == ir.SEND_ACT:
                key = (a.replica, a.micro, a.stage)
                self._sends[key] = self._sends.get(key, 0) + 1
        self.current: ir.Action | None = None

    @torch.no_grad()
    def run(self, images: torch.Tensor | None, sink: Sink) -> None:
        """One forward step on this group's ``images`` (None where this rank holds no first stage);
        ``sink`` gets every last-stage output this rank computes."""
        modules = [r.module for r in self.runners.values()]
        modes = [[m.training for m in module.modules()] for module in modules]
        for module in modules:
            module.eval()
        outputs: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        inbox: dict[tuple[int, int, int], dict] = {}     # key -> {edge: tensors}
        left: dict[tuple[int, int, int], int] = {}       # key -> sends of its output still to come
        try:
            self.messenger.begin_step()
            for a in self.actions:
                self.current = a
                key = (a.replica, a.micro, a.stage)
                if a.op == ir.RECV_ACT:
                    inbox.setdefault(key, {})[a.message(self.messenger.position).edge] = self.messenger.receive(a)
                elif a.op == ir.SEND_ACT:
                    edge = a.message(self.messenger.position).edge
                    self.messenger.send(a, self.routes.sent(edge, outputs[key], self.tile))
                    left[key] -= 1
                    if not left[key]:
                        del outputs[key], left[key]
                else:
                    rows = self.batches.rows(a.replica, a.micro)
                    if a.stage == 0:
                        inputs = (self.arrive(images[rows]),)
                    elif self.member and key not in inbox:   # a suffix's inputs come from the leader's scatter
                        inputs = (torch.zeros((), device=self.device),)
                    else:   # a member's: its tiles of the skips, the rest from the scatter
                        link = torch.zeros((), device=self.device) if self.member else None
                        inputs = self.routes.assemble(a.stage, inbox.pop(key), self.device, self.tile, link)
                    with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
                        out = self.runners[a.stage].forward(inputs, key, waiting=False)
                    if self.member:
                        if key in self._sends:
                            outputs[key], left[key] = out, self._sends[key]
                        continue
                    if a.stage == self.last_stage:
                        sink(a.replica, a.micro, rows, unpack(out))
                    else:
                        outputs[key], left[key] = out, self._sends[key]
            self.messenger.finish_sends()
            self.current = None
        finally:
            for module, flags in zip(modules, modes):
                for m, flag in zip(module.modules(), flags):
                    m.training = flag


def gather_outputs(comm, topology: Topology, plan, position: int, outputs: dict[tuple[int, int], torch.Tensor],
                   batches: MicroBatches, device: torch.device) -> torch.Tensor | None:
    """Position 0 receives the outputs position K-1 computed and assembles the group's rows
    (``Engine.predict``); None on every other position."""
    last, m = plan.stages - 1, plan.micro_batches
    dtype = getattr(torch, plan.stage_output_dtypes[last][0])
    tag = lambda r, j: 4 * m + r * m + j   # noqa: E731 - above every step tag (ir.Message.tag)
    if position == last and position != 0:
        to = topology.peer(comm.rank, 0)
        requests = [comm.isend((out.to(dtype).contiguous(),), to, tag(r, j)) for (r, j), out in sorted(outputs.items())]
        for req in requests:
            comm.wait(req, "sending outputs to position 0")
        return None
    if position != 0:
        return None
    shape = plan.stage_output_shapes[last][0]
    replicas = sch.replicas(plan.schedule)
    result = torch.empty((batches.rows_per_micro * batches.m * replicas, *shape), dtype=dtype, device=device)
    pending = []
    for r in range(replicas):
        for j in range(m):
            rows = batches.rows(r, j)
            if (r, j) in outputs:
                result[rows] = outputs[(r, j)]
            else:
                pending.append(comm.irecv((result[rows],), topology.peer(comm.rank, last), tag(r, j)))
    for req in pending:
        comm.wait(req, f"outputs from position {last}")
    return result
