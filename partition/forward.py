"""What a forward-only step (evaluation, prediction) holds on each position, at the plan's cuts.

A forward-only step (``gems.pipeline.forward``) runs the training step's forwards under
``torch.no_grad``: nothing is kept for a backward, and no memory policy applies. On a
position, while it computes one forward of stage [lo, hi), the device holds

    static     parameters, gradients, optimizer state and buffers of every stage it holds (they
               stay allocated between training steps, when validation runs);
    working    the forward of one unit u at a time: everything alive at u's input (the stage's
               inputs and what crosses into u, skips the stage reads included) plus u's new allocations under
               no_grad (``UnitProfile.eval_working``); the largest over the stage's units. At the
               last stage, the scores' work on the output is added as two copies of it
               (log-probabilities and one temporary of their size);
    messages   receive buffers posted and not yet consumed, and send buffers whose transfer may
               still be under way.

Receive buffers follow ``gems.pipeline.p2p.Messenger`` exactly: its posting (``gems.schedule.posting``) is a
function of the action lists and ``prefetch`` alone, so :func:`_posted_receives` replays it. When a
send completes depends on timing; a send is counted alive until its receiver has consumed it,
unless that is known to have happened before the forward in question -- the receiver's
consumption happens-before it (vector clocks over the messages of the step). That holds for
every timing of the ranks, so the figure is an upper bound on the messages a forward can meet.

Everything but ``static`` scales with the rows of a micro-batch, so :func:`forward_bytes` gives
the per-position figure at the plan's micro-batch size and ``Plan.forward_peak_bytes`` scales it
to any evaluation batch. Not counted, as for training steps: the batch of images and targets
itself, and (``Engine.predict``) the outputs position 0 collects for the batch.
"""
from __future__ import annotations

import numpy as np

from gems.pipeline.routes import Routes
from gems.schedule import ir
from gems.schedule import generators as schedules
from gems.schedule.members import member_lists
from gems.schedule.posting import PREFETCH, Posting
from gems.schedule.topology import Topology
from .records import ModelProfile


def forward_bytes(profile: ModelProfile, schedule: str, K: int, m: int, cuts: list[int], routes: Routes,
                  prefetch: int = PREFETCH, order: str = "") -> list[int]:
    """Per position, the most a forward-only step holds beyond static memory, per micro-batch of
    the profile's size: working memory of the forward running plus the messages alive then
    (``routes``: the plan's edges, skip connections included, whose packed buffers they are)."""
    eval_working = np.array([u.eval_working for u in profile.units], dtype=np.float64)
    working = []
    for s in range(K):
        lo, hi = cuts[s], cuts[s + 1]
        work = float(np.max(_alive(profile, lo, hi) + eval_working[lo:hi]))
        if s == K - 1:
            work += 2 * profile.units[-1].output_bytes   # the scores on the model's output
        working.append(work)
    sizes = routes.message_bytes(profile.micro_batch_size)            # per edge
    lists = schedules.forward_only(schedule, K, m, routes.skips, order)
    alive = _messages_alive(lists, sizes, prefetch)
    return [int(max(((alive[p][i] + working[a.stage]) for i, a in enumerate(actions) if a.op == ir.FORWARD),
                    default=0.0))
            for p, actions in enumerate(lists)]


def _alive(profile: ModelProfile, lo: int, hi: int) -> np.ndarray:
    """Per unit u of stage [lo, hi): bytes alive at u's input in a forward-only pass -- the
    stage's inputs (held until its forward ends) and what crosses into u, of what the stage
    touches (a skip connection passing by never reaches it)."""
    alive = np.zeros(hi - lo)
    for st in profile.storages:
        if st.boundaries and any(lo <= u < hi for u in st.touchers()):
            if (lo - 1) in st.boundaries:
                alive += st.nbytes
            else:
                alive += st.nbytes * np.isin(np.arange(lo - 1, hi - 1), st.boundaries)
    return alive


def message_buffers(schedule: str, K: int, m: int, routes: Routes, rows: int, split: bool = False,
                    prefetch: int = PREFETCH, order: str = "", members: Topology | None = None) -> list[int]:
    """Per position, the most bytes of message buffers a training step may hold at one of its
    computations beyond what the stages keep anyway: receives posted ahead and not yet consumed
    (activations and gradients: a consumed one becomes the stage's input, or the gradient its
    backward starts from, priced there), and packed sends (``gems.pipeline.packing``) alive until
    their receiver has them -- counted, as above, until the receiver's consumption happens-before:
    an activation message is a copy of what the stage keeps, a gradient message outlives the
    backward that made the gradients it packs. With ``members`` (the layout's topology): a tile
    group member's, its tiles of the skips that go tile to tile (the largest tile's)."""
    lists = schedules.schedule(schedule, K, m, routes.skips, split, order)
    tile = members.tiles - 1 if members is not None else 0
    if members is not None:
        lists = member_lists(lists, members, routes.tile_edges)
    alive = _messages_alive(lists, routes.message_bytes(rows, tile), prefetch, at=ir.COMPUTE)
    return [int(max(per.values(), default=0.0)) for per in alive]


def _messages_alive(lists: list[list[ir.Action]], sizes: dict[tuple[int, int], int], prefetch: int,
                    at: tuple[str, ...] = (ir.FORWARD,)) -> list[dict[int, float]]:
    """Per position, per index of an action of kind ``at`` in its list: bytes of messages that may
    be alive then (sends, and receives posted ahead)."""
    clocks = _clocks(lists)
    consumed_at = {a.message(p): i for p, actions in enumerate(lists)
                   for i, a in enumerate(actions) if a.op in ir.RECVS}
    result = []
    for p, actions in enumerate(lists):
        receiving = _posted_receives(lists, p, prefetch)
        sends = [(j, a.message(p)) for j, a in enumerate(actions) if a.op in ir.SENDS]
        alive: dict[int, float] = {}
        for i, a in enumerate(actions):
            if a.op in at:
                # a send is done once its consumption happens-before this action (clock > index)
                sending = sum(sizes[msg.edge] for j, msg in sends
                              if j < i and clocks[p][i][msg.dst] <= consumed_at[msg])
                alive[i] = sum(sizes[msg.edge] for msg in receiving[i]) + sending
        result.append(alive)
    return result


def _clocks(lists: list[list[ir.Action]]) -> list[list[list[int]]]:
    """Vector clocks: clocks[p][i][q] = how many of q's actions happen before p's action i
    (q = p: i itself), through the messages of the step."""
    K = len(lists)
    at_send: dict[ir.Message, list[int]] = {}
    current = [[0] * K for _ in range(K)]
    clocks: list[list[list[int]]] = [[[] for _ in actions] for actions in lists]
    for p, a in ir.replay(lists):
        clock = current[p]
        if a.op in ir.RECVS:
            clock[:] = [max(x, y) for x, y in zip(clock, at_send[a.message(p)])]
        i = clock[p]
        clocks[p][i] = list(clock)
        clock[p] = i + 1
        if a.op in ir.SENDS:
            at_send[a.message(p)] = list(clock)
    return clocks


def _posted_receives(lists: list[list[ir.Action]], p: int, prefetch: int) -> list[set[ir.Message]]:
    """Per action index of position ``p``: the receives posted and not yet consumed as the action
    starts, as ``gems.pipeline.p2p.Messenger`` posts them (``Posting``)."""
    posting = Posting(lists, p, prefetch)
    posted = set(posting.begin())
    result = []
    for a in lists[p]:
        result.append(set(posted))
        if a.op in ir.RECVS:
            msg = a.message(p)
            posted.update(posting.receive(msg, msg in posted))
            posted.discard(msg)
            posted.update(posting.consumed())
        elif a.op in ir.SENDS:
            posted.update(posting.send(a.message(p)))
            posted.update(posting.after_send())
    return result
