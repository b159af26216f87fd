"""What the profile measured, unit by unit, and what follows from it for any stage.

``gems.partition.profile`` fills these records once, in one fake run; everything after it
(the prices, the solver, the plan) reads them and never runs the model again. A
``UnitProfile`` holds one unit's bytes and FLOPs; a ``Storage`` one tensor storage that
some unit keeps for backward or passes on; a ``ModelProfile`` both, plus the aggregates
over segments of units that every price starts from (activations, working memory, sums).

Activation bytes of any stage
-----------------------------
A stage [lo, hi) keeps, per micro-batch in flight, every storage that is

    saved by a unit inside the stage  |  or its input boundary  |  or its output boundary

counted once, where a boundary storage counts only if the stage *touches* it: makes it, reads
it or saves it. The input boundary stays alive because the runtime keeps the received input
for the backward pass; the output boundary because backward starts from it. A storage the
stage does not touch -- a skip connection passing by -- never reaches it: it travels straight
from the stage that makes it to the stages that read it (``gems.graph.routes``), so it is
counted on those alone. A storage saved by a unit of the stage but made before the stage can
only have reached the stage through the input boundary, so these sets describe exactly what
the stage holds.
``ModelProfile.activation_matrix()`` evaluates this for all (lo, hi) at once, and
``segment_bytes`` for any list of storages (the memory policies price what they keep with it).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np


@dataclass(frozen=True)
class UnitProfile:
    """One unit at one micro-batch size. Bytes and FLOPs are per micro-batch."""

    name: str
    param_bytes: int          # all parameters
    grad_bytes: int           # parameters that require grad (their .grad)
    optimizer_bytes: int      # optimizer state for those parameters
    buffer_bytes: int         # e.g. BatchNorm running statistics
    saved_bytes: int          # storages this unit keeps for backward (parameters excluded)
    output_shapes: tuple[tuple[int, ...], ...]   # per sample: batch dim dropped
    output_dtypes: tuple[str, ...]
    output_bytes: int         # what is sent to the next stage (sum of tensor sizes)
    forward_flops: int
    backward_flops: int
    forward_working: int      # peak of new allocations during its forward (outputs and saved included)
    backward_working: int     # output gradient + peak of new allocations during its backward
    eval_working: int         # peak of new allocations of a forward-only step's forward (no_grad, eval mode)
    captured_bytes: int = 0   # gradients a split backward keeps between its halves (the outputs of
                              # the ops its trainable parameters enter: ``tracking.WeightedOutputs``)
    host_optimizer_bytes: int = 0   # optimizer state that ``ModelProfile.on_host`` moved off the device
    swapped: bool = False     # trainable parameters and their gradients in host memory too (``ModelProfile.on_host``):
                              # on the device only while its weight group is (gems.partition.swapping)
    host_update: bool = False   # its optimizer runs on the host (``ModelProfile.on_host``): on the device, its
                                # gradients exist only from the stage's first backward to their copy out

    @property
    def static_bytes(self) -> int:
        """Memory the unit holds on the device whatever the micro-batch: parameters, gradients, state,
        buffers (a swapped unit's trainable parameters and gradients are priced per weight group instead)."""
        weights = self.param_bytes - self.grad_bytes if self.swapped else self.param_bytes + self.grad_bytes
        return weights + self.buffer_bytes + self.optimizer_bytes

    @property
    def lazy_grad_bytes(self) -> int:
        """Gradients in ``static_bytes`` that exist only from the stage's first backward to their copy out
        (``host-optimizer``; a bound on a stage's peak counts them as static, ``costs.highest`` per moment)."""
        return self.grad_bytes if self.host_update and not self.swapped else 0


@dataclass(frozen=True)
class Storage:
    """A storage some unit saves for backward or passes on across a unit boundary.

    ``boundaries`` holds b for "in the output of unit b" (b = -1: the model input); ``readers``
    the units that read it as an input (None: every unit whose input it is, as for a plain
    ``nn.Sequential``, whose stages take their neighbour's whole output).
    """

    nbytes: int
    savers: tuple[int, ...]
    boundaries: tuple[int, ...]
    readers: tuple[int, ...] | None = None

    def touchers(self) -> list[int]:
        """The units that make, read or save it: a stage holds it only if it has one of them."""
        made = max(min(self.boundaries), 0) if self.boundaries else None
        readers = self.readers if self.readers is not None else [b + 1 for b in self.boundaries]
        return sorted({*self.savers, *readers, *([made] if made is not None else [])})


@dataclass
class ModelProfile:
    """Per-unit profile plus the storages needed to price any stage exactly."""

    units: list[UnitProfile]
    input_shapes: tuple[tuple[int, ...], ...]   # per sample
    input_dtypes: tuple[str, ...]
    micro_batch_size: int
    dtype: str
    optimizer: str
    storages: list[Storage] = field(repr=False)
    _matrix: np.ndarray | None = field(default=None, repr=False, compare=False)
    _working: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.units)

    def sharded(self, ranks: int | Sequence[int]) -> ModelProfile:
        """This profile as each of ``ranks`` ranks (per unit, or for all) holds it when they share the
        optimizer (``--shard-optimizer``): every unit's optimizer state divided among them, rounded
        up. The engine shares whole parameters, so a rank's run may exceed 1/ranks of a stage's
        state by part of one parameter's; its parameter exchange reuses the gradient bucket."""
        per_unit = [ranks] * len(self.units) if isinstance(ranks, int) else list(ranks)
        if max(per_unit, default=1) <= 1:
            return self
        return replace(self, units=[replace(u, optimizer_bytes=-(-u.optimizer_bytes // n))
                                    for u, n in zip(self.units, per_unit)])

    def on_host(self, weights: bool = False, where: Sequence[bool] | None = None) -> ModelProfile:
        """This profile as the device holds it with the optimizer state of every unit (or of those
        ``where`` marks) in host memory (``--state-placement host-optimizer``): ``optimizer_bytes`` moved
        to ``host_optimizer_bytes``; with ``weights`` their trainable parameters and gradients too
        (``host``: ``swapped``)."""
        where = [True] * len(self.units) if where is None else list(where)
        return replace(self, units=[replace(u, optimizer_bytes=0, swapped=weights or u.swapped, host_update=True,
                                            host_optimizer_bytes=u.host_optimizer_bytes + u.optimizer_bytes)
                                    if moved else u for u, moved in zip(self.units, where)])

    def activation_bytes(self, lo: int, hi: int) -> int:
        """Bytes stage [lo, hi) keeps per micro-batch in flight (see module docstring)."""
        return sum(s.nbytes for s in self.storages
                   if ((lo - 1) in s.boundaries or (hi - 1) in s.boundaries or any(lo <= u < hi for u in s.savers))
                   and any(lo <= u < hi for u in s.touchers()))

    def activation_matrix(self) -> np.ndarray:
        """A[lo, hi] = activation_bytes(lo, hi) for all 0 <= lo < hi <= n (float64, 0 elsewhere)."""
        if self._matrix is None:
            self._matrix = segment_bytes(len(self.units), self.storages)
        return self._matrix

    def boundary_bytes(self) -> np.ndarray:
        """B[b + 1] = bytes of the storages crossing boundary b (the output of unit b; b = -1: input)."""
        out = np.zeros(len(self.units) + 1)
        for s in self.storages:
            for b in s.boundaries:
                out[b + 1] += s.nbytes
        return out

    def working_matrix(self) -> np.ndarray:
        """W[lo, hi] = how far the memory of one micro-batch's forward or backward through stage
        [lo, hi) rises above ``activation_bytes(lo, hi)`` (its temporaries and gradients).

        While unit u runs forward, the stage holds A[lo, u] (what units lo..u-1 keep, and u's
        input) plus u's new allocations, plus the inputs of the stage that only later units read
        (I[lo, hi] - I[lo, u]: received before the stage starts). While u runs backward, what
        units after u saved is freed: the stage holds what units lo..u saved, its input and its
        output, plus u's gradients and temporaries. The peak is the max over u of both.
        """
        if self._working is None:
            n = len(self.units)
            A = self.activation_matrix()
            S, I, O = segment_matrices(n, self.storages, ("saved", "input"), ("input",), ("output",))  # noqa: E741
            fwd = np.array([u.forward_working for u in self.units], dtype=np.float64)
            bwd = np.array([u.backward_working for u in self.units], dtype=np.float64)
            below = np.arange(n)[None, :] < np.arange(n + 1)[:, None]     # [lo, u]: u < lo, outside every stage
            # forward: the max over u in [lo, hi) of A[lo, u] - I[lo, u] + fwd[u], plus I[lo, hi]
            forward = np.maximum.accumulate(np.where(below, -np.inf, (A - I)[:, :n] + fwd), axis=1)
            # backward of u = hi - 1: A[lo, hi] + bwd[hi - 1]; of u < hi - 1: what lo..u saved (S[lo, u + 1]
            # less the input I, counted apart), bwd[u], plus the stage's input and output
            inner = np.maximum.accumulate(np.where(below, -np.inf, (S - I)[:, 1:] + bwd), axis=1)
            W = np.full((n + 1, n + 1), -np.inf)
            W[:, 1:] = np.maximum(forward + I[:, 1:], A[:, 1:] + bwd)
            W[:, 2:] = np.maximum(W[:, 2:], inner[:, :-1] + I[:, 2:] + O[:, 2:])
            W = np.maximum(W - A, 0.0)
            W[np.arange(n + 1)[:, None] >= np.arange(n + 1)[None, :]] = 0.0
            self._working = W
        return self._working

    def unit_sums(self, attribute: str) -> np.ndarray:
        """Prefix sums of a per-unit quantity: S[hi] - S[lo] is its total over [lo, hi)."""
        values = [getattr(u, attribute) for u in self.units]
        return np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])


def _first_at_or_after(units: Sequence[Sequence[int]], n: int) -> np.ndarray:
    """F[i, lo] = the first of ``units[i]`` >= lo, n + 1 where there is none (lo = 0..n)."""
    first = np.full((len(units), n + 2), n + 1)
    rows = [i for i, us in enumerate(units) for _ in us]
    cols = [u for us in units for u in us]
    first[rows, cols] = cols
    return np.minimum.accumulate(first[:, ::-1], axis=1)[:, ::-1][:, :n + 1]


def segment_bytes(n: int, storages: Sequence[Storage],
                  terms: Sequence[str] = ("saved", "input", "output")) -> np.ndarray:
    """Vectorised ``ModelProfile.activation_bytes`` of these storages for every segment of n
    units, counting only some of its terms: storages saved inside, the input boundary, the
    output boundary (each counted once, boundaries only where the segment touches them)."""
    return segment_matrices(n, storages, terms)[0]


def segment_matrices(n: int, storages: Sequence[Storage], *term_sets: Sequence[str]) -> list[np.ndarray]:
    """``segment_bytes`` for each of ``term_sets``, the storages read once.

    A storage that never crosses a boundary is saved only by the unit that made it, so it
    adds to every segment containing that unit (prefix sums). One that crosses boundaries counts
    in [lo, hi) when the segment touches it (hi > T[lo], the first unit >= lo that touches it) and
    it is the segment's input (B[lo]: boundary lo - 1), saved inside (hi > N[lo], the first saver
    >= lo) or its output (B[hi]). Per row lo that is every hi past a threshold -- T[lo] where it is
    the input, max(T[lo], N[lo]) where saved counts, none otherwise -- plus, for the output, the few
    hi = b + 1 below it: steps summed by a running sum along each row, and single cells, for all
    storages at once (the same work per storage as a row, not as a matrix, and no Python loop per
    storage: those were most of a sweep's time).
    """
    internal = np.zeros(n)
    crossing = [s for s in storages if s.boundaries]
    for s in storages:
        if not s.boundaries:
            for u in s.savers:
                internal[u] += s.nbytes
    prefix = np.concatenate([[0.0], np.cumsum(internal)])
    saved_inside = prefix[None, :] - prefix[:, None]
    outside = np.arange(n + 1)[:, None] >= np.arange(n + 1)[None, :]
    nbytes = np.array([s.nbytes for s in crossing], dtype=np.float64)
    touched = _first_at_or_after([s.touchers() for s in crossing], n)              # T[i, lo]
    saved_from = np.maximum(touched, _first_at_or_after([s.savers for s in crossing], n))   # max(T, N)[i, lo]
    # (storage, b + 1) per boundary b crossed: the input of segments from lo = b + 1, the output of those to hi = b + 1
    pairs = np.array([i for i, s in enumerate(crossing) for _ in s.boundaries], dtype=np.int64)
    ends = np.array([b + 1 for s in crossing for b in s.boundaries], dtype=np.int64)
    bounds = np.zeros((len(crossing), n + 1), dtype=bool)
    bounds[pairs, ends] = True
    out = []
    for terms in term_sets:
        matrix = saved_inside.copy() if "saved" in terms else np.zeros((n + 1, n + 1))
        # the threshold per storage and row (n + 1: none)
        threshold = np.where(bounds, touched, n + 1) if "input" in terms else np.full_like(touched, n + 1)
        if "saved" in terms:
            threshold = np.minimum(threshold, saved_from)
        steps = np.zeros((n + 1, n + 2))
        i, lo = np.nonzero(threshold <= n)
        np.add.at(steps, (lo, threshold[i, lo] + 1), nbytes[i])
        matrix += np.cumsum(steps, axis=1)[:, :n + 1]
        if "output" in terms:      # hi = b + 1 touched but not yet past the threshold
            below = (touched[pairs] < ends[:, None]) & (ends[:, None] <= threshold[pairs])
            k, lo = np.nonzero(below)
            np.add.at(matrix, (lo, ends[k]), nbytes[pairs[k]])
        matrix[outside] = 0.0
        out.append(matrix)
    return out
