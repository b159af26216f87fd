"""What a tile group's members run of their leaders' action lists (``gems.spatial``, ``topology``).

A member of a position's tile group holds the tiled units of the position's tiled stages (stage 0,
and the last with a suffix) and runs their forwards and backwards in its leader's order, so that
every tile of a group issues its tile exchanges in one order; then the reduces of those stages,
the sync and the step. Of the leader's messages it takes those of the edges that carry tensors
tile to tile (``tiled``: a skip from a tiled prefix to a tiled suffix on another position): on
such an edge each tile's rank sends its tile to the rank holding the same tile at the peer
position, under the message's own identity and tag, and the leaders' message carries the rest
beside their own tile. Pure.

    position 0, tile 1:  F d0.s0  send_act d0.s0 @1  ...  recv_grad d0.s0 @1  B d0.s0  ...
    position 1, tile 1:  recv_act d0.s1 @0  F d0.s1  ...  B d0.s1  send_grad d0.s1 @0  ...
"""
from __future__ import annotations

from collections.abc import Collection

from gems.schedule import ir
from gems.schedule.topology import Topology


def member_list(actions: list[ir.Action], position: int, stages: Collection[int],
                tiled: Collection[tuple[int, int]]) -> list[ir.Action]:
    """A member's list at ``position`` from its leader's ``actions``: compute and reduces of the
    tiled ``stages``, the messages of the ``tiled`` edges, the sync and the step."""
    def kept(a: ir.Action) -> bool:
        if a.op in (ir.SYNC, ir.STEP):
            return True
        if a.op in ir.SENDS or a.op in ir.RECVS:
            return a.message(position).edge in tiled
        return a.stage in stages and (a.op in ir.COMPUTE or a.op == ir.REDUCE)
    return [a for a in actions if kept(a)]


def member_lists(lists: list[list[ir.Action]], topology: Topology,
                 tiled: Collection[tuple[int, int]]) -> list[list[ir.Action]]:
    """Every position's member list (of the tiled stages it holds in ``topology``): what the
    members' messengers take their wire order from. Each is its leader's list with actions
    left out, a send together with its receive, so it completes wherever the leaders' does."""
    return [member_list(actions, p, topology.tiled_stages & set(topology.holds(p)), tiled)
            for p, actions in enumerate(lists)]
