"""The network a gems-bench run predicts with (``gems.schedule.network.Network``), measured
between ranks 0 and 1 through the communicator the engine uses."""
from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from gems.schedule.network import IDEAL, Network


def measure_network(comm, nbytes: int, reduce_bytes: int, repeats: int = 5) -> Network:
    """COLLECTIVE: latency and bandwidth between ranks 0 and 1 by ping-pong through ``comm``
    (its polling waits included, as the engine sees them), the rate at which a collective moves
    ``reduce_bytes`` between them (an allgather of two halves: the sharded optimizer's exchange, half
    an allreduce's traffic), and the rate at which they add: what an allreduce of ``reduce_bytes``
    takes beyond its messages; free communication on one rank."""
    if comm.size < 2:
        return IDEAL
    pair = comm.group([0, 1])
    result = [0.0, 0.0]
    if comm.rank < 2:
        peer = 1 - comm.rank
        for i, size in enumerate((8, max(nbytes, 1 << 20))):
            buf = torch.zeros(size // 4 + 1, dtype=torch.float32)
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                for turn in (0, 1):
                    if turn == comm.rank:
                        comm.wait(comm.isend((buf,), peer, 1), "the ping-pong")
                    else:
                        comm.wait(comm.irecv((buf,), peer, 1), "the ping-pong")
                times.append((time.perf_counter() - start) / 2)
            result[i] = statistics.median(times[1:])
        grads = torch.zeros(max(reduce_bytes, 4) // 4, dtype=torch.float32, device=comm.device)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            comm.allreduce(grads, pair, "the allreduce timing")
            times.append(time.perf_counter() - start)
        result.append(statistics.median(times[1:]))
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            comm.wait(comm.iallgather_runs(grads, [0, grads.numel() // 2, grads.numel()], pair), "the allgather timing")
            times.append(time.perf_counter() - start)
        result.append(statistics.median(times[1:]))
    latency, large, reduce, gather = comm.allgather_object(result)[0]
    size = max(nbytes, 1 << 20)
    # a large message's time less the latency; a noisy latency as large as it: the whole time
    bandwidth = size / (large - latency if large > 1.5 * latency else large)
    reduced = max(reduce_bytes, 4) // 4 * 4
    network = Network(latency=latency, bandwidth=bandwidth,
                      collective_bandwidth=reduced / 2 / max(gather - latency, 1e-9))
    adding = reduce - network.allreduce_time(reduced, 2, latency, network.collective(bandwidth))   # beyond them
    return replace(network, reduce_bandwidth=reduced / 2 / adding if adding > 0 else None)
