"""The engine: trains a plan's stages on this rank, a thin facade over the pipeline's parts.

Every rank builds the whole model, turns it into the plan's chain of units
(``gems.graph.graph_units`` at the plan's micro-batch shape: an ``nn.Sequential``'s children, any
other module traced), keeps the stages its position holds (``units[lo:hi]``; their state dicts
map back to the model's own keys) and executes its list of ``schedule(plan.schedule, K, m)``
(split backward: ``plan.split_backward``) each step. The parts, each in a module of its own:

    MicroBatches  (batches)   rows of the global batch per group, replica, micro-batch; loss scale
    StageRunner   (stage)     one stage's forward under its memory policy (recompute, offload)
    Messenger     (p2p)       the transfers the action list names, in the pair's wire order
    GradSync      (gradsync)  gradient bucket, BatchNorm statistics, clipping, non-finite skip
    HostTier      (hostopt)   model state placed in host memory: host copies, the update there
    HostWeights   (hostweights) a stage's parameters on the host, on the device per unit group
    Executor      (executor)  the action loop
    StageState    (state)     state dicts and optimizer state keyed by the model's names

With a spatial part (``plan.spatial_grid``) the positions holding stage 0 are tile groups of ranks,
each rank one tile of stage 0's first units (``gems.pipeline.tiled``, ``gems.spatial``).

Failures inside a step: bad input (the wrong rows, a replaced ``.grad``) raises GemsError
before the step communicates, and the engine stays usable. Anything raised once the step has
started communicating -- an allocator's failure included, reported as ``OutOfMemory`` -- ends
the job on every rank with that cause (``Comm.fail``): the peers are mid-step, and posted
receives (NCCL's above all) cannot be withdrawn, so there is no sound way to go on.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Callable, Iterable

import torch
from torch import nn

from gems import comm as comm_lib
from gems.errors import GemsError
from gems.graph import GraphUnits, check_tied, graph_units
from gems.pipeline.batches import MicroBatches
from gems.pipeline.batchnorm import check_mode
from gems.pipeline import compiled as compiling, compiler, examples
from gems.pipeline.executor import Executor
from gems.pipeline.forward import Forwards, gather_outputs
from gems.pipeline.gradsync import GradSync
from gems.pipeline.hostweights import PLACEMENT as WEIGHTS, HostWeights
from gems.pipeline.loss import LossScores, as_sum_loss, reciprocal
from gems.pipeline.offload import HostPool
from gems.pipeline.oom import OutOfMemory, is_out_of_memory
from gems.pipeline.p2p import PREFETCH, Messenger
from gems.pipeline.routes import Routes
from gems.pipeline.stage import StageRunner
from gems.pipeline.state import StageState
from gems.pipeline.tiled import sync_parts, tile_groups, tiled_stage
from gems.plan import formats
from gems.schedule import generators as sch
from gems.schedule.ir import describe_action
from gems.schedule.members import member_lists
from gems.schedule.topology import Topology


class Engine:
    """Trains ``model`` cut as ``plan`` says, on the ranks of the launch.

    Args:
        model: the full model, any ``nn.Module`` (built identically on every rank; parameters are
            broadcast within each sync group anyway, so copies start equal).
        plan: a ``gems.plan.Plan`` (cut points, schedule, K, m, boundary shapes, policies).
        optimizer: ``params -> torch.optim.Optimizer``, called once with this rank's parameters
            (of a stage placed on the host, their host copies: ``gems.pipeline.hostopt``).
            Its ``zero_grad()`` zeroes the gradient bucket in place (gradients live there). Where
            every stage of the rank keeps its state on the host, ``step`` returns while the update
            still runs (``gems.pipeline.hostupdate``); the engine's methods and the optimizer's
            ``zero_grad``, ``state_dict`` and ``load_state_dict`` wait for it.
        loss_fn: a ``gems.pipeline.loss.SumLoss`` (sums and normalisers: exact for any loss, e.g.
            ``gems.train.losses.make_loss``), or ``(output, labels) -> mean over the micro-batch``
            (e.g. ``nn.CrossEntropyLoss()``; exact when every micro-batch's mean divides by its rows).
        comm: ``"mpi"`` (default), ``"torch"``, or a ready ``gems.comm.Comm``. Given a name, the
            engine also sets torch's CPU threads to this rank's share of the node's cores.
        device: where the stages run; default the communicator's (``cuda:<local rank>`` when
            CUDA is present, else CPU).
        timeout: seconds a rank waits on a peer before aborting the job.
        prefetch: receives posted ahead of need (within the wire order, see ``gems.pipeline.p2p``).
        clip_grad_norm: scale gradients so their global L2 norm (all stages) is at most this.
        autocast: run stage forwards under ``torch.autocast`` with this dtype (e.g. bfloat16);
            boundaries still travel in the plan's dtypes.
        batch_norm: what BatchNorm layers do with micro-batches: ``"micro-batch"`` (PyTorch's
            behaviour per micro-batch), ``"deferred"`` (running statistics of the whole global
            batch, once per step) or ``"frozen"`` (eval mode); see ``gems.pipeline.batchnorm``.
        memory_format: ``torch.channels_last`` (or ``"channels_last"``) holds 4-D parameters,
            activations, gradients and messages in NHWC (``gems.plan.formats``); default the
            plan's ``memory_format``.
        compile: compile the stages (``gems.pipeline.compiled``), warmed up as the first step
            begins (a forward-only step's variant as the first such step begins: gems-predict
            compiles no training variant); default the plan's ``compiled``. ``engine.compiled``
            then holds the units (``recompiles``: graphs made after the warm-ups, the units left
            eager); None when eager.

    A step whose loss is not finite is never applied: the optimizer is skipped, the step
    leaves no trace in the model's buffers and ``last_step_applied`` is False, so the caller
    decides whether to stop or go on.
    """

    def __init__(self, model: nn.Module, plan, optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                 loss_fn: Callable, comm="mpi", device: torch.device | str | None = None,
                 timeout: float = 300.0, prefetch: int = PREFETCH, clip_grad_norm: float | None = None,
                 autocast: torch.dtype | None = None, batch_norm: str = "micro-batch",
                 memory_format: torch.memory_format | str | None = None, compile: bool | None = None) -> None:
        check_mode(batch_norm)
        if not isinstance(model, GraphUnits):   # any nn.Module: the plan's chain of units
            model = graph_units(model, plan.input_shape, plan.micro_batch_size, plan.leaf_modules)
        if plan.cuts[-1] != len(model) or getattr(model, "unit_names", plan.unit_names) != plan.unit_names:
            raise GemsError(f"the plan was made for {plan.cuts[-1]} units that the model does not have (it has "
                            f"{len(model)}): make the plan from this model, at this image size and batch")
        check_tied(model, plan.cuts)
        plan = _in_format(plan, model, memory_format)
        plan.check()   # one policy per stage, segments inside their stage
        if isinstance(comm, str):
            comm = comm_lib.create(comm, device=device, timeout=timeout)
            comm_lib.configure_threads(comm)  # cores / ranks on the node, unless OMP_NUM_THREADS
        self.comm, self.plan = comm, plan
        self.device = comm.device if device is None else torch.device(device)
        compile = plan.compiled if compile is None else bool(compile)
        if compile:   # before anything communicates: every rank refuses alike
            compiler.check(plan, self.device)
        if plan.tiles > 1 and self.device.type == "cuda" and comm.backend == "loopback" and comm.size > 1:
            # A tile's backward exchanges halos from inside autograd, and one process runs all its
            # CUDA backwards on that device's one autograd thread: two ranks' backwards would wait
            # on each other there for ever.
            raise GemsError("a spatial plan on CUDA needs one process per rank: loopback ranks share the "
                            "process's autograd thread, where their tiles' halo exchanges would deadlock; "
                            "launch the ranks with mpiexec (or run the loopback on CPU)")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.loss_fn, self.autocast, self.prefetch = as_sum_loss(loss_fn), autocast, prefetch
        self.K, self.m = plan.stages, plan.micro_batches
        self.topology = Topology.of(plan, comm.size)
        self.group, self.position, self.tile = self.topology.place(comm.rank)   # tile > 0: a tile group's member
        routes = Routes.of(plan, model)   # where each stage's inputs come from, checked against the model
        lists = sch.schedule(plan.schedule, self.K, self.m, routes.skips, plan.split_backward, plan.order)
        tiles = tile_groups(comm, self.topology, plan.spatial_grid)   # gems.pipeline.tiled
        mine = member_lists(lists, self.topology, routes.tile_edges) if self.tile else lists   # this rank's kind's
        self.actions = mine[self.position]
        batches = MicroBatches(plan.batch_size, self.topology.groups, self.group,
                               sch.replicas(plan.schedule), self.m, comm.rank)
        graph = isinstance(model, GraphUnits)
        model_keys = model.model_keys if graph else list(model.state_dict())
        key, extras = (model.model_key, model.extras) if graph else (str, {})
        self.stages: dict[int, nn.Sequential] = {
            s: model[plan.cuts[s]:plan.cuts[s + 1]] for s in self.topology.stages_of(comm.rank)}
        policies = {s: plan.policies[s] for s in self.stages}
        cut = None   # a tiled stage 0 takes this rank's tile of the images, cut before the device copy
        if tiles is not None:
            cut = tiles.tile if 0 in self.stages else None
            for s in self.topology.tiled_stages & set(self.stages):
                self.stages[s] = tiled_stage(self.stages[s], s, plan, tiles, batches.rows_per_micro, model)
        self.stages = {s: formats.convert(module.to(self.device), plan.memory_format)
                       for s, module in self.stages.items()}
        self._arrive = _arrival(cut, self.device, formats.of_name(plan.memory_format))
        # One pool of host buffers for all the stages this rank offloads, bounded by what the
        # plan prices it at (gems.partition.costs.host_moments).
        self.host_pool = HostPool(plan.host_bytes[self.position] if plan.host_bytes else None,
                                  pin=self.device.type == "cuda")
        self._forwards: dict[int, Forwards] = {}   # batch size -> forward-only steps
        runners = {s: StageRunner(module, plan.cuts[s], policies[s], self.device, self.host_pool)
                   for s, module in self.stages.items()}
        self.grads = GradSync(comm, self.topology, self.stages, self.device, clip_grad_norm, batch_norm,
                              sync_parts(self.topology, comm.rank, self.stages),
                              {s: policy.state_placement for s, policy in policies.items()})
        self.optimizer = optimizer(self.grads.optimized(plan.shard_optimizer))
        self.grads.host.check(self.optimizer)
        self.grads.keep_grads_in_bucket(self.optimizer)
        if self.grads.host.held:   # its update runs on a worker: the optimizer's state is read once settled
            self.grads.update.guard(self.optimizer)
        for s, runner in runners.items():   # parameters in host memory, on the device per unit group
            if policies[s].state_placement == WEIGHTS:
                runner.weights = HostWeights(runner.module, plan.cuts[s], policies[s].weight_groups, self.grads.host,
                                             self.device)
        messenger = Messenger(comm, self.topology, mine, self.position, routes, batches.rows_per_micro, self.device,
                              prefetch, self.tile)
        # a member recomputes where its leader does: whether a forward waits is a question of the leader's list
        waiting = {(a.replica, a.micro, a.stage) for a in sch.waiting_forwards(lists[self.position])}
        # (replica, micro) of the micro-batches whose loss this rank computes (their normalisers)
        self._losses_here = [(a.replica, a.micro) for a in self.actions
                             if a.op == sch.FORWARD and a.stage == self.K - 1 and not self.tile]
        self.executor = Executor(self.actions, self.K - 1, runners, waiting, batches, messenger, routes,
                                 self.grads, self.loss_fn, autocast, self.device, self.optimizer, self.tile,
                                 self._arrive, self._grouped(plan, runners))
        if tiles is not None:   # the tile group's halo, gather and statistics waits on the step's timeline
            tiles.timer = self.executor.timer
        self.grads.host.timer = self.executor.timer   # the host tier's copies and update, likewise
        self._state = StageState(comm, self.stages, self.optimizer, self.group == 0 and not self.tile, model_keys,
                                 key, extras, self.grads.shard_groups if plan.shard_optimizer else None,
                                 self.grads.host.parameter, self.grads.host.values)
        self._routes = routes
        self.compiled: compiling.CompiledUnits | None = None   # the stages compiled and warmed up, or eager
        self._warmed: set[tuple[int, bool]] = set()   # (rows, training) of the variants compiled so far
        if compile:   # warmed up before the first step, or the first forward-only step (gems-predict)
            self.compiled = compiling.CompiledUnits(self.executor.runners, plan)

    def _grouped(self, plan, runners: dict[int, StageRunner]) -> set[int]:
        """The stages whose runs of consecutive forwards (backwards) go group-major (``Plan.swap_grouped``,
        ``gems.pipeline.grouping``): those with parameters on the host, but tiled ones (their halo exchanges
        keep each micro-batch's order) and on a tile group's member."""
        if not getattr(plan, "swap_grouped", False) or self.tile:
            return set()
        return {s for s, r in runners.items() if r.weights is not None and s not in self.topology.tiled_stages}

    @property
    def needs_images(self) -> bool:
        """Whether this rank runs a first stage (and so reads images)."""
        return 0 in self.stages

    @property
    def needs_labels(self) -> bool:
        """Whether this rank runs a last stage (and so reads labels)."""
        return self.K - 1 in self.stages and not self.tile

    @property
    def runners(self) -> dict[int, StageRunner]:
        """{stage: StageRunner} of the stages this rank holds."""
        return self.executor.runners

    @property
    def bucket(self) -> torch.Tensor:
        """The flat tensor the gradients (and a copy of BatchNorm statistics) live in."""
        return self.grads.bucket

    @property
    def timer(self):
        return self.executor.timer

    @property
    def last_step_applied(self) -> bool:
        """False when the last step's loss was not finite (so the step was skipped)."""
        return self.executor.applied

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last applied step, when clipping."""
        return self.grads.last_grad_norm

    def step(self, images: torch.Tensor | None, labels: torch.Tensor | None) -> float:
        """One optimizer step; returns the mean loss over the global batch, on every rank.

        ``images``/``labels`` hold either the whole global batch (``plan.batch_size`` rows,
        the same on every rank is fine) or just this group's shard of it
        (``plan.batch_size // D`` rows); rows are then taken by replica and micro-batch.
        Ranks that need no images (or labels) may pass None. Afterwards ``comm.received`` holds
        the step's point-to-point bytes per tag (``PositionEstimate.received_bytes`` prices them).
        """
        batches = self.executor.batches
        if self.compiled is not None:
            self._warm_up(batches.rows_per_micro, training=True)
        images = batches.shard(images, "images", self.needs_images)
        labels = batches.shard(labels, "labels", self.needs_labels)
        self.grads.begin_step()
        try:
            self.executor.inverse = reciprocal(self._normalisers(labels, batches))
            self.comm.received.clear()
            self.executor.run(images, labels)
        except Exception as exc:  # noqa: BLE001 - peers are mid-step: the job cannot go on
            self._fail(exc, self.executor.current)
        return self.executor.global_loss

    def _normalisers(self, labels: torch.Tensor | None, batches: MicroBatches) -> torch.Tensor:
        """The step's global loss normalisers (``gems.pipeline.loss``): each micro-batch's, counted
        by the rank that computes its loss, summed over the world. COLLECTIVE."""
        total = torch.zeros(self.loss_fn.terms, dtype=torch.float64)
        for replica, micro in self._losses_here:
            total += self.loss_fn.normaliser(labels[batches.rows(replica, micro)]).reshape(-1).cpu()
        total = total.to(self.device)
        self.comm.allreduce(total, None, "the loss normaliser allreduce")
        return total

    def _fail(self, exc: BaseException, action) -> None:
        """End the job on every rank with ``exc`` (an allocator's failure as ``OutOfMemory``)."""
        if is_out_of_memory(exc):
            where = describe_action(action) if action is not None else "posting the first receives"
            oom = OutOfMemory(self.comm.rank, self.device.type.upper(), where, self.plan, self.position, exc)
            oom.__cause__ = exc
            exc = oom
        self.comm.fail(exc)

    def _forward_steps(self, batch_size: int | None) -> Forwards:
        size = self.plan.batch_size if batch_size is None else batch_size
        if size not in self._forwards:
            self._forwards[size] = Forwards(self.comm, self.topology, self.plan, self._routes, self.position,
                                            self.group, self.executor.runners, size, self.device, self.autocast,
                                            self.prefetch, self.tile, self._arrive)
            if self.compiled is not None:   # their variant: no grad, eval mode, their rows
                self._warm_up(self._forwards[size].batches.rows_per_micro, training=False)
        return self._forwards[size]

    def _warm_up(self, rows: int, training: bool) -> None:
        """Run every compiled run of units once on inputs of ``rows`` images (``gems.pipeline.compiled``),
        unless that variant ran already; after the first, rank 0 prints what compiled. COLLECTIVE."""
        if (rows, training) in self._warmed:
            return
        self.compiled.warm_up(lambda s: examples.example_inputs(self.plan, self._routes, s, rows, self.device,
                                                                 self._arrive), rows, self.device, self.autocast,
                              training)
        if not self._warmed:
            for line in self.compiled.summary(self.comm):   # rank 0's lines
                print(f"gems: {line}", flush=True)
        self._warmed.add((rows, training))

    def evaluate(self, batches: Iterable, scores=None, batch_size: int | None = None) -> dict:
        """Forward-only pass over ``batches`` (``(images, targets)`` per global batch, or this group's
        shard of it, as ``step`` takes them; the same number of batches on every rank) with the
        mirrored replicas both running forwards (``gems.pipeline.forward``). ``scores`` accumulates
        what the metrics need (``update(output, target)`` on the ranks that compute outputs, a
        float64 ``state`` summed over the world at the end, ``compute(state) -> dict``; default:
        the loss alone, ``LossScores``); returns ``scores.compute`` of the summed state on every
        rank. ``batch_size``: rows of a global batch (default the plan's). Rows whose targets the
        scores skip (``gems.train.targets.IGNORE``) may pad the last batch. COLLECTIVE."""
        scores = LossScores(self.loss_fn) if scores is None else scores
        self.grads.update.settle()   # the parameters of the last step's update, if it ran on the host's worker
        forwards = self._forward_steps(batch_size)
        for images, targets in batches:
            images = forwards.batches.shard(images, "images", self.needs_images)
            targets = forwards.batches.shard(targets, "targets", self.needs_labels)
            try:
                forwards.run(images, lambda r, j, rows, out: scores.update(out, targets[rows].to(self.device)))
            except Exception as exc:  # noqa: BLE001 - peers are mid-step
                self._fail(exc, forwards.current)
        state = scores.state.to(self.device, torch.float64, copy=True)
        self.comm.allreduce(state, None, "the evaluation allreduce")
        return scores.compute(state.cpu())

    def predict(self, images: torch.Tensor | None, batch_size: int | None = None) -> torch.Tensor | None:
        """The model's output for this group's rows of ``images`` (the global batch or this group's
        shard; ranks holding no first stage may pass None, then ``batch_size`` says the global
        batch's rows), returned on the group's position-0 rank and None on the others. The
        model is never gathered: the outputs computed on position K-1 travel to position 0
        (outputs in the plan's dtype of the last stage's output). COLLECTIVE within the group."""
        size = batch_size if batch_size is not None else (len(images) if images is not None else None)
        if size is None:
            raise GemsError(f"rank {self.comm.rank} got no images for predict: pass batch_size, the rows "
                            "of the global batch")
        self.grads.update.settle()
        forwards = self._forward_steps(size)
        images = forwards.batches.shard(images, "images", self.needs_images)
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        try:
            forwards.run(images, lambda r, j, rows, out: outputs.__setitem__((r, j), out))
            if self.tile:   # a tile group's member: the leader has the outputs
                return None
            return gather_outputs(self.comm, self.topology, self.plan, self.position, outputs, forwards.batches,
                                  self.device)
        except Exception as exc:  # noqa: BLE001 - peers are mid-step
            self._fail(exc, forwards.current)

    def timeline(self) -> list[tuple[str, float, float]]:
        """The last step's actions as (label, start, end) seconds from the step's start
        (``timer.started`` on the wall clock); labels as ``str(Action)``."""
        return self.executor.timer.timeline()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's state dict (keys as ``model.state_dict()``), on every rank. COLLECTIVE."""
        self.grads.update.settle()
        return self._state.state_dict()

    def stage_state(self, stage: int) -> dict:
        """A checkpoint shard of a stage this rank holds (``StageState.stage_state``; COLLECTIVE if sharded)."""
        self.grads.update.settle()
        return self._state.stage_state(stage)

    def load_state(self, model: dict[str, torch.Tensor], optimizer: dict[str, dict] | None = None,
                   param_groups: list[dict] | None = None) -> None:
        """Load full-model state (from any partition): each rank takes its stages' entries."""
        self.grads.update.settle()
        with contextlib.ExitStack() as resident:   # parameters on the host: loaded through the device, stored back
            for runner in self.runners.values():
                if runner.weights is not None:
                    resident.enter_context(runner.weights.resident())
            self._state.load_state(model, optimizer, param_groups)
        self.grads.host.refresh()   # the host copies of the parameters (--state-placement host-optimizer)


def _in_format(plan, model: nn.Module, memory_format) -> object:
    """``plan`` running in ``memory_format`` (None: the plan's own). A model without 4-D parameters
    has nothing channels_last changes: it runs in the default format, with a warning."""
    name = plan.memory_format if memory_format is None else formats.name_of(memory_format)
    if name == "channels_last" and not formats.takes_format(model):
        warnings.warn("channels_last asked for a model without 4-D parameters, which the format does not change: "
                      "training goes on in the default (contiguous) format", stacklevel=3)
        name = "contiguous"
    return plan if name == plan.memory_format else dataclasses.replace(plan, memory_format=name)


def _arrival(cut, device: torch.device, fmt: torch.memory_format) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows of the images -> stage 0's input: this rank's tile (``cut``), on ``device``, in ``fmt``."""
    def arrive(images: torch.Tensor) -> torch.Tensor:
        x = cut(images) if cut is not None else images
        return x.to(device, non_blocking=True, memory_format=fmt if x.dim() == 4 else torch.preserve_format)
    return arrive
