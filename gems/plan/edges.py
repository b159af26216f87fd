"""Which tensors travel on which edge of a plan, from ``Plan.routes``: read by the runtime
(``gems.pipeline.routes``) and by the plan's text."""
from __future__ import annotations


def edge_tensors(routes: list, widths: list[int]) -> dict[tuple[int, int], list[tuple[int, int, bool]]]:
    """Per edge (producer, consumer): ``(position in the producer's output, position in the
    consumer's input, whether a gradient goes back)`` of each tensor it carries, from ``Plan.routes``
    (``widths``: tensors per stage output). Every pair of neighbours has an edge, perhaps empty;
    without routes each takes its neighbour's whole output (relay)."""
    K = len(widths)
    routes = routes or [[]] + [[[s - 1, q, True] for q in range(widths[s - 1])] for s in range(1, K)]
    found: dict[tuple[int, int], list[tuple[int, int, bool]]] = {(s - 1, s): [] for s in range(1, K)}
    for consumer in range(1, K):
        for target, (producer, source, grad) in enumerate(routes[consumer]):
            if producer >= 0:
                found.setdefault((producer, consumer), []).append((source, target, bool(grad)))
    return dict(sorted(found.items()))
