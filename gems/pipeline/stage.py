"""Per-stage memory policies: recompute and offload a stage's activations, model untouched.

A stage's ``StagePolicy`` (``gems.partition.plan``) names recompute segments (model unit
ranges ``[first, end)``) and whether what backward needs goes to host memory. The engine
runs every stage forward through a ``StageRunner`` and calls ``prefetch`` one compute action
ahead of that micro-batch's backward (``gems.pipeline.executor``), so the copy back runs
beside that action. The math does not change: same gradients, and BatchNorm's running
statistics are updated once per forward, never by a recomputation.

Which forwards a policy applies to
----------------------------------
Take one position's compute actions in order (forward and backward; messages, sync and
step do not count). A forward is *immediate* when the next one is its own backward (same
replica, micro-batch and stage), and *waiting* otherwise (``gems.schedule.generators.waiting_forwards``).
``mast`` K=2 m=1, position 0: ``F d0.s0  F u0.s1  B u0.s1  B d0.s0`` -- d0.s0 waits, u0.s1
is immediate. ``1f1b`` K=2 m=2: position 0 ``F d0.s0  F d1.s0  B d0.s0  B d1.s0`` -- both
wait (as every forward does under ``gpipe``, whose backwards run first in, first out);
position 1 ``F d0.s1  B d0.s1  F d1.s1  B d1.s1`` -- both immediate, as every forward is
under ``mp``.

- waiting forward: every recompute segment runs under checkpoint; offload is on.
- immediate forward: nothing is offloaded, and the stage's last segment runs without
  checkpoint when it ends at the stage's last unit; every other segment runs under
  checkpoint. Its backward starts at once, with that last segment: what offloading moves
  would come straight back and the last segment would be rematerialized straight away, so
  both would cost time and lower no peak. The earlier segments are still recomputed, one
  at a time, which is what lowers the peak. (A stage that is one segment therefore
  recomputes nothing in an immediate forward; under ``mp`` only multi-segment recompute helps.)

Memory per micro-batch, for the planner
---------------------------------------
Write X, Y for the stage's input and output (the engine keeps both until the backward,
under every policy), A_U for what units outside segments save, and I_i, A_i for segment
i's input and everything its units save (input included). From a waiting forward until
its backward, the device keeps:

- none:               A_U + sum A_i.
- recompute:          A_U + sum I_i; during its backward, + max A_i (one segment
                      rematerialized at a time, freed as its backward ends).
- offload:            X, Y, parameters, and saved tensors under ``MIN_OFFLOAD_BYTES``; the rest
                      waits in host memory (``HostPool``) and all of it comes back as the
                      compute action before that micro-batch's backward starts (so + A_U +
                      sum A_i from then on).
- recompute+offload:  as offload, where what is saved is A_U + sum I_i (the checkpoint
                      inputs); during its backward, those back, + max A_i.

An immediate forward holds, from its forward until its backward, what a waiting one holds
while the backward of its last segment runs (everything back from the host, that segment
rematerialized), so both reach the same peak. Time: a checkpointed segment runs its
forward twice (``checkpointed_segments`` says which, per forward); offloading copies what it
moves out during the forward and back during the compute action before the backward, on a
side stream beside the compute.

Host memory and in-place writes
-------------------------------
Offloaded tensors live in buffers of a bounded ``HostPool`` (pinned on CUDA; one can serve
all of a rank's stages): a micro-batch's buffers go back to the pool as its prefetch is
queued (CUDA: reusable once that copy is done) and later forwards reuse them, so the
steady state pins nothing new. The planner prices what the pool holds at a position's
peak (``gems.partition.costs.host_moments``). ``saved_tensors_hooks`` bypass autograd's
version check, so each saved tensor's version is recorded at pack and compared when the
same tensor is saved again and at unpack: an in-place write after the pack (which would
race the copy on CUDA) raises instead of training on stale values.

On a CPU device the host *is* the device: offloading still copies every saved tensor
into a separate CPU tensor and back (so the tests exercise the math), but saves nothing.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gems.errors import GemsError
from gems.graph import INPLACE_INPUTS, writes_inputs
from gems.pipeline.hostweights import HostWeights
from gems.pipeline.offload import HostPool, _Offload
from gems.plan import StagePolicy

Key = tuple[int, int, int]   # (replica, micro-batch, stage)

# A module with a bool attribute of this name (a deferred BatchNorm layer, ``gems.pipeline.batchnorm``)
# finds it True while a segment holding it is recomputed. A flag rather than the buffers' identity:
# torch.compile guards on the flag's value, not on which tensor object a buffer is (gems.pipeline.compiled).
RECOMPUTING = "recomputing"


def as_tuple(x: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A unit's output as a tuple of tensors (a tensor becomes a 1-tuple): the runtime's view
    of every stage boundary."""
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    raise GemsError(f"a unit must return a tensor or a tuple of tensors; got {_describe(x)}: change the "
                    "unit's forward to return tensors only.")


def _describe(x: object) -> str:
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} of ({', '.join(type(t).__name__ for t in x)})"
    return type(x).__name__


def unpack(xs: tuple[torch.Tensor, ...]):
    """The value a unit takes: a tensor, or a tuple when the boundary carries several."""
    return xs[0] if len(xs) == 1 else xs


def checkpointed_segments(policy: StagePolicy, waiting: bool, end_unit: int) -> list[list[int]]:
    """The recompute segments one forward of a stage ending before unit ``end_unit`` runs
    under checkpoint (``StagePolicy.checkpointed``, which the planner reads too)."""
    return policy.checkpointed(waiting, end_unit)


class StageRunner:
    """Runs one stage's forward under its ``StagePolicy``.

    Args:
        module: the stage (``model[lo:hi]``, on ``device``).
        first_unit: ``lo``, the model index of its first unit (policies name model units).
        policy: what to recompute and whether to offload.
        device: where the stage runs.
        pool: host buffers for what it offloads, shared by the rank's stages (default: a
            pool of its own, bounded by ``DEFAULT_HOST_POOL_BYTES``, pinned on CUDA).
    """

    def __init__(self, module: nn.Sequential, first_unit: int, policy: StagePolicy,
                 device: torch.device, pool: HostPool | None = None) -> None:
        self.module, self.policy, self.first_unit = module, policy, first_unit
        self.params = [p for p in module.parameters() if p.requires_grad]   # the split backward's weights
        # positions of the stage's inputs some unit writes in place (gems.graph marks a traced
        # model's units; a plain nn.Sequential's units declare none)
        meta = getattr(module[0], "meta", {}) if len(module) else {}
        self.inplace_inputs = frozenset(meta.get(INPLACE_INPUTS, ()))
        made: dict[tuple[int, int, bool], Piece] = {}   # both kinds of forward share their common pieces
        self._pieces = {waiting: _pieces(module, first_unit,
                                         checkpointed_segments(policy, waiting, first_unit + len(module)), made)
                        for waiting in (True, False)}
        if pool is None and policy.offload:
            pool = HostPool(pin=device.type == "cuda")
        self.offload = _Offload(module, device, pool) if policy.offload else None
        # the stage's parameters in host memory, on the device per unit group (policy.state_placement
        # "host"): set by the engine once the host tier holds them (gems.pipeline.hostweights)
        self.weights: HostWeights | None = None

    def forward(self, inputs: tuple[torch.Tensor, ...], key: Key, waiting: bool) -> tuple[torch.Tensor, ...]:
        """The stage's output for one micro-batch; ``waiting``: whether its backward is not
        the next compute action (``gems.schedule.generators.waiting_forwards``)."""
        offload = self.offload is not None and waiting
        with self._saving(key, inputs, offload):
            xs = _run_pieces(inputs, self._pieces[waiting])
        if offload:
            self.offload.keep_on_device(key, xs)
        return xs

    def _saving(self, key: Key, inputs: tuple[torch.Tensor, ...], offload: bool) -> contextlib.AbstractContextManager:
        """What the forward's saved tensors go through: the host weights' hooks (composed with offload's),
        offload's alone, or nothing."""
        if self.weights is not None:
            return self.weights.saving(self.offload.hooks(key, inputs) if offload else None)
        return self.offload.saving(key, inputs) if offload else contextlib.nullcontext()

    def group_pieces(self, waiting: bool) -> list[list[Piece]] | None:
        """A forward's pieces cut at the bounds of the host weights' unit groups, per group (a
        group-major run, ``gems.pipeline.grouping``, runs them group by group); None when a checkpointed
        piece spans two groups (its recomputation cannot be cut)."""
        per_group: list[list[Piece]] = []
        for lo, hi in self.weights.bounds:
            cut = []
            for piece in self._pieces[waiting]:
                start = piece.first - self.first_unit
                a, b = max(lo, start), min(hi, start + len(piece.module))
                if a >= b:
                    continue
                if (a, b) == (start, start + len(piece.module)):
                    cut.append(piece)
                elif piece.recompute:
                    return None
                else:
                    cut.append(Piece(self.module[a:b], self.first_unit + a, False))
            per_group.append(cut)
        return per_group

    def forward_group(self, xs: tuple[torch.Tensor, ...], pieces: list[Piece]) -> tuple[torch.Tensor, ...]:
        """One group's share of a forward (``group_pieces``): its pieces on ``xs``, saved parameters
        through the host weights' hooks."""
        with self.weights.saving():
            return _run_pieces(xs, pieces)

    def finish_backward(self) -> None:
        """After a backward action (or half) of this stage: its parameters on the host leave the device."""
        if self.weights is not None:
            self.weights.finish()

    def recomputes(self, waiting: bool) -> bool:
        """Whether a forward (waiting or not) checkpoints any segment of this stage."""
        return any(piece.recompute for piece in self._pieces[waiting])

    def pieces(self, waiting: bool) -> list[Piece]:
        """The runs of units a forward (waiting or not) runs one after another; a piece both kinds
        of forward run is one object (``gems.pipeline.compiled`` compiles each once)."""
        return self._pieces[waiting]

    def prefetch(self, key: Key) -> None:
        """Start bringing back what the forward of ``key`` offloaded (the executor calls it as
        the compute action before that backward begins); a second call for ``key`` does nothing."""
        if self.offload is not None:
            self.offload.prefetch(key)


class Piece:
    """A run of a stage's units that a forward runs as one: under checkpoint or not (``recompute``),
    on copies of its inputs or not (``copies``: a checkpointed run whose first unit writes its input
    in place -- checkpoint keeps the input itself to recompute from, and refuses one written after it
    kept it). ``call`` runs the units: ``module`` itself (its own hooks included), or the units compiled
    (``gems.pipeline.compiled``)."""

    def __init__(self, module: nn.Sequential, first: int, recompute: bool) -> None:
        self.module, self.first, self.recompute = module, first, recompute
        self.copies = recompute and writes_inputs(_first_unit(module))
        self.call: Callable = module

    def __call__(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.copies:
            xs = tuple(x.clone() for x in xs)
        return as_tuple(self.call(unpack(xs)))


def _pieces(module: nn.Sequential, first_unit: int, segments: list[list[int]],
            made: dict[tuple[int, int, bool], Piece]) -> list[Piece]:
    """The stage as consecutive pieces, checkpointed segments and the runs between them; ``made``:
    the pieces made so far, by (first, end, recompute) in the stage, reused."""
    def piece(lo: int, hi: int, recompute: bool) -> Piece:
        if (lo, hi, recompute) not in made:
            made[lo, hi, recompute] = Piece(module if (lo, hi) == (0, len(module)) else module[lo:hi],
                                            first_unit + lo, recompute)
        return made[lo, hi, recompute]

    pieces, at = [], 0
    for first, end in segments:
        lo, hi = first - first_unit, end - first_unit
        if at < lo:
            pieces.append(piece(at, lo, False))
        pieces.append(piece(lo, hi, True))
        at = hi
    if at < len(module):
        pieces.append(piece(at, len(module), False))
    return pieces


def _run_pieces(xs: tuple[torch.Tensor, ...], pieces: list[Piece]) -> tuple[torch.Tensor, ...]:
    """``pieces`` in turn on ``xs``, a recomputed one under checkpoint (non-reentrant)."""
    for piece in pieces:
        if piece.recompute:
            xs = checkpoint(piece, *xs, use_reentrant=False, preserve_rng_state=True,
                            context_fn=functools.partial(_contexts, piece.module))
        else:
            xs = piece(*xs)
    return xs

def _first_unit(piece: nn.Sequential) -> nn.Module:
    """The unit a piece starts with (a tiled unit's graph: ``gems.spatial``'s TiledUnit runs ``flat``)."""
    unit = piece[0] if len(piece) else piece
    return getattr(unit, "flat", unit)


def _contexts(piece: nn.Module) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """checkpoint's (forward, recomputation) contexts: the recomputation works on copies of
    the buffers, so running statistics (and ``num_batches_tracked``) are updated once."""
    return contextlib.nullcontext(), recomputation(piece)


def recomputation(piece: nn.Module) -> contextlib.AbstractContextManager:
    """The context a checkpointed ``piece`` is recomputed in: scratch copies of its buffers, its
    modules' ``RECOMPUTING`` flags raised (``gems.pipeline.compiled`` warms a unit up in it too)."""
    return _ScratchBuffers(piece)


class _ScratchBuffers:
    """Buffers swapped for copies while a segment is recomputed, and ``RECOMPUTING`` flags raised.
    Re-entrant: a split backward (``gems.pipeline.splitgrad``) may recompute a segment in each of
    its halves."""

    # Copies rather than momentum tricks: exact for momentum=None (cumulative averages) and
    # for counters, and the real buffers see no write (so no version bump) at all.
    def __init__(self, piece: nn.Module) -> None:
        self.piece = piece
        self.real: list[tuple[nn.Module, str, torch.Tensor]] = []
        self.flags: list[tuple[nn.Module, bool]] = []

    def __enter__(self) -> None:
        self.real = [(m, name, b) for m in self.piece.modules() for name, b in m.named_buffers(recurse=False)]
        for m, name, b in self.real:
            setattr(m, name, b.clone())
        self.flags = [(m, getattr(m, RECOMPUTING)) for m in self.piece.modules() if hasattr(m, RECOMPUTING)]
        for m, _ in self.flags:
            setattr(m, RECOMPUTING, True)

    def __exit__(self, *exc) -> None:
        for m, name, b in self.real:
            setattr(m, name, b)
        for m, flag in self.flags:
            setattr(m, RECOMPUTING, flag)
        self.real, self.flags = [], []
