"""Per-action timing of the engine, cheap enough to leave on.

CPU: two ``perf_counter`` reads per action. CUDA: a pair of events per action on the current
stream, resolved once per step when the timeline is read (one synchronisation, after the
step's own loss readout has already synchronised), so the hot path never waits for the device.
Times are seconds from the start of the step; ``started`` is the step's start on the wall
clock (``time.time()``), to line ranks up in a trace.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class ActionTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._spans: list[tuple[str, object, object]] = []
        self.started = 0.0
        self._origin: object = 0.0

    def now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin_step(self) -> None:
        self._spans.clear()
        self.started = time.time()
        self._origin = self.now()

    def span(self, label: str, start, end) -> None:
        self._spans.append((label, start, end))

    @contextmanager
    def timed(self, label: str):
        """The body a span ``label`` (work inside an action: a tile group's waits, the host tier's
        copies and update, drawn over it)."""
        start = self.now()
        try:
            yield
        finally:
            self.span(label, start, self.now())

    def timeline(self) -> list[tuple[str, float, float]]:
        """[(label, start s, end s)] of the last step, from its start."""
        if self.cuda:
            torch.cuda.synchronize()
            return [(label, self._origin.elapsed_time(a) / 1e3, self._origin.elapsed_time(b) / 1e3)
                    for label, a, b in self._spans]
        return [(label, a - self._origin, b - self._origin) for label, a, b in self._spans]
