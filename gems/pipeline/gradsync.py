"""Gradient sync of one rank: the flat bucket, BatchNorm statistics, clipping, non-finite skip.

One flat bucket per rank, one segment per stage it holds, each summed over the stage's sync group
(the mirror group under ``mast``, the same position across groups otherwise, with every tile of
a tiled stage 0; ``Topology.holders``) by a non-blocking allreduce that the schedule's ``reduce``
action starts as soon as the stage's last backward on this rank is done (``start``; a stage summed
on its host copy, once that copy is done: ``progress``), so it overlaps the backward of the rank's
other stage; ``sync`` waits for them. A segment (``gems.pipeline.gradbucket``) holds the stage's
gradients -- ``param.grad`` are views of it (``gems.pipeline.gradplaces``: a step's first gradient
copied in, the later ones added in place) -- then a copy of its floating buffers (BatchNorm
running statistics), which the same call averages, so all copies of a stage stay identical.
Every member starts its reduces in the schedule's one
order (``gems.schedule.lowering.place_reduces``). Over NCCL the reduces start at the sync instead,
in the same order: NCCL kernels of two communicators (a sync group's and the point-to-point one)
may wait on each other if started in different orders, so they do not overlap there. BatchNorm
statistics that the mode keeps identical itself stay out of it: under ``batch_norm="deferred"``
a second, float64 allreduce over the same group adds the step's Σx, Σx² and counts, from which
every copy then writes the same running statistics (``gems.pipeline.batchnorm``).

With a sharded optimizer (``optimized(shard=True)``) each member of a sync group owns a run of
every stage's parameters: a stage's gradients are reduce-scattered instead (each member gets
the sums of its own run; the other gradients it holds are partial sums until the bucket is
zeroed after the step), the owner updates its run, and one allgather per stage hands the new
parameters to all -- together one allreduce's traffic.

A stage placed on the host (``StagePolicy.state_placement == "host-optimizer"``, ``placements``)
keeps its parameters on the device, and its gradients in a segment outside the bucket that exists only
from the stage's first backward of the step (``gradients``, which the executor calls before each) until
it is copied out to the host after the stage's last backward and summed there; the optimizer updates
host copies of the parameters, which go back to the device after the step (``gems.pipeline.hostopt``). A stage placed
``"host"`` is held so too, but its parameters leave the device (``gems.pipeline.hostweights`` brings
them back per unit group) and its gradients are added into the host copy as backward makes them: its
device parameters have no ``.grad`` and its bucket segment holds only the BatchNorm statistics' copy (the
gradients' offsets lay out the host copy alone).

A second, world-wide allreduce carries the step's loss and, for clipping, the squared global
gradient norm (each stage counted once, by its copy on group 0 at the position equal to the
stage; sharded, each parameter by its owner). A step whose loss is not finite is not applied and
leaves no trace: the optimizer is skipped and every buffer goes back to its value before the step
(``gems.pipeline.rollback``).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from gems.comm import all_of
from gems.errors import GemsError
from gems.pipeline.batchnorm import BatchNorms
from gems.pipeline.gradbucket import GradBucket
from gems.pipeline.hostopt import PLACEMENT, HostTier
from gems.pipeline.hostupdate import HostUpdate
from gems.pipeline.hostweights import PLACEMENT as WEIGHTS
from gems.pipeline.rollback import Rollback
from gems.pipeline.shares import split_among
from gems.schedule.topology import Topology
from gems.spatial.tiles import tile_backoff


class GradSync:
    """Creates the sync groups (COLLECTIVE), makes every copy of a stage start equal, and owns
    the gradient bucket of the stages in ``stages`` ({stage: module} this rank holds) and their
    BatchNorm layers under ``batch_norm`` (a ``gems.pipeline.batchnorm.MODES`` name); ``placements``:
    {stage: where its model state lives} (default: all on the device)."""

    def __init__(self, comm, topology: Topology, stages: dict[int, nn.Module], device: torch.device,
                 clip_grad_norm: float | None, batch_norm: str = "micro-batch",
                 parts: dict[int, list[tuple[nn.Module, list[int]]]] | None = None,
                 placements: dict[int, str] | None = None) -> None:
        self.comm, self.topology, self.stages = comm, topology, stages
        self._on_host = {s for s, where in (placements or {}).items() if where in (PLACEMENT, WEIGHTS)}
        self._weights_on_host = {s for s, where in (placements or {}).items() if where == WEIGHTS}
        self.host = HostTier(device)   # filled by ``optimized`` with the parts of the stages placed on the host
        self.update = HostUpdate(self.host)   # its update, on a worker where the host holds all the rank's state
        self.group, self.position, tile = topology.place(comm.rank)
        self.counts_norm = self.group == 0 and tile == 0   # counts its position's stage in the global norm
        self.clip_grad_norm = clip_grad_norm
        # per stage, each part synced on its own: (module, ranks of its sync group); by default the whole
        # stage over its holders. A tiled stage 0's leader syncs its untiled rest over the leaders alone.
        parts = parts or {s: [(m, topology.holders(s))] for s, m in stages.items()}
        made = {tuple(ranks): self.comm.group(ranks) for ranks in topology.sync_groups()}   # collective, one order
        self._parts = {(s, i): (module, made[tuple(ranks)] if len(ranks) > 1 else None, ranks[0])
                       for s in sorted(parts) for i, (module, ranks) in enumerate(parts[s])}
        # the sync groups of this rank's parts, first seen first (a sharded optimizer's state is gathered
        # over each in this order, the same on every rank): one without tiles, none for a lone copy
        self.shard_groups = list({id(g): g for _, g, _ in self._parts.values() if g is not None}.values())
        # the parts summed over a tile group (a tiled stage's first part): tiles keep pace with each other, so
        # their sum's waits are short and poll first, as the tile group's own waits do (``tile_backoff``)
        self._over_tiles = {(s, 0) for s in topology.tiled_stages if (s, 0) in self._parts}
        self._make_identical()
        # BatchNorm layers by the group their part syncs over (first seen first: the same order on every
        # rank); a tiled part's deferred sums are added over every tile, the rest over the leaders
        by_group: dict[int, tuple[object, list[nn.Module]]] = {}
        for module, group, _ in self._parts.values():
            by_group.setdefault(id(group), (group, []))[1].append(module)
        self.batch_norms = [(group, BatchNorms(modules, batch_norm, device))   # (sync group, its layers' mode)
                            for group, modules in by_group.values()]
        kept = {id(b) for _, norms in self.batch_norms for b in norms.kept_buffers}
        params = {k: [p for p in m.parameters() if p.requires_grad] for k, (m, _, _) in self._parts.items()}
        stats = {k: [b for b in m.buffers() if b.is_floating_point() and id(b) not in kept]
                 for k, (m, _, _) in self._parts.items()}
        statistics = [b for bs in stats.values() for b in bs]
        counters = [b for s in stages.values() for b in s.buffers() if not b.is_floating_point()]
        self._rollback = Rollback(statistics + counters)   # what a step that is not applied puts back
        dtypes = {t.dtype for ps in params.values() for t in ps} | {b.dtype for b in statistics}
        if len(dtypes) > 1:
            raise GemsError(f"stage parameters mix dtypes {sorted(map(str, dtypes))}: "
                            "convert the model to one dtype before training")
        dtype = dtypes.pop() if dtypes else torch.float32
        # a part whose model state lives on the host keeps only its statistics' copy in the bucket
        # (``gems.pipeline.gradbucket``): its parameters on the host too (placed), or only its optimizer (lazy)
        placed = {k for k in params if k[0] in self._weights_on_host}
        lazy = {k for k in params if k[0] in self._on_host and k not in placed}
        self.layout = GradBucket(params, stats, placed, lazy, dtype, device, lambda: self.host.views, comm.bucket)
        self._zeros = comm.bucket
        self.bucket = self.layout.flat
        self._overlap = comm.overlaps_collectives
        self._owned: set[int] | None = None   # ids of the parameters this rank updates (sharded optimizer)
        # sharded: per (stage, part), its flat parameter buffer and where each member's run starts in it (and
        # in the part's gradients, laid out alike)
        self._runs: dict[tuple[int, int], tuple[torch.Tensor, list[int]]] = {}
        self._reduces: list[tuple[int, object]] = []   # (stage, request) started this step
        self._scalars = torch.zeros(2, dtype=torch.float64, device=device)  # loss, grad norm^2
        self.last_grad_norm: float | None = None

    def _make_identical(self) -> None:
        """Start every copy of a stage from its sync group's first rank's values."""
        with torch.no_grad():
            for module, group, root in self._parts.values():   # blocking, over several groups: one order
                if group is not None:
                    for t in list(module.parameters()) + list(module.buffers()):
                        self.comm.broadcast(t.data, root, group)

    def optimized(self, shard: bool) -> list[nn.Parameter]:
        """The parameters this rank's optimizer updates: all it holds, or with ``shard`` its share of
        each part's (a stage, or a tiled stage's tiled units and untiled rest) -- whole parameters,
        about 1/n of the elements for each of the n members of the part's sync group (``split_among``: the
        same split on every member), the part's gradients laid out again in the bucket by owner so
        that each member's are contiguous; the others' new values arrive after each step
        (``share``). Sharded, a part's parameters become views of one flat buffer laid out as their
        gradients are in the bucket (the Parameter objects stay), so that exchange is one allgather
        per part, with no copies. A part of a stage placed on the host is flattened so too, and the
        optimizer gets the host copies of its parameters instead (``gems.pipeline.hostopt``)."""
        sharded = shard and bool(self.shard_groups)
        owned: list[nn.Parameter] = []
        # the sharded parts' parameters held where the communicator gathers them fastest (``Comm.bucket``:
        # node memory under MPI), one buffer for all; asked for by every rank when sharding (collective)
        pool = None
        if shard:
            pool = self._zeros(sum(sum(p.numel() for p in params) for key, params in self.layout.params.items()
                                   if sharded and self._parts[key][1] is not None and key[0] not in self._on_host),
                               self.bucket.dtype, self.bucket.device)
        taken = 0
        for key, mine in self.layout.params.items():   # each part over its own sync group (a tiled one: every tile)
            group = self._parts[key][1]
            bounds = None
            if sharded and group is not None:
                mine, bounds = split_among(mine, group.size)
                self.layout.lay_out(key, mine)
            flat = self._hold_on_host(key, mine) if key[0] in self._on_host and mine else None
            if bounds is None:   # no other copy, or not sharded
                owned += mine
                continue
            owned += mine[bounds[group.rank]:bounds[group.rank + 1]]
            if mine:   # the part's gradients are contiguous; member k's run of whole parameters a piece of them
                lo, hi = self.layout.span(mine)
                if flat is None:
                    flat = self.layout.flatten(mine, lo, hi, pool[taken:taken + hi - lo])
                    taken += hi - lo
                self._runs[key] = (flat, [self.layout.offsets[id(mine[b])] - lo if b < len(mine) else hi - lo
                                          for b in bounds])
        if not sharded:
            return [self.host.parameter(p) for s in self.stages.values() for p in s.parameters()]
        if not owned:
            raise GemsError(f"the stages of rank {self.comm.rank} have too few parameters to share their optimizer "
                            f"among {max(g.size for g in self.shard_groups)} ranks: train without --shard-optimizer")
        self._owned = {id(p) for p in owned}
        return [self.host.parameter(p) for p in owned]

    def _hold_on_host(self, key: tuple[int, int], params: list[nn.Parameter]) -> torch.Tensor:
        """Part ``key`` in the host tier: its parameters become views of one device buffer laid out as
        their gradients (one copy back per part), copied to the host. Returns the host copy."""
        lo, hi = self.layout.span(params)
        flat = self.layout.flatten(params, lo, hi)
        return self.host.add(key, self.layout.segments[key][2], flat, params,
                             [self.layout.offsets[id(p)] - lo for p in params],
                             key in self.layout.placed)   # positional: tests count the parts by wrapping add

    @property
    def sharded(self) -> bool:
        """Whether each member updates only its share of the parameters (``optimized(shard=True)``)."""
        return self._owned is not None

    def share(self) -> None:
        """After an applied sharded step: every member's updated parameters to every member: one
        allgather per part of its flat parameter buffer over the part's sync group, each member's
        run from its owner (half an allreduce's traffic). COLLECTIVE over each part's sync group."""
        requests = [self.comm.iallgather_runs(flat, bounds, self._parts[key][1])
                    for key, (flat, bounds) in self._runs.items()]
        for req in requests:
            self.comm.wait(req, "the parameter exchange")
        self.host.copy_back()

    def keep_grads_in_bucket(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.zero_grad()`` zero the bucket and the host gradients in place, ``.grad``
        kept their places (``GradPlaces.keep``)."""
        def zero() -> None:
            self.update.settle()
            for _, grads, _, _ in self.layout.segments.values():
                grads.zero_()
            self.host.zero_grads()
        self.layout.places.keep(optimizer, zero)

    def begin_step(self) -> None:
        """Check that the gradients live in their places (``GradPlaces.begin_step``: the bucket's
        parameters then take the step's first gradients by copy) and remember the buffers (restored
        if the step turns out not finite). Communicates nothing."""
        self.layout.places.begin_step()
        for _, norms in self.batch_norms:
            norms.begin_step()
        self._rollback.remember()

    def zero_grads(self) -> None:
        """After every step, applied or not: the host's gradients zeroed for the next step's backward
        (``HostUpdate.zero_grads``: once the update in flight, which reads them, is settled). The bucket's
        are not: the next step's first gradients are copied over them (``gems.pipeline.gradplaces``)."""
        self.update.zero_grads()

    @property
    def _updates_on_worker(self) -> bool:
        """Whether the update runs on the host's worker: where the host holds every part of the rank (a
        part in the bucket has its gradients' places reset when the next step begins) and the optimizer is
        not sharded (the new parameters go to the other members at once, ``share``)."""
        return self.host.held and not self.sharded and all(key in self.host for key in self._parts)

    def taken(self, stage: int) -> None:
        """After gradients of ``stage`` were accumulated outside autograd's engine (a split backward's
        weight half, ``gems.pipeline.splitgrad``): each in its place."""
        for key, params in self.layout.params.items():
            if key[0] == stage and self.layout.holds(key):
                self.layout.places.take(params)

    def gradients(self, stage: int) -> None:
        """Before each backward of ``stage`` (or half of one): the device gradients of its parts on the
        host, made at the step's first (``HostTier.gradients``; ``_copy_out`` drops them after the last)."""
        for key in self.layout.lazy:
            if key[0] == stage:
                self.host.gradients(key)

    def start(self, stage: int) -> None:
        """Start summing ``stage``'s segment over the sync group (its backward is complete here); a
        part on the host is copied out first (CUDA: its sum is posted once the copy is done, by
        ``progress`` or at the sync). COLLECTIVE over the sync group, in the schedule's order of reduces."""
        for key, (_, group, _) in self._parts.items():
            if key[0] != stage:
                continue
            if self.layout.holds(key):
                self.layout.places.settle(self.layout.params[key])
            if key in self.host:
                self._copy_out(key)
            if group is not None:
                later = not self._overlap or (key in self.host and self.host.asynchronous)
                self._reduces.append((key, None if later else self._issue(key)))

    def progress(self) -> None:
        """Post the reduces that ``start`` left for later because their copy out to the host was still
        running (CUDA), those whose copy has completed since, in the schedule's order -- each waits for
        those before it, so every member starts them in one order -- and the rest at the sync. Called
        between the step's compute actions: the host sums then overlap the rest of the backward."""
        for k, (key, req) in enumerate(self._reduces):
            if req is not None:
                continue
            if not (self._overlap and key in self.host and self.host.arrived(key)):
                return
            self._reduces[k] = (key, self._issue(key))

    def _gather_statistics(self, key: tuple[int, int]) -> None:
        """Part ``key``'s BatchNorm statistics into its segment's copy of them, to be summed with it."""
        _, _, copy, buffers = self.layout.segments[key]
        if buffers:
            torch.cat([b.reshape(-1) for b in buffers], out=copy)

    def _copy_out(self, key: tuple[int, int]) -> None:
        """Part ``key``'s gradients and statistics (gathered into their copy) on their way to the host."""
        self._gather_statistics(key)
        self.host.copy_out(key, self.layout.segments[key][2])

    def _summed(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
        """Part ``key``'s (segment, gradients, statistics' copy, statistics buffers) where it is summed:
        on the device, or its host copy."""
        if key in self.host:
            return (*self.host.ready(key), self.layout.segments[key][3])
        return self.layout.segments[key]

    def _issue(self, key: tuple[int, int]):
        if key not in self.host:   # a part on the host gathered its statistics as it was copied out
            self._gather_statistics(key)
        segment, grads, copy, buffers = self._summed(key)
        group = self._parts[key][1]
        if key not in self._runs:
            return self.comm.iallreduce(segment, group)
        # sharded: each member needs the sums of its own run of gradients only
        requests = [self.comm.ireduce_scatter_runs(grads, self._runs[key][1], group)]
        requests += [self.comm.iallreduce(copy, group)] if buffers else []
        return all_of(requests, requests[0].describe)

    def sync(self, loss: torch.Tensor) -> float:
        """Wait for the stages' reduces (started by ``start``; NCCL: started now, in the same
        order) and average the statistics; sum deferred BatchNorm sums over the sync group and
        ``loss`` (this rank's share of the global mean) over the world. Returns the global loss."""
        for key, (_, group, _) in self._parts.items():   # a part no reduce action starts: its gradients in place
            if group is None and self.layout.holds(key):
                self.layout.places.settle(self.layout.params[key])
        for key in self._parts:   # a lone copy on the host: its copy out (if no reduce action started it), done
            if key in self.host and self._parts[key][1] is None:
                if not self.host.copied(key):
                    self._copy_out(key)
                self.host.ready(key)
        synced = sorted(k for k, (_, g, _) in self._parts.items() if g is not None)
        if synced:
            reduces, self._reduces = self._reduces, []
            if sorted(k for k, _ in reduces) != synced:   # the schedule's contract
                raise RuntimeError(f"reduces of {[k for k, _ in reduces]} for {synced}")
            reduces = [(k, self._issue(k) if req is None else req) for k, req in reduces]
            for key, req in reduces:
                self.comm.wait(req, f"the gradient allreduce of stage {key[0]}",
                               tile_backoff(self.comm) if key in self._over_tiles else None)
                _, _, copy, buffers = self._summed(key)
                if buffers:
                    copy /= self._parts[key][1].size
                    self._scatter(copy, buffers)
        for group, norms in self.batch_norms:
            norms.sync(self.comm, group)
        self._scalars[0] = loss.reshape(())
        self._scalars[1] = 0.0
        if self.clip_grad_norm is not None and (self.counts_norm or self._owned is not None):
            # each parameter counted once in the world: by its owner when sharded (only it holds the sum)
            counted = ([p for s in self.stages.values() for p in s.parameters() if id(p) in self._owned]
                       if self._owned is not None else list(self.stages[self.position].parameters()))
            grads = [self.host.grad(p) for p in counted]   # a stage on the host: its host copy holds the sums
            own = [g.double().pow(2).sum().to(self._scalars.device) for g in grads if g is not None]
            if own:
                self._scalars[1] = torch.stack(own).sum()
        self.comm.allreduce(self._scalars, None, "the loss allreduce")
        return float(self._scalars[0])

    @torch.no_grad()
    def _scatter(self, flat: torch.Tensor, buffers: list[torch.Tensor]) -> None:
        offset = 0
        for b in buffers:
            b.copy_(flat[offset:offset + b.numel()].view_as(b))
            offset += b.numel()

    @torch.no_grad()
    def apply(self, optimizer: torch.optim.Optimizer) -> bool:
        """The optimizer step (after clipping) and the deferred BatchNorm update, unless the loss
        is not finite: then the buffers go back to their values before the step. The gradients
        stay (``zero_grads`` clears them). Returns whether the step was applied; sharded, an applied
        step's new parameters reach the other members by ``share``."""
        applied = bool(torch.isfinite(self._scalars[0]))
        if not applied:
            self._rollback.restore()
        else:
            if self.clip_grad_norm is not None:
                self.last_grad_norm = math.sqrt(float(self._scalars[1]))
                scale = self.clip_grad_norm / (self.last_grad_norm + 1e-6)
                if scale < 1.0:
                    for key, (_, grads, _, _) in self.layout.segments.items():
                        if key not in self.host:
                            grads.mul_(scale)
                    self.host.scale(scale)
            if self._updates_on_worker:   # settled before what reads it (``settle``)
                self.update.launch(optimizer)
            else:
                with self.host.updating():
                    optimizer.step()
                if not self.sharded:   # sharded: after the exchange (``share``)
                    self.host.copy_back()
            for _, norms in self.batch_norms:
                norms.update()
        return applied
