"""The engine: runs one position's action list on this rank's stage modules.

Every rank builds the whole ``nn.Sequential``, keeps the stages its position holds
(``model[lo:hi]`` keeps the original unit names, so stage state dicts use the model's own
keys) and executes ``gems.schedule.schedule(plan.schedule, K, m)[position]`` each step:

- forward: stage input is the data (stage 0) or a pre-posted receive; received tensors
  get ``requires_grad`` so their gradient can be sent upstream; the stage runs under its
  memory policy (``plan.policies``: recompute, offload; see ``gems.policies``); the output is sent
  downstream, or, on the last stage, the loss is computed and scaled by
  ``micro_batch / global_batch`` so that summed gradients are those of the mean loss
  over the global batch;
- backward: autograd from the loss or from the received output gradient, then the input
  gradient goes upstream;
- sync: one allreduce of one flat bucket per rank over its sync group (mirror group under
  ``mast``, same position across groups otherwise). Gradients live *in* the bucket
  (``param.grad`` are views of it); a copy of the floating BatchNorm running statistics
  rides in the same call and is averaged, so all copies of a stage stay identical;
- step: the user's optimizer, then the gradient part of the bucket is zeroed.

Receives are posted ``prefetch`` messages ahead, so a peer's send usually finds its
receive already waiting; a receive action waits for it and leaves the tensors for the
compute action that follows; sends are non-blocking and completed before the sync.
Every action is timed (``timeline()``), for traces and gems-bench.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import nn

from gems import comm as comm_lib
from gems import schedule as sch
from gems.errors import GemsError, OutOfMemory, describe_action, is_out_of_memory
from gems.policies import StageRunner
from gems.policies import unpack as _unpack
from gems.timing import ActionTimer
from gems.topology import Topology

_KINDS = {"act": 0, "grad": 1}


class Engine:
    """Trains ``model`` cut as ``plan`` says, on the ranks of the launch.

    Args:
        model: the full ``nn.Sequential`` (built identically on every rank; parameters are
            broadcast within each sync group anyway, so copies start equal).
        plan: a ``gems.partition.Plan`` (cut points, schedule, K, m, boundary shapes).
        optimizer: ``params -> torch.optim.Optimizer``, called once with this rank's parameters.
        loss_fn: ``(output, labels) -> scalar`` mean over the micro-batch (e.g. CrossEntropyLoss()).
        comm: ``"mpi"`` (default), ``"torch"``, or a ready ``gems.comm.Comm``. Given a name, the
            engine also sets torch's CPU threads to this rank's share of the node's cores.
        device: where the stages run; default the communicator's (``cuda:<local rank>`` when
            CUDA is present, else CPU).
        timeout: seconds a rank waits on a peer before aborting the job.
        prefetch: receives posted ahead of need.
        clip_grad_norm: scale gradients so their global L2 norm (all stages) is at most this.
        autocast: run stage forwards under ``torch.autocast`` with this dtype (e.g. bfloat16);
            boundaries still travel in the plan's dtypes.

    A step whose loss is not finite is never applied: the optimizer is skipped and
    ``last_step_applied`` is False, so the caller decides whether to stop or go on.
    """

    def __init__(self, model: nn.Sequential, plan, optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                 loss_fn: Callable, comm="mpi", device: torch.device | str | None = None,
                 timeout: float = 300.0, prefetch: int = 2, clip_grad_norm: float | None = None,
                 autocast: torch.dtype | None = None) -> None:
        if not isinstance(model, nn.Sequential):
            raise GemsError(f"Engine needs an nn.Sequential model, got {type(model).__name__}")
        if plan.cuts[-1] != len(model):
            raise GemsError(f"the plan cuts {plan.cuts[-1]} units but the model has {len(model)}: "
                            "make the plan from this model")
        if isinstance(comm, str):
            comm = comm_lib.create(comm, device=device, timeout=timeout)
            comm_lib.configure_threads(comm)  # cores / ranks on the node, unless OMP_NUM_THREADS
        self.comm = comm
        self.device = comm.device if device is None else torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.plan, self.loss_fn, self.prefetch = plan, loss_fn, max(1, prefetch)
        self.clip_grad_norm, self.autocast = clip_grad_norm, autocast
        self.last_step_applied, self.last_grad_norm = True, None
        self.K, self.m = plan.stages, plan.micro_batches
        self.topology = Topology(self.comm.size, self.K, plan.schedule)
        self.group, self.position = self.topology.coords(self.comm.rank)
        self.actions = sch.schedule(plan.schedule, self.K, self.m)[self.position]
        self.replicas = sch.replicas(plan.schedule)
        B, parts = plan.batch_size, self.topology.groups * self.replicas * self.m
        if B % parts:
            raise GemsError(f"a global batch of {B} cannot be split into {self.topology.groups} groups x "
                            f"{self.replicas} replicas x {self.m} micro-batches: use a multiple of {parts}")
        self._mb = B // parts                    # rows per micro-batch
        self._scale = self._mb / B               # micro-batch mean loss -> its share of the global mean
        self._model_keys = list(model.state_dict().keys())
        self.stages: dict[int, nn.Sequential] = {
            s: model[plan.cuts[s]:plan.cuts[s + 1]].to(self.device) for s in self.topology.holds(self.position)}
        self._runners = self._policy_runners()
        self._waiting = {(a.replica, a.micro, a.stage) for a in sch.waiting_forwards(self.actions)}
        self.sync = self._sync_group()
        self._make_identical()
        self._make_bucket()
        self.optimizer = optimizer([p for s in self.stages.values() for p in s.parameters()])
        self._loss = torch.zeros(1, dtype=torch.float64, device=self.device)
        self._scalars = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss, grad norm^2
        self._stash: dict[tuple[int, int, int], tuple] = {}      # (replica, micro, stage) -> (inputs, outputs)
        self._input_grads: dict[tuple[int, int, int], tuple] = {}
        self._sends: list = []
        self._inbox: dict[tuple, tuple[torch.Tensor, ...]] = {}  # received, not yet consumed
        self._recv_queue = [a for a in self.actions if a.op in sch.RECVS]
        self._run = {sch.FORWARD: self._forward, sch.BACKWARD: self._backward,
                     sch.RECV_ACT: self._receive, sch.RECV_GRAD: self._receive,
                     sch.SEND_ACT: lambda a: self._send(a, self._stash[(a.replica, a.micro, a.stage)][1]),
                     sch.SEND_GRAD: lambda a: self._send(a, self._input_grads.pop((a.replica, a.micro, a.stage))),
                     sch.SYNC: lambda a: self._sync(), sch.STEP: lambda a: self._apply()}
        self.timer = ActionTimer(self.device)

    # ---------------------------------------------------------------- setup
    def _policy_runners(self) -> dict[int, StageRunner]:
        """One runner per stage held, applying ``plan.policies`` (a Plan has one per stage)."""
        self.plan.check()   # one policy per stage, segments inside their stage
        return {s: StageRunner(module, self.plan.cuts[s], self.plan.policies[s], self.device)
                for s, module in self.stages.items()}

    def _sync_group(self):
        """This rank's sync group, or None when it syncs with nobody."""
        mine = None
        for ranks in self.topology.sync_groups():  # collective: same order on every rank
            g = self.comm.group(ranks)
            if self.comm.rank in ranks:
                mine = g
        return mine if len(self.topology.sync_group(self.comm.rank)) > 1 else None

    def _make_identical(self) -> None:
        """Start every copy of a stage from the sync group's first rank's values."""
        if self.sync is None:
            return
        root = self.topology.sync_group(self.comm.rank)[0]
        with torch.no_grad():
            for s in self.stages.values():
                for t in list(s.parameters()) + list(s.buffers()):
                    self.comm.broadcast(t.data, root, self.sync)

    def _make_bucket(self) -> None:
        """One flat tensor for the sync: all gradients, then a copy of the floating buffers
        (BatchNorm statistics), so one allreduce per step syncs both.

        ``param.grad`` are views of the bucket, so backward accumulates straight into it.
        The buffers keep storage of their own: autograd saves BatchNorm's running statistics
        for backward, and a view of the bucket would share its version counter with the
        gradients being accumulated, failing autograd's in-place check.
        """
        params = [p for s in self.stages.values() for p in s.parameters() if p.requires_grad]
        self._buffers = [b for s in self.stages.values() for b in s.buffers() if b.is_floating_point()]
        dtypes = {t.dtype for t in params} | {b.dtype for b in self._buffers}
        if len(dtypes) > 1:
            raise GemsError(f"stage parameters mix dtypes {sorted(map(str, dtypes))}: "
                            "convert the model to one dtype before training")
        dtype = dtypes.pop() if dtypes else torch.float32
        n_grad = sum(p.numel() for p in params)
        n_buf = sum(b.numel() for b in self._buffers)
        self.bucket = torch.zeros(n_grad + n_buf, dtype=dtype, device=self.device)
        self._grads = self.bucket[:n_grad]
        self._stats = self.bucket[n_grad:]
        self._stats_before = torch.empty_like(self._stats)
        offset = 0
        for p in params:
            p.grad = self.bucket[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    # ---------------------------------------------------------------- step
    @property
    def needs_images(self) -> bool:
        """Whether this rank runs a first stage (and so reads images)."""
        return 0 in self.stages

    @property
    def needs_labels(self) -> bool:
        """Whether this rank runs a last stage (and so reads labels)."""
        return self.K - 1 in self.stages

    def step(self, images: torch.Tensor | None, labels: torch.Tensor | None) -> float:
        """One optimizer step; returns the mean loss over the global batch, on every rank.

        ``images``/``labels`` hold either the whole global batch (``plan.batch_size`` rows,
        the same on every rank is fine) or just this group's shard of it
        (``plan.batch_size // D`` rows); rows are then taken by replica and micro-batch.
        Ranks that need no images (or labels) may pass None.
        """
        self._images = self._shard(images, "images", self.needs_images)
        self._labels = self._shard(labels, "labels", self.needs_labels)
        self._loss.zero_()
        self._gather_stats(self._stats_before)  # restored if the step turns out not finite
        self._posted, self._consumed = {}, 0
        timer, now = self.timer, self.timer.now
        a = None
        try:
            self._post()
            timer.begin_step()
            for a in self.actions:
                start = now()
                self._run[a.op](a)
                timer.span(str(a), start, now())
        except Exception as exc:  # an allocator's failure becomes a message naming the fix
            if not is_out_of_memory(exc):
                raise
            where = describe_action(a) if a is not None else "posting the first receives"
            raise OutOfMemory(self.comm.rank, self.device.type.upper(), where, self.plan, self.position,
                              exc) from exc
        return float(self._scalars[0])

    def timeline(self) -> list[tuple[str, float, float]]:
        """The last step's actions as (label, start, end) seconds from the step's start
        (``timer.started`` on the wall clock); labels as ``str(Action)``."""
        return self.timer.timeline()

    def _shard(self, x: torch.Tensor | None, what: str, needed: bool) -> torch.Tensor | None:
        if not needed:
            return None
        B, D = self.plan.batch_size, self.topology.groups
        if x is None or len(x) not in (B, B // D):
            got = "None" if x is None else f"{len(x)} rows"
            raise GemsError(f"rank {self.comm.rank} needs {what}: pass the global batch ({B} rows) "
                            f"or this group's shard ({B // D} rows), got {got}")
        return x[self.group * (B // D):(self.group + 1) * (B // D)] if len(x) == B and D > 1 else x

    def _rows(self, replica: int, micro: int) -> slice:
        index = replica * self.m + micro
        return slice(index * self._mb, (index + 1) * self._mb)

    def _tag(self, kind: str, replica: int, micro: int) -> int:
        return (micro * 2 + replica) * 2 + _KINDS[kind]

    def _post(self) -> None:
        """Keep ``prefetch`` receives posted ahead of the one being waited for."""
        queue = self._recv_queue
        while len(self._posted) < self.prefetch and self._consumed + len(self._posted) < len(queue):
            a = queue[self._consumed + len(self._posted)]
            kind, replica, micro, boundary = a.message
            shapes = self.plan.stage_output_shapes[boundary]
            dtypes = self.plan.stage_output_dtypes[boundary]
            bufs = tuple(torch.empty((self._mb, *shape), dtype=getattr(torch, dt), device=self.device)
                         for shape, dt in zip(shapes, dtypes))
            req = self.comm.irecv(bufs, self.topology.peer(self.comm.rank, a.peer), self._tag(kind, replica, micro))
            self._posted[a.message] = (req, bufs, a)

    def _receive(self, a: sch.Action) -> None:
        """Wait for a posted receive; its tensors wait in the inbox for the compute action."""
        req, bufs, _ = self._posted.pop(a.message)
        self.comm.wait(req, f"{a} from rank {self.topology.peer(self.comm.rank, a.peer)}")
        self._consumed += 1
        self._post()
        self._inbox[(a.op, a.replica, a.micro, a.stage)] = bufs

    def _send(self, a: sch.Action, tensors: tuple[torch.Tensor, ...]) -> None:
        kind, _, _, boundary = a.message
        dtypes = self.plan.stage_output_dtypes[boundary]
        data = tuple(t.detach().to(getattr(torch, dt)).contiguous() for t, dt in zip(tensors, dtypes))
        peer = self.topology.peer(self.comm.rank, a.peer)
        self._sends.append(self.comm.isend(data, peer, self._tag(kind, a.replica, a.micro)))
        self._progress()

    def _forward(self, a: sch.Action) -> None:
        rows = self._rows(a.replica, a.micro)
        if a.stage == 0:
            inputs = (self._images[rows].to(self.device, non_blocking=True),)
        else:
            inputs = self._inbox.pop((sch.RECV_ACT, a.replica, a.micro, a.stage))
            for t in inputs:
                if t.is_floating_point():
                    t.requires_grad_(True)
        key = (a.replica, a.micro, a.stage)
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            out = self._runners[a.stage].forward(inputs, key, key in self._waiting)
        if a.stage == self.K - 1:
            labels = self._labels[rows].to(self.device, non_blocking=True)
            loss = self.loss_fn(_unpack(out), labels) * self._scale
            self._loss += loss.detach()
            out = (loss,)
        self._stash[key] = (inputs, out)

    def _backward(self, a: sch.Action) -> None:
        key = (a.replica, a.micro, a.stage)
        inputs, out = self._stash.pop(key)
        self._runners[a.stage].prefetch(key)
        if a.stage == self.K - 1:
            torch.autograd.backward(out)
        else:
            grads = self._inbox.pop((sch.RECV_GRAD, a.replica, a.micro, a.stage))
            pairs = [(o, g) for o, g in zip(out, grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if a.stage > 0:
            self._input_grads[(a.replica, a.micro, a.stage)] = tuple(
                x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs)

    def _progress(self) -> None:
        """Let the transport move pending sends while this rank computes."""
        self._sends = [r for r in self._sends if not self.comm.test(r)]

    def _sync(self) -> None:
        for req in self._sends:
            self.comm.wait(req, "a send to complete")
        self._sends = []
        if self.sync is not None:
            self._gather_stats(self._stats)
            self.comm.allreduce(self.bucket, self.sync, "the gradient allreduce")
            if self._buffers:
                self._stats /= self.sync.size
                self._scatter_stats(self._stats)
        # One world allreduce carries the loss and, for clipping, the squared gradient norm;
        # each stage's norm is counted once, by its copy on (group 0, position = stage).
        self._scalars[0] = self._loss[0]
        self._scalars[1] = 0.0
        if self.clip_grad_norm is not None and self.group == 0:
            own = [p.grad.double().pow(2).sum() for p in self.stages[self.position].parameters()
                   if p.grad is not None]
            if own:
                self._scalars[1] = torch.stack(own).sum()
        self.comm.allreduce(self._scalars, None, "the loss allreduce")

    def _gather_stats(self, out: torch.Tensor) -> None:
        if self._buffers:
            torch.cat([b.reshape(-1) for b in self._buffers], out=out)

    @torch.no_grad()
    def _scatter_stats(self, flat: torch.Tensor) -> None:
        offset = 0
        for b in self._buffers:
            b.copy_(flat[offset:offset + b.numel()].view_as(b))
            offset += b.numel()

    def _apply(self) -> None:
        """The optimizer step, unless the loss is not finite: then the step leaves no trace
        (BatchNorm statistics go back to their values before it) and gradients are zeroed."""
        self.last_step_applied = bool(torch.isfinite(self._scalars[0]))
        if not self.last_step_applied:
            self._scatter_stats(self._stats_before)
        else:
            if self.clip_grad_norm is not None:
                self.last_grad_norm = math.sqrt(float(self._scalars[1]))
                scale = self.clip_grad_norm / (self.last_grad_norm + 1e-6)
                if scale < 1.0:
                    self._grads.mul_(scale)
            self.optimizer.step()
        self._grads.zero_()

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's state dict (keys as ``model.state_dict()``), on every rank."""
        mine = {}
        if self.group == 0:
            for s in self.stages.values():
                mine.update({k: v.detach().cpu().clone() for k, v in s.state_dict().items()})
        full: dict[str, torch.Tensor] = {}
        for part in self.comm.allgather_object(mine):
            full.update(part)
        order = {k: i for i, k in enumerate(self._model_keys)}
        return dict(sorted(full.items(), key=lambda kv: order.get(kv[0], math.inf)))

    def _opt_names(self) -> list[str]:
        """Parameter names in the optimizer's own index order."""
        name_of = {id(p): n for s in self.stages.values() for n, p in s.named_parameters()}
        return [name_of[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def stage_state(self, stage: int) -> dict:
        """Everything a checkpoint shard keeps for one stage this rank holds: model tensors
        and optimizer state keyed by the model's own names (so any partition can load it)."""
        module = self.stages[stage]
        own = {n for n, _ in module.named_parameters()}
        opt = self.optimizer.state_dict()
        names = self._opt_names()
        return {
            "model": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
            "optimizer": {names[i]: {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                                     for k, v in st.items()}
                          for i, st in opt["state"].items() if names[i] in own},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]],
        }

    def load_state(self, model: dict[str, torch.Tensor], optimizer: dict[str, dict] | None = None,
                   param_groups: list[dict] | None = None) -> None:
        """Load full-model state (from any partition): each rank takes its stages' entries."""
        for s, module in self.stages.items():
            keys = module.state_dict().keys()
            missing = [k for k in keys if k not in model]
            if missing:
                raise GemsError(f"the checkpoint lacks {missing[0]} (and {len(missing) - 1} more): "
                                "it was saved from a different model")
            module.load_state_dict({k: model[k] for k in keys})
        if optimizer is None:
            return
        current = self.optimizer.state_dict()
        names = self._opt_names()
        current["state"] = {i: optimizer[n] for i, n in enumerate(names) if n in optimizer}
        if param_groups and len(param_groups) == len(current["param_groups"]):
            for group, saved in zip(current["param_groups"], param_groups):
                group.update({k: v for k, v in saved.items() if k != "params"})
        self.optimizer.load_state_dict(current)
