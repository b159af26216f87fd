"""The action loop: runs one position's action list for one step.

- forward: the stage input is the data (stage 0) or assembled from the messages of its incoming
  edges (``gems.pipeline.routes``: its neighbour's and any skip connection's); received tensors
  whose gradient goes back get ``requires_grad``; the stage runs under its memory
  policy (``StageRunner``); on the last stage the loss's sums are divided by the step's global
  normalisers (``inverse``, set by the engine before the step; ``gems.pipeline.loss``);
- backward: autograd from the loss or from the output gradients received on its outgoing edges
  (summed where several stages read one output); the input gradients are kept, per incoming
  edge, for the sends that follow. What its forward offloaded is prefetched as the compute
  action before it begins (``schedule.prefetch_points``), so the copy back runs beside that action.
  Split (``gems.pipeline.splitgrad``): backward_input computes the input gradients and keeps the
  graph, backward_weight the parameters' gradients later (a recomputing forward's whole backward
  runs in backward_input: a second half would recompute its segments again);
- a stage whose parameters live on the host, under ``Plan.swap_grouped``: each run of its consecutive
  forwards (backwards) goes group-major, each weight group over every micro-batch of the run while it is
  on the device, the run's sends after the last group's pass (``gems.pipeline.grouping``);
- send / recv: through the ``Messenger`` (a tile group's member: its tiles of the skips that go
  tile to tile, ``gems.pipeline.tiled``); reduce / sync / step: through ``GradSync``; after an
  applied step of a sharded optimizer, the parameter exchange (its own span, ``ir.SHARE``); then
  the gradient bucket is zeroed for the next step (its own span, ``ir.ZERO``: memory-bound work
  that is no part of the optimizer's update, which the ``step`` span times alone).

Every action is timed (``ActionTimer``) for traces and gems-bench.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gems.pipeline.batches import MicroBatches
from gems.pipeline.gradsync import GradSync
from gems.pipeline.grouping import Step, group_major, groupable
from gems.pipeline.loss import SumLoss, scaled
from gems.pipeline.p2p import Messenger
from gems.pipeline.routes import Routes
from gems.pipeline.splitgrad import Pending, input_half, weight_half
from gems.pipeline.stage import StageRunner, unpack
from gems.pipeline.timing import ActionTimer
from gems.schedule import ir
from gems.schedule.generators import prefetch_points

Key = tuple[int, int, int]   # (replica, micro-batch, stage)


class Executor:
    def __init__(self, actions: list[ir.Action], last_stage: int, runners: dict[int, StageRunner],
                 waiting: set[Key], batches: MicroBatches, messenger: Messenger, routes: Routes,
                 grads: GradSync, loss_fn: SumLoss, autocast: torch.dtype | None, device: torch.device,
                 optimizer: torch.optim.Optimizer | None, tile: int,
                 arrive: Callable[[torch.Tensor], torch.Tensor], grouped: set[int] = frozenset()) -> None:
        self.actions, self.last_stage, self.runners, self.waiting = actions, last_stage, runners, waiting
        # tile > 0: a tile group's member (gems.pipeline.tiled): its stages' outputs are placeholders
        # whose backward waits for the tiles' gradients from the leader, but for the tiles of the skips
        # it sends itself; it computes no loss
        self.tile, self.member = tile, tile > 0
        self.arrive = arrive   # rows of the images -> stage 0's input on the device (the engine's)
        self.routes = routes
        self.batches, self.messenger, self.grads = batches, messenger, grads
        self.loss_fn, self.autocast, self.device = loss_fn, autocast, device
        self.inverse = torch.ones(1, device=device)   # 1 / global normaliser per loss term
        self.timer = ActionTimer(device)
        self.optimizer = optimizer
        self.current: ir.Action | None = None   # the action running (for error reports)
        self.loss = torch.zeros(1, dtype=torch.float64, device=device)
        self.applied, self.global_loss = True, 0.0
        self._stash: dict[Key, tuple] = {}          # forward's (received per edge, outputs, leaves) until its backward
        self._input_grads: dict[tuple, tuple] = {}  # backward's input gradients (key, edge) until their send
        self._inbox: dict[tuple, dict] = {}         # (op, key) -> {edge: tensors} received, not yet consumed
        self._images: torch.Tensor | None = None
        self._labels: torch.Tensor | None = None
        self._prefetch = prefetch_points(actions)
        self._pending: dict[Key, Pending] = {}      # input half done, weight half to come
        # group-major runs of the stages in ``grouped`` whose parameters live on the host (gems.pipeline.grouping):
        # first action index -> (last index, stage, steps); per micro-batch, its run's state and group boundaries
        self._runs = group_major(actions, {s: n for s in grouped if (n := groupable(runners[s], s, actions))})
        self._group_runs: dict[Key, _Run] = {}
        self._boundaries: dict[Key, list[tuple[torch.Tensor, ...]]] = {}
        self._run = {ir.FORWARD: self._forward, ir.BACKWARD: self._backward,
                     ir.BACKWARD_INPUT: self._backward_input, ir.BACKWARD_WEIGHT: self._backward_weight,
                     ir.RECV_ACT: self._receive, ir.RECV_GRAD: self._receive,
                     ir.SEND_ACT: lambda a: messenger.send(a, routes.sent(self._edge(a), self._stash[_key(a)][1],
                                                                          tile)),
                     ir.SEND_GRAD: lambda a: messenger.send(a, self._input_grads.pop((_key(a), self._edge(a)))),
                     ir.REDUCE: lambda a: grads.start(a.stage), ir.SYNC: self._sync, ir.STEP: self._step}

    def run(self, images: torch.Tensor | None, labels: torch.Tensor | None) -> None:
        """Run the step's actions on this group's ``images``/``labels``. Raises what an action
        raised, with ``self.current`` the action that raised (None: posting the first receives)."""
        self._images, self._labels = images, labels
        self.loss.zero_()
        self.current = None
        timer, now = self.timer, self.timer.now
        self.messenger.begin_step()
        timer.begin_step()
        i = 0
        while i < len(self.actions):
            if i in self._runs:
                last, stage, steps = self._runs[i]
                self.grads.update.settle()
                self._group_major(stage, steps)
                i = last + 1
                continue
            a = self.current = self.actions[i]
            start = now()
            if a.op in ir.COMPUTE or i in self._prefetch:   # the parameters: the last update's, settled
                self.grads.update.settle()
            self._prefetch_before(i)
            self._run[a.op](a)
            timer.span(str(a), start, now())
            if a.op in ir.COMPUTE:
                self.grads.progress()
            i += 1
        a = self.actions[-1]
        if a.op == ir.STEP and self.applied and self.grads.sharded:   # the step's last action
            start = now()
            self.grads.share()
            timer.span(ir.SHARE, start, now())
        start = now()
        self.grads.zero_grads()
        timer.span(ir.ZERO, start, now())
        self._images = self._labels = None

    def _prefetch_before(self, i: int) -> None:
        key = self._prefetch.get(i)
        if key is not None:
            self.runners[key[2]].prefetch(key)

    def _group_major(self, stage: int, steps: list[Step]) -> None:
        """One group-major run of ``stage`` (``gems.pipeline.grouping``): each step timed as its action."""
        weights = self.runners[stage].weights
        timer, now = self.timer, self.timer.now
        with weights.hold():
            for step in steps:
                if step.kind == "release":
                    weights.release(step.group)
                    continue
                a = self.current = self.actions[step.index]
                start = now()
                if step.kind != "pass" and step.kind != "end":
                    self._prefetch_before(step.index)
                if step.kind == "action":
                    self._run[a.op](a)
                elif a.op == ir.FORWARD:
                    self._forward_part(a, step)
                else:
                    self._backward_part(a, step)
                timer.span(str(a), start, now())

    def _forward_part(self, a: ir.Action, step: Step) -> None:
        """A forward in a group-major run: its inputs ("begin"), one group's units ("pass"), its output."""
        key, runner = _key(a), self.runners[a.stage]
        if step.kind == "begin":
            key, received, leaves, given = self._forward_inputs(a)
            self._group_runs[key] = _Run(runner.group_pieces(key in self.waiting), list(given), [], received, leaves)
            return
        run = self._group_runs[key]
        if step.kind == "pass":
            run.boundaries.append(tuple(run.tensors))   # the group's inputs, where its backward pass stops
            with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
                run.tensors = list(runner.forward_group(tuple(run.tensors), run.pieces[step.group]))
            return
        del self._group_runs[key]
        self._boundaries[key] = run.boundaries
        self._forward_output(a, key, tuple(run.tensors), run.received, run.leaves)

    def _backward_part(self, a: ir.Action, step: Step) -> None:
        """A backward in a group-major run: its seeds ("begin"), one group's part of the graph ("pass":
        from the gradients of the next group's inputs to those of its own and of its parameters, which go
        to the host tier), its input gradients kept for the sends ("end")."""
        key, runner = _key(a), self.runners[a.stage]
        if step.kind == "begin":
            received, out, leaves = self._stash.pop(key)
            outputs, grads = self._seeds(a, out)
            self._group_runs[key] = _Run(None, outputs, self._boundaries.pop(key), received, leaves, grads)
            return
        run = self._group_runs[key]
        if step.kind == "end":
            del self._group_runs[key]
            self._keep_input_grads(key, run.received)
            return
        g = step.group
        wanted = list({id(t): t for t in (run.boundaries[g] if g else run.leaves) if t.requires_grad}.values())
        params = runner.weights.groups[g].params
        found = (torch.autograd.grad(run.tensors, wanted + params, run.grads, allow_unused=True)
                 if run.tensors else [None] * (len(wanted) + len(params)))
        for p, grad in zip(params, found[len(wanted):]):
            runner.weights.accumulate(p, grad)
        pairs = [(t, grad) for t, grad in zip(wanted, found) if grad is not None]
        if g:
            run.tensors, run.grads = [t for t, _ in pairs], [grad for _, grad in pairs]
            return
        for t, grad in pairs:   # the received leaves, as a backward leaves them
            t.grad = grad if t.grad is None else t.grad + grad

    def _edge(self, a: ir.Action) -> tuple[int, int]:
        return a.message(self.messenger.position).edge

    def _receive(self, a: ir.Action) -> None:
        self._inbox.setdefault((a.op, _key(a)), {})[self._edge(a)] = self.messenger.receive(a)

    def _forward(self, a: ir.Action) -> None:
        key, received, leaves, given = self._forward_inputs(a)
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            out = self.runners[a.stage].forward(given, key, key in self.waiting)
        self._forward_output(a, key, out, received, leaves)

    def _forward_inputs(self, a: ir.Action) -> tuple[Key, dict, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """A forward's (key, received per edge, leaves an input half stops at, the stage's inputs)."""
        rows = self.batches.rows(a.replica, a.micro)
        key = _key(a)
        received: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        leaves: tuple[torch.Tensor, ...] = ()   # what an input half stops at
        if a.stage == 0:
            inputs = (self.arrive(self._images[rows]),)
        else:
            # a member's suffix takes its tiles of the skips as received and the rest from the leader's
            # scatter; this scalar ties its graph there (the input half stops at it, so a member walks
            # its tiles' backward when its leader does)
            link = torch.zeros((), device=self.device, requires_grad=True) if self.member else None
            received = self._inbox.pop((ir.RECV_ACT, key), {})
            for edge, tensors in received.items():
                grads = self.routes.edges[edge].grads
                for t, k in zip(tensors, self.routes.carried(edge, self.tile)):
                    t.requires_grad_(grads[k])
            leaves = tuple(t for tensors in received.values() for t in tensors) + ((link,) if self.member else ())
            if self.member and not received:
                inputs = (link,)
            else:
                inputs = self.routes.assemble(a.stage, received, self.device, self.tile, link)
        runner = self.runners[a.stage]
        # A received tensor is a leaf; a unit that writes one in place (ReLU(inplace=True) first
        # thing in a stage) gets a copy, through which the gradient still reaches the leaf.
        given = inputs
        if a.stage > 0 and runner.inplace_inputs:
            given = tuple(t.clone() if i in runner.inplace_inputs else t for i, t in enumerate(inputs))
        return key, received, leaves, given

    def _forward_output(self, a: ir.Action, key: Key, out: tuple[torch.Tensor, ...], received: dict,
                        leaves: tuple[torch.Tensor, ...]) -> None:
        """Keep a forward's output for its sends and backward; on the last stage, its loss instead."""
        if a.stage == self.last_stage and not self.member:
            rows = self.batches.rows(a.replica, a.micro)
            labels = self._labels[rows].to(self.device, non_blocking=True)
            terms = self.loss_fn(unpack(out), labels)
            loss = scaled(terms, self.inverse)
            self.loss += loss.detach()
            out = (loss,)
        self._stash[key] = (received, out, leaves)

    def _seeds(self, a: ir.Action, out: tuple) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The tensors a backward starts from and their gradients (None: the scalar loss). A member's
        placeholders start it with ones (their backward waits for the leader's gradients)."""
        if a.stage == self.last_stage and not self.member:
            return list(out), None
        pairs = self.routes.output_grads(a.stage, out, self._inbox.pop((ir.RECV_GRAD, _key(a)), {}), self.tile)
        if self.member:
            seeded = {id(o) for o, _ in pairs}
            rest = list({id(o): o for o in out if o.requires_grad and id(o) not in seeded}.values())
            pairs += [(o, torch.ones_like(o)) for o in rest]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _backward(self, a: ir.Action) -> None:
        key = _key(a)
        self.grads.gradients(a.stage)
        received, out, _ = self._stash.pop(key)
        outputs, grads = self._seeds(a, out)
        if outputs:
            torch.autograd.backward(outputs, grads)
        self.runners[a.stage].finish_backward()
        self._keep_input_grads(key, received)

    def _backward_input(self, a: ir.Action) -> None:
        key = _key(a)
        runner = self.runners[a.stage]
        if runner.recomputes(key in self.waiting):
            # its recomputed tensors are dropped as the backward reads them, so a second half
            # would recompute the segments again: the whole backward runs now, the weight half
            # finds nothing left to do
            self._backward(a)
            return
        self.grads.gradients(a.stage)
        received, out, leaves = self._stash.pop(key)
        outputs, grads = self._seeds(a, out)
        self._pending[key] = input_half(outputs, grads, list(leaves), runner.params)
        runner.finish_backward()
        self._keep_input_grads(key, received)

    def _backward_weight(self, a: ir.Action) -> None:
        pending = self._pending.pop(_key(a), None)
        if pending is not None:
            self.grads.gradients(a.stage)
            runner = self.runners[a.stage]
            weight_half(pending, runner.weights.accumulate if runner.weights is not None else None)
            self.grads.taken(a.stage)
            runner.finish_backward()

    def _keep_input_grads(self, key: Key, received: dict) -> None:
        # the gradients are kept here until their send; the received leaves must not hold them too,
        # since after a split backward's input half those leaves live on, in the graph the weight half
        # still needs
        for edge, tensors in received.items():
            self._input_grads[(key, edge)] = self.routes.input_grads(edge, tensors, self.tile)
            for t in tensors:
                t.grad = None

    def _sync(self, a: ir.Action) -> None:
        self.messenger.finish_sends()
        self.global_loss = self.grads.sync(self.loss)

    def _step(self, a: ir.Action) -> None:
        self.applied = self.grads.apply(self.optimizer)


def _key(a: ir.Action) -> Key:
    return (a.replica, a.micro, a.stage)


@dataclass
class _Run:
    """One micro-batch's compute action in a group-major run: a forward's pieces per group, the tensors
    between groups (a forward's current ones; a backward's, with their gradients, where the next pass
    starts), every group's inputs (``boundaries``), what it received and its leaves."""

    pieces: list | None
    tensors: list[torch.Tensor]
    boundaries: list[tuple[torch.Tensor, ...]]
    received: dict
    leaves: tuple[torch.Tensor, ...]
    grads: list[torch.Tensor] | None = None
