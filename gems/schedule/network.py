"""The network a simulated step runs on: latency and bandwidth of each link, inside a node and between
nodes, and what a collective of B bytes over n ranks costs on it (``gems.schedule.simulate`` replays
the action lists with these costs; ``gems.obs.network`` measures one). Pure Python."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Network:
    """Point-to-point and allreduce costs. ``latency``/``bandwidth`` hold for every link, or,
    with ``ranks_per_node`` set, between nodes; ``intra_*`` then hold inside a node (consecutive
    ranks share a node). Ring allreduce of B bytes on n ranks: 2(n-1)/n B/bw + 2(n-1) latency;
    tree: 2 ceil(log2 n) (latency + B/bw); plus, with ``reduce_bandwidth``, the additions:
    (n-1)/n B (ring) or ceil(log2 n) B (tree) at that many bytes/s (None: free, as a GPU's; a
    CPU rank adds at memory speed, a cost of the order of the copies: gems-bench measures it).
    An allgather is the ring's second half (the tree's broadcast half), without additions.
    Rings that leave a node share its network link (bandwidth divided by their number: a
    conservative bound, as if they all ran at once)."""

    latency: float = 5e-6          # seconds per message
    bandwidth: float = 10e9        # bytes/s per directed link
    allreduce: str = "ring"
    ranks_per_node: int | None = None
    intra_latency: float | None = None     # None: same as latency
    intra_bandwidth: float | None = None   # None: same as bandwidth
    reduce_bandwidth: float | None = None  # bytes/s a rank adds a received chunk into its own; None: free
    # bytes/s at which a collective moves its large pieces over a link (None: ``bandwidth``); on CPU
    # ranks memory-bound copies make it slower than a ping-pong of one message (gems-bench measures it)
    collective_bandwidth: float | None = None

    def collective(self, bandwidth: float) -> float:
        """A link's ``bandwidth`` as collectives see it."""
        return bandwidth if self.collective_bandwidth is None else min(bandwidth, self.collective_bandwidth)

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(latency, bandwidth) between ranks a and b."""
        if self.ranks_per_node and a // self.ranks_per_node == b // self.ranks_per_node:
            return (self.latency if self.intra_latency is None else self.intra_latency,
                    self.bandwidth if self.intra_bandwidth is None else self.intra_bandwidth)
        return self.latency, self.bandwidth

    def allreduce_time(self, nbytes: float, ranks: int, latency: float, bandwidth: float) -> float:
        if ranks <= 1:
            return 0.0
        added = ((ranks - 1) / ranks if self.allreduce == "ring" else math.ceil(math.log2(ranks))) * nbytes
        adding = 0.0 if self.reduce_bandwidth is None else added / self.reduce_bandwidth
        return 2 * self.allgather_time(nbytes, ranks, latency, bandwidth) + adding

    def allgather_time(self, nbytes: float, ranks: int, latency: float, bandwidth: float) -> float:
        """Every rank's 1/n of B bytes to all n (the sharded optimizer's parameter exchange)."""
        if ranks <= 1:
            return 0.0
        if self.allreduce == "ring":
            return (ranks - 1) / ranks * nbytes / bandwidth + (ranks - 1) * latency
        return math.ceil(math.log2(ranks)) * (latency + nbytes / bandwidth)


IDEAL = Network(latency=0.0, bandwidth=math.inf)   # free communication
# A V100 cluster in the style of Lassen/Summit: 4 GPUs per node on NVLink2, EDR InfiniBand between nodes.
V100_CLUSTER = Network(latency=5e-6, bandwidth=12.5e9, ranks_per_node=4, intra_latency=2e-6, intra_bandwidth=150e9)
