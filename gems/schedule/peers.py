"""Other systems' schedules in gems's IR, for comparison in the simulator (``gems-sim``).

Both run one pipeline of 2K stages on K positions in a V: stage s on position s for s < K and on
2K-1-s after, so every position holds two stages (like a mast position) and the first and last
stage share position 0. Each position's compute order follows the published construction:

``zbv``        ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", section 6): warm-up forwards,
               then forward / input-gradient / weight-gradient of both stages in turn; zero bubble
               when forward = input-gradient = weight-gradient. Fewer than 2K-1 micro-batches
               drop the missing micro-batches' actions from the full pattern.
``dualpipev``  DualPipeV (DeepSeek-V3's DualPipe cut in half): forwards of both stages, then an
               overlapped forward+backward pair per step (timed here as the forward then the full
               backward: compute is what the comparison counts), input/weight split only in the
               warm-up and the drain. Needs at least 2K micro-batches.

Only orders are taken from these schedules; they run in the simulator, not in the engine
(gems trains with its own ``gems.schedule.generators``). Written in gems's IR so that one simulator
times every schedule the same way.
"""
from __future__ import annotations

from gems.errors import GemsError
from gems.schedule.ir import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from gems.schedule.lowering import lower

PEERS = ("zbv", "dualpipev")
Task = tuple[str, int, int, int]


def v_place(K: int) -> tuple[int, ...]:
    """Position of each of the 2K stages in a V."""
    return tuple(s if s < K else 2 * K - 1 - s for s in range(2 * K))


def peer_schedule(name: str, K: int, n: int) -> list[list[Action]]:
    """Per position, the actions of one step of ``name`` with ``n`` micro-batches (no sync or step)."""
    if name not in PEERS:
        raise GemsError(f"unknown comparison schedule {name!r}: choose one of {', '.join(PEERS)}")
    if not isinstance(K, int) or K < 1 or not isinstance(n, int) or n < 1:
        raise GemsError(f"positions and micro-batches must be positive integers, got {K!r} and {n!r}")
    if name == "dualpipev" and n < 2 * K:
        raise GemsError(f"dualpipev needs at least 2K = {2 * K} micro-batches, got {n}")
    build = _zbv if name == "zbv" else _dualpipev
    orders = [build(K, n, p) for p in range(K)]
    return lower(orders, (v_place(K),), 2 * K, tail=False)


class _Counter:
    """Next micro-batch per (op, stage), and the tasks emitted so far."""

    def __init__(self, keep: int | None = None) -> None:
        self.next: dict[tuple[str, int], int] = {}
        self.tasks: list[Task] = []
        self.keep = keep

    def add(self, op: str, stage: int, counter: str | None = None) -> int:
        key = (counter or op, stage)
        j = self.next.get(key, 0)
        self.next[key] = j + 1
        if self.keep is None or j < self.keep:
            self.tasks.append((op, 0, j, stage))
        return j


def _zbv(K: int, n: int, p: int) -> list[Task]:
    full = max(2 * K - 1, n)   # the pattern for enough micro-batches; extra ones dropped
    c = _Counter(keep=n)
    a, b = p, 2 * K - 1 - p
    for _ in range(2 * (K - p) - 1):
        c.add(FORWARD, a)
    for _ in range(p):
        c.add(FORWARD, b)
        c.add(FORWARD, a)
    for _ in range(K - p):
        c.add(FORWARD, b)
        c.add(BACKWARD_INPUT, b)
        c.add(BACKWARD_WEIGHT, b)
    nf = lambda s: c.next.get((FORWARD, s), 0)   # noqa: E731
    while nf(b) < nf(a) or nf(a) < full:
        if nf(a) < full:
            c.add(FORWARD, a)
        c.add(BACKWARD_INPUT, a)
        c.add(BACKWARD_WEIGHT, a)
        c.add(FORWARD, b)
        c.add(BACKWARD_INPUT, b)
        c.add(BACKWARD_WEIGHT, b)
    for _ in range(p):
        c.add(BACKWARD_INPUT, a)
        c.add(BACKWARD_INPUT, b)
    for _ in range(K - p):
        c.add(BACKWARD_INPUT, a)
        c.add(BACKWARD_WEIGHT, a)
    for s in (b, a):
        while c.next.get((BACKWARD_WEIGHT, s), 0) < c.next.get((BACKWARD_INPUT, s), 0):
            c.add(BACKWARD_WEIGHT, s)
    return c.tasks


def _dualpipev(K: int, n: int, p: int) -> list[Task]:
    c = _Counter()
    a, b = p, 2 * K - 1 - p
    pending: list[tuple[int, int]] = []   # (stage, micro) of weight-gradients not yet run

    def full_backward(s: int) -> None:
        # one full backward counts as both halves of its micro-batch
        c.add(BACKWARD, s, counter=BACKWARD_INPUT)
        c.next[(BACKWARD_WEIGHT, s)] = c.next.get((BACKWARD_WEIGHT, s), 0) + 1

    def backward(s: int, zero_bubble: bool) -> None:
        if zero_bubble:
            pending.append((s, c.add(BACKWARD_INPUT, s)))
        else:
            full_backward(s)

    def weight() -> None:
        if pending:
            s, j = pending.pop(0)
            c.tasks.append((BACKWARD_WEIGHT, 0, j, s))

    for _ in range(2 * (K - p - 1)):
        c.add(FORWARD, a)
    for _ in range(p + 1):
        c.add(FORWARD, a)
        c.add(FORWARD, b)
    for _ in range(K - p - 1):
        backward(b, True)
        weight()
        c.add(FORWARD, b)
    for _ in range(n - 2 * K + p + 1):
        c.add(FORWARD, a)
        full_backward(b)
        c.add(FORWARD, b)
        full_backward(a)
    for _ in range(K - p - 1):
        full_backward(b)
        c.add(FORWARD, b)
        full_backward(a)
    zero_bubble = False
    steps = p + 1
    for i in range(steps):
        if i == steps // 2 and p % 2 == 1:
            zero_bubble = True
        backward(b, zero_bubble)
        if i == steps // 2 and p % 2 == 0:
            zero_bubble = True
        backward(a, zero_bubble)
    for _ in range(K - p - 1):
        weight()
        backward(a, zero_bubble)
    for _ in range(p + 1):
        weight()
    while pending:
        weight()
    return c.tasks
