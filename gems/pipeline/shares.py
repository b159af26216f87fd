"""Who updates which parameters under a sharded optimizer (``--shard-optimizer``).

Each member of a sync group owns whole parameters, about 1/n of the elements for each of the n
members; ``GradSync`` lays a part's gradients out again in the order of their owners, so each
member's run is contiguous for the reduce-scatter and the allgather. Every member computes the
same split from the same parameter list, so nothing is exchanged to agree on it.
"""
from __future__ import annotations

from torch import nn


def split_among(params: list[nn.Parameter], n: int) -> tuple[list[nn.Parameter], list[int]]:
    """``params`` in the order of their owners and n + 1 boundaries: member k updates
    ``ordered[b[k]:b[k + 1]]``. Whole parameters, largest first to the member with the fewest
    elements so far (the longest-processing-time rule: a few large weights -- resnet18's four 2.4M
    convolutions of 11.2M elements -- would leave contiguous runs 54 : 46), each member's in their
    given order; no member empty unless there are fewer parameters than members."""
    if len(params) < n:
        return list(params), [min(k, len(params)) for k in range(n + 1)]
    loads, owner = [0] * n, [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        owner[i] = min(range(n), key=lambda k: (loads[k], k))
        loads[owner[i]] += params[i].numel()
    ordered = [p for k in range(n) for p, o in zip(params, owner) if o == k]
    counts = [owner.count(k) for k in range(n)]
    return ordered, [sum(counts[:k]) for k in range(n + 1)]
