"""Point-to-point messaging of one position: the transfers its action list names, with prefetch.

Receives are posted ``prefetch`` messages ahead of the one being waited for, so a peer's send
usually finds its receive already waiting; a receive action waits for its message and hands the
tensors to the compute action that follows. Sends are non-blocking, progressed while the rank
computes, and completed before the gradient sync. Every message's identity, tag and buffers
follow from the schedule IR (``Action.message``) and the plan's boundary layouts, so no metadata
travels with the data.
"""
from __future__ import annotations

import torch

from gems.pipeline import ir
from gems.pipeline.topology import Topology


class Messenger:
    """Sends and receives of one rank's action list.

    Args:
        comm: the communicator.
        topology: where the ranks sit (to turn positions into world ranks).
        actions: this position's action list (receives are posted in its order).
        shapes, dtypes: per boundary, the shapes (without the batch dimension) and dtype names
            of the tensors that cross it (``plan.stage_output_shapes`` / ``_dtypes``).
        rows: images per micro-batch (the batch dimension of every message).
        device: where the buffers live.
        prefetch: receives posted ahead of need (at least 1).
    """

    def __init__(self, comm, topology: Topology, actions: list[ir.Action], shapes, dtypes,
                 rows: int, device: torch.device, prefetch: int) -> None:
        self.comm, self.device, self.rows = comm, device, rows
        self.rank = comm.rank
        self.position = topology.coords(comm.rank)[1]
        self._peer_rank = {a.peer: topology.peer(comm.rank, a.peer) for a in actions if a.peer >= 0}
        self._shapes, self._dtypes = shapes, [[getattr(torch, d) for d in ds] for ds in dtypes]
        self.prefetch = max(1, prefetch)
        self._queue = [a for a in actions if a.op in ir.RECVS]
        self._posted: dict[ir.Message, tuple] = {}
        self._consumed = 0
        self._sends: list = []

    def begin_step(self) -> None:
        """Post the first receives of a step."""
        self._posted, self._consumed = {}, 0
        self._post()

    def _post(self) -> None:
        queue = self._queue
        while len(self._posted) < self.prefetch and self._consumed + len(self._posted) < len(queue):
            a = queue[self._consumed + len(self._posted)]
            msg = a.message(self.position)
            bufs = tuple(torch.empty((self.rows, *shape), dtype=dt, device=self.device)
                         for shape, dt in zip(self._shapes[msg.boundary], self._dtypes[msg.boundary]))
            req = self.comm.irecv(bufs, self._peer_rank[a.peer], msg.tag)
            self._posted[msg] = (req, bufs)

    def receive(self, a: ir.Action) -> tuple[torch.Tensor, ...]:
        """Wait for the message of receive action ``a``; its tensors."""
        req, bufs = self._posted.pop(a.message(self.position))
        self.comm.wait(req, f"{a} from rank {self._peer_rank[a.peer]}")
        self._consumed += 1
        self._post()
        return bufs

    def send(self, a: ir.Action, tensors: tuple[torch.Tensor, ...]) -> None:
        """Start sending ``tensors`` as the message of send action ``a`` (in the plan's dtypes)."""
        msg = a.message(self.position)
        data = tuple(t.detach().to(dt).contiguous() for t, dt in zip(tensors, self._dtypes[msg.boundary]))
        self._sends.append(self.comm.isend(data, self._peer_rank[a.peer], msg.tag))
        self.progress()

    def progress(self) -> None:
        """Let the transport move pending sends while this rank computes."""
        self._sends = [r for r in self._sends if not self.comm.test(r)]

    def finish_sends(self) -> None:
        """Wait until every send of the step has completed."""
        for req in self._sends:
            self.comm.wait(req, "a send to complete")
        self._sends = []
