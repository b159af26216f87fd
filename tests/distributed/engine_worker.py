"""Run under mpiexec: trains tiny models with every schedule on this launch's ranks and
checks the result against one process training on the same global batch.

    mpiexec -n 4 python tests/distributed/engine_worker.py transparency --stages 2,4

Modes:
  transparency  BatchNorm-free model: state dict and losses after 3 SGD steps equal the
                single-process reference within --rtol, for every schedule and m in {1, 2}.
  batchnorm     model with BatchNorm: every copy of every stage identical after the steps.
  tuples        AmoebaNet-D (tuple boundaries), eval-mode BatchNorm, against the reference.
  --policy P    with these modes: every stage gets memory policy P (recompute: one segment
                per unit; segment: one segment per stage; offload; recompute+offload), and
                each rank checks that its units ran exactly as often as the recompute rule
                of gems.pipeline.stage says.
  raise / kill  the last rank raises in (or is SIGKILLed during) its second forward: the
                job must end, non-zero, on every rank.
Prints one "ok ..." line per configuration on rank 0; any mismatch raises (and aborts).
"""
from __future__ import annotations

import argparse
import os
import signal

import torch
from torch import nn

import gems
from gems import comm as comm_lib
from gems import models, partition
from gems.pipeline import schedule as sch
from gems.plan import StagePolicy
from gems.pipeline.stage import checkpointed_segments
from gems.pipeline.schedule import SCHEDULES

SIDE = 16
POLICIES = ("none", "recompute", "segment", "offload", "recompute+offload")


def tiny(batchnorm: bool) -> nn.Sequential:
    def block(cin, cout):
        layers = [nn.Conv2d(cin, cout, 3, padding=1)]
        layers += [nn.BatchNorm2d(cout)] if batchnorm else []
        return nn.Sequential(*layers, nn.ReLU())
    return nn.Sequential(block(3, 8), block(8, 8), block(8, 8), block(8, 8), block(8, 8),
                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)))


def build(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    if kind == "tuples":
        return models.build("amoebanet-d", num_classes=5, num_layers=3, num_filters=8)
    return tiny(batchnorm=kind == "batchnorm")


def data(batch: int, step: int, side: int = SIDE) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, 3, side, side, generator=g), torch.randint(0, 5, (batch,), generator=g)


def policies(name: str, cuts: list[int]) -> list[StagePolicy]:
    """Policy ``name`` on every stage of a plan with these cuts."""
    def one(lo: int, hi: int) -> StagePolicy:
        segments = {"recompute": [[u, u + 1] for u in range(lo, hi)], "segment": [[lo, hi]]}
        return StagePolicy(recompute=segments.get(name.split("+")[0], []), offload="offload" in name)
    return [one(lo, hi) for lo, hi in zip(cuts, cuts[1:])]


def count_unit_calls(engine) -> list[int]:
    """Per model unit, forward calls on this rank from now on (recomputations included)."""
    calls = [0] * engine.plan.cuts[-1]
    for s, stage in engine.stages.items():
        for i, unit in enumerate(stage, start=engine.plan.cuts[s]):
            unit.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def expected_unit_calls(engine) -> list[int]:
    """Per model unit, forward calls of one step: one per forward, plus one per forward that
    checkpoints a segment holding the unit (gems.pipeline.stage' rule)."""
    calls = [0] * engine.plan.cuts[-1]
    waiting = set(sch.waiting_forwards(engine.actions))
    for a in engine.actions:
        if a.op == sch.FORWARD:
            lo, hi = engine.plan.cuts[a.stage], engine.plan.cuts[a.stage + 1]
            segments = checkpointed_segments(engine.plan.policies[a.stage], a in waiting, hi)
            for u in range(lo, hi):
                calls[u] += 1 + sum(first <= u < end for first, end in segments)
    return calls


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def reference(kind: str, batch: int, steps: int, clip: float | None = None, side: int = SIDE):
    model = build(kind)
    if kind == "tuples":
        model.eval()
    opt = optimizer(model.parameters())
    losses = []
    for step in range(steps):
        x, y = data(batch, step, side)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def run(comm, kind: str, schedule: str, K: int, m: int, steps: int, rtol: float,
        clip: float | None = None, side: int = SIDE, policy: str = "none") -> str:
    D = comm.size // K
    batch = D * (2 if schedule == "mast" else 1) * m * 2
    model = build(kind)
    if kind == "tuples":
        model.eval()
    plan = partition.plan(model, input_shape=(3, side, side), batch_size=batch, stages=K,
                          schedule=schedule, micro_batches=m, groups=D)
    plan.policies = policies(policy, plan.cuts)
    engine = gems.Engine(model, plan, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss(), comm=comm,
                         clip_grad_norm=clip)
    calls = count_unit_calls(engine)
    losses = [engine.step(*data(batch, step, side)) for step in range(steps)]
    state = engine.state_dict()
    where = (f"{kind} {schedule} K={K} D={D} m={m}" + (f" clip={clip}" if clip else "")
             + (f" policy={policy}" if policy != "none" else ""))
    expected = [steps * n for n in expected_unit_calls(engine)]
    if calls != expected:
        raise RuntimeError(f"{where}: rank {comm.rank} ran its units {calls} times, the rule says {expected}")
    moved = sum(comm.allgather_object(sum(r.offload.bytes for r in engine.runners.values() if r.offload)))
    where += f" ({sum(calls)} unit forwards on rank {comm.rank}, {moved} B offloaded)" if policy != "none" else ""
    if kind == "batchnorm":
        copies = comm.allgather_object({k: v.detach().cpu() for s in engine.stages.values()
                                        for k, v in s.state_dict().items()})
        for k, v in state.items():
            for rank, c in enumerate(copies):
                if k in c and not torch.equal(c[k], v):
                    raise RuntimeError(f"{where}: rank {rank} holds a different copy of {k}")
        return f"ok {where}: {len(copies)} ranks, every copy identical"
    ref_state, ref_losses = reference(kind, batch, steps, clip, side)
    if list(state) != list(ref_state):
        raise RuntimeError(f"{where}: state dict keys differ from the model's")
    worst = 0.0
    for k, v in ref_state.items():
        if v.is_floating_point():
            err = ((state[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)).item()
            worst = max(worst, err)
        elif not torch.equal(state[k], v):
            raise RuntimeError(f"{where}: {k} differs")
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    if worst > rtol or loss_err > rtol:
        raise RuntimeError(f"{where}: max relative error {worst:.2e} (params), {loss_err:.2e} (loss) "
                           f"exceeds {rtol:.0e}")
    return f"ok {where}: max relative error {worst:.1e} params, {loss_err:.1e} loss"


def fail(comm, how: str) -> None:
    """Train mast on K = world; the last rank fails inside its second forward."""
    model = build("transparency")
    plan = partition.plan(model, input_shape=(3, SIDE, SIDE), batch_size=2, stages=comm.size,
                          schedule="mast")
    engine = gems.Engine(model, plan, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss(), comm=comm)
    calls = 0

    def forward_hook(module, inputs):
        nonlocal calls
        calls += 1
        if comm.rank == comm.size - 1 and calls == 2:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure in forward")

    for stage in engine.stages.values():
        stage.register_forward_pre_hook(forward_hook)
    for step in range(3):
        engine.step(*data(2, step))
    print(f"rank {comm.rank} finished although a rank failed", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["transparency", "batchnorm", "tuples", "raise", "kill"])
    p.add_argument("--stages", default="2")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--micro-batches", default="1,2")
    p.add_argument("--backend", default="mpi")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--clip", type=float, default=None, help="clip the global gradient norm to this")
    p.add_argument("--side", type=int, default=SIDE, help="image height and width")
    p.add_argument("--policy", choices=POLICIES, default="none", help="memory policy of every stage")
    args = p.parse_args()
    torch.set_num_threads(1)
    comm = comm_lib.create(args.backend, timeout=60)
    with comm.guard():
        if args.mode in ("raise", "kill"):
            return fail(comm, args.mode)
        for K in map(int, args.stages.split(",")):
            for schedule in args.schedules.split(","):
                for m in map(int, args.micro_batches.split(",")):
                    if schedule == "mp" and m > 1:
                        continue
                    line = run(comm, args.mode, schedule, K, m, args.steps, args.rtol, args.clip,
                               args.side, args.policy)
                    if comm.rank == 0:
                        print(line, flush=True)


if __name__ == "__main__":
    main()
