"""What the equivalence tests share: tiny models, data, the one-process reference, memory
policies, unit-call counting and the comparisons.

Two drivers use it, one per way of running ranks:

- ``run_loopback``: in process, one thread per rank (``gems.comm.loopback``), for
  tests/test_equivalence.py and tests/test_engine_contract.py;
- ``run``: one rank of an mpiexec launch, for tests/distributed/engine_worker.py.

Both train ``build(kind)`` cut by ``make_plan`` for a few SGD steps on ``data`` and compare with
``reference``, one process training the same model on the same global batches.

Threads share torch's global RNG: ``build`` seeds it and ``make_plan`` profiles with fake
tensors, so both run in the main thread, before ``loopback.run``, and every rank gets its own
deep copy of the model and the plan (``run_loopback`` does this); only the Engine and its
steps run in the rank threads.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import nn

import gems
from gems import models, partition
from gems.comm import loopback
from gems.pipeline.stage import checkpointed_segments
from gems.plan import StagePolicy
from gems.schedule import generators as sch

SIDE = 16
CLASSES = 5
KINDS = ("transparency", "batchnorm", "tuples")
POLICIES = ("none", "recompute", "segment", "offload", "recompute+offload")


class Mismatch(AssertionError):
    """A pipelined run disagrees with one process, with the recompute rule, or across copies."""


# ---------------------------------------------------------------- models, data, plans
def tiny(batchnorm: bool) -> nn.Sequential:
    def block(cin, cout):
        layers = [nn.Conv2d(cin, cout, 3, padding=1)]
        layers += [nn.BatchNorm2d(cout)] if batchnorm else []
        return nn.Sequential(*layers, nn.ReLU())
    return nn.Sequential(block(3, 8), block(8, 8), block(8, 8), block(8, 8), block(8, 8),
                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, CLASSES)))


def build(kind: str) -> nn.Sequential:
    """The model of ``kind``, seeded: "transparency" (no BatchNorm), "batchnorm", or "tuples"
    (AmoebaNet-D: tuple boundaries; in eval mode, so BatchNorm uses its running statistics).
    Seeds torch's global RNG: call it in the main thread."""
    torch.manual_seed(0)
    if kind == "tuples":
        return models.build("amoebanet-d", num_classes=CLASSES, num_layers=3, num_filters=8).eval()
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}")
    return tiny(batchnorm=kind == "batchnorm")


def data(batch: int, step: int, side: int = SIDE) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step`` (its own generator: the same in every thread and process)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, 3, side, side, generator=g), torch.randint(0, CLASSES, (batch,), generator=g)


def batch_size(schedule: str, m: int, D: int, rows: int = 2) -> int:
    """A global batch giving every micro-batch ``rows`` images."""
    return D * sch.replicas(schedule) * m * rows


def policies(name: str, cuts: list[int]) -> list[StagePolicy]:
    """Policy ``name`` on every stage of a plan with these cuts: "recompute" (one segment per
    unit), "segment" (one segment per stage), "offload", "recompute+offload", "none"."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}")

    def one(lo: int, hi: int) -> StagePolicy:
        segments = {"recompute": [[u, u + 1] for u in range(lo, hi)], "segment": [[lo, hi]]}
        return StagePolicy(recompute=segments.get(name.split("+")[0], []), offload="offload" in name)
    return [one(lo, hi) for lo, hi in zip(cuts, cuts[1:])]


_PROFILES: dict[tuple[str, int], dict] = {}   # per model kind and side: partition.plan's profile cache
_PLANS: dict[tuple, partition.Plan] = {}   # partition.plan's answer per layout (most are asked for again)


def make_plan(kind: str, schedule: str, K: int, m: int, D: int, side: int = SIDE, policy: str = "none",
              batch: int | None = None, split: bool | None = False, shard: bool = False,
              order: str = "", memory_format: str = "contiguous", placement: str = "device",
              group_units: int = 0, grouped: bool = False) -> partition.Plan:
    """The plan of ``build(kind)`` for this layout, every stage under ``policy`` with its model state
    at ``placement`` (on the cuts of the state on the device, so that placements compare bit for bit;
    and the schedule search's ``order`` when given); ``group_units``: under placement "host", weight
    groups of that many units (0: the whole stage one group), run group-major with ``grouped``
    (``Plan.swap_grouped``). Profiles with fake tensors (each micro-batch size once per kind) and plans
    each layout once (a copy each call): call it in the main thread."""
    batch = batch_size(schedule, m, D) if batch is None else batch
    model = build(kind)   # (seeding torch's RNG as always, planned or not)
    key = (kind, schedule, K, m, D, side, batch, split, shard)
    if key not in _PLANS:
        _PLANS[key] = partition.plan(model, input_shape=(3, side, side), batch_size=batch, stages=K,
                                     schedule=schedule, micro_batches=m, groups=D, split_backward=split,
                                     shard_optimizer=shard, profiles=_PROFILES.setdefault((kind, side), {}))
    plan = copy.deepcopy(_PLANS[key])
    plan.policies = [dataclasses.replace(p, state_placement=placement) for p in policies(policy, plan.cuts)]
    if group_units:
        plan.policies = [dataclasses.replace(p, weight_groups=[[u, min(u + group_units, hi)]
                                                               for u in range(lo, hi, group_units)])
                         for p, lo, hi in zip(plan.policies, plan.cuts, plan.cuts[1:])]
    plan.swap_grouped = grouped
    plan.order = order or plan.order
    plan.memory_format = memory_format
    return plan


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


OPTIMIZERS = {"sgd": optimizer, "adamw": adamw}   # SGD with momentum (the default), AdamW


@functools.lru_cache(maxsize=None)
def reference(kind: str, batch: int, steps: int | tuple[int, ...], clip: float | None = None,
              side: int = SIDE, optim: str = "sgd") -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """One process trains ``build(kind)`` with ``OPTIMIZERS[optim]`` on the global batches
    ``data(batch, i)`` for i in ``range(steps)`` (or in ``steps``, a tuple): (state dict, losses,
    gradient norms before clipping). Cached: do not modify what it returns."""
    model = build(kind)
    opt = OPTIMIZERS[optim](model.parameters())
    losses, norms = [], []
    for step in (range(steps) if isinstance(steps, int) else steps):
        x, y = data(batch, step, side)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads]))))
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses, norms


# ---------------------------------------------------------------- unit calls (recompute rule)
def count_unit_calls(engine) -> list[int]:
    """Per model unit, forward calls on this rank from now on (recomputations included)."""
    calls = [0] * engine.plan.cuts[-1]
    for s, stage in engine.stages.items():
        for i, unit in enumerate(stage, start=engine.plan.cuts[s]):
            unit.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def expected_unit_calls(engine) -> list[int]:
    """Per model unit, forward calls of one step: one per forward, plus one per forward that
    checkpoints a segment holding the unit (gems.pipeline.stage's rule)."""
    calls = [0] * engine.plan.cuts[-1]
    waiting = set(sch.waiting_forwards(engine.actions))
    for a in engine.actions:
        if a.op == sch.FORWARD:
            lo, hi = engine.plan.cuts[a.stage], engine.plan.cuts[a.stage + 1]
            segments = checkpointed_segments(engine.plan.policies[a.stage], a in waiting, hi)
            for u in range(lo, hi):
                calls[u] += 1 + sum(first <= u < end for first, end in segments)
    return calls


# ---------------------------------------------------------------- one rank's training
@dataclass
class Result:
    """What one rank saw: ``state`` is the full model's (every rank gets it), ``stage_state``
    this rank's own copies of its stages."""

    rank: int
    losses: list[float]
    state: dict[str, torch.Tensor]
    stage_state: dict[str, torch.Tensor]
    calls: list[int]                 # unit forwards over all steps
    expected_calls: list[int]        # per step, by the rule
    offloaded: int                   # bytes this rank moved to the host
    fetched_back: bool               # every offloaded tensor came back
    waiting: list[int]               # per waiting forward of this rank (offload applies to them): its stage's units
    applied: list[bool]
    grad_norm: float | None
    steps: int
    computed: list[tuple[str, int, int, int]]   # this rank's compute actions in order (op, replica, micro, stage)
    channels_last: list[bool] = None   # per 4-D parameter this rank holds: it and its gradient are NHWC


def train(comm, model: nn.Sequential, plan, steps: int | tuple[int, ...], side: int = SIDE,
          clip: float | None = None, optim: str = "sgd") -> Result:
    """Train ``model`` (this rank's own copy) with ``OPTIMIZERS[optim]`` on ``data`` for ``steps``
    steps (or these data indices). COLLECTIVE: every rank of the launch calls it."""
    engine = gems.Engine(model, plan, optimizer=OPTIMIZERS[optim], loss_fn=nn.CrossEntropyLoss(), comm=comm,
                         clip_grad_norm=clip)
    calls = count_unit_calls(engine)
    indices = range(steps) if isinstance(steps, int) else steps
    losses, applied = [], []
    for step in indices:
        losses.append(engine.step(*data(plan.batch_size, step, side)))
        applied.append(engine.last_step_applied)
    offloads = [r.offload for r in engine.runners.values() if r.offload is not None]
    return Result(rank=comm.rank, losses=losses, state=engine.state_dict(),
                  stage_state={k: v for s in engine.stages for k, v in engine.stage_state(s)["model"].items()},
                  calls=calls, expected_calls=expected_unit_calls(engine),
                  offloaded=sum(o.bytes for o in offloads), fetched_back=not any(o.saved for o in offloads),
                  waiting=[plan.cuts[a.stage + 1] - plan.cuts[a.stage] for a in sch.waiting_forwards(engine.actions)],
                  applied=applied, grad_norm=engine.last_grad_norm, steps=len(indices),
                  computed=[(a.op, a.replica, a.micro, a.stage) for a in engine.actions if a.op in sch.COMPUTE],
                  channels_last=[p.is_contiguous(memory_format=torch.channels_last) and p.grad is not None
                                 and p.grad.is_contiguous(memory_format=torch.channels_last)
                                 for s in engine.stages.values() for p in s.parameters() if p.dim() == 4])


# ---------------------------------------------------------------- comparisons
def describe(kind: str, schedule: str, K: int, D: int, m: int, clip: float | None = None,
             policy: str = "none") -> str:
    return (f"{kind} {schedule} K={K} D={D} m={m}" + (f" clip={clip}" if clip else "")
            + (f" policy={policy}" if policy != "none" else ""))


def check_calls(where: str, result: Result) -> None:
    """The rank ran each unit as often as the recompute rule says."""
    expected = [result.steps * n for n in result.expected_calls]
    if result.calls != expected:
        raise Mismatch(f"{where}: rank {result.rank} ran its units {result.calls} times, the rule says {expected}")


def check_reference(where: str, state: dict[str, torch.Tensor], losses: list[float],
                    ref_state: dict[str, torch.Tensor], ref_losses: list[float],
                    rtol: float = 1e-5) -> tuple[float, float]:
    """State dict and losses equal the reference's within ``rtol`` (relative to each tensor's
    largest value); integer entries exactly. Returns the worst errors (params, loss)."""
    if list(state) != list(ref_state):
        raise Mismatch(f"{where}: state dict keys {list(state)} differ from the model's {list(ref_state)}")
    worst = 0.0
    for k, v in ref_state.items():
        if v.is_floating_point():
            err = ((state[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)).item()
            if not err <= rtol:   # NaN fails too
                raise Mismatch(f"{where}: {k} differs, max relative error {err:.2e} exceeds {rtol:.0e}")
            worst = max(worst, err)
        elif not torch.equal(state[k], v):
            raise Mismatch(f"{where}: {k} differs: {state[k].tolist()} != {v.tolist()}")
    if len(losses) != len(ref_losses):
        raise Mismatch(f"{where}: {len(losses)} losses, the reference has {len(ref_losses)}")
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    if not loss_err <= rtol:
        raise Mismatch(f"{where}: losses {losses} differ from {ref_losses} ({loss_err:.2e} > {rtol:.0e})")
    return worst, loss_err


def check_copies(where: str, state: dict[str, torch.Tensor], copies: list[dict[str, torch.Tensor]]) -> int:
    """Every rank's copy of every entry equals the full state's (bit for bit); returns how
    many entries had more than one copy."""
    shared = 0
    for k, v in state.items():
        holders = [rank for rank, c in enumerate(copies) if k in c]
        shared += len(holders) > 1
        for rank in holders:
            if not torch.equal(copies[rank][k], v):
                raise Mismatch(f"{where}: rank {rank} holds a different copy of {k}")
    return shared


def check_same_run(where: str, a: Result, b: Result) -> None:
    """Two runs of one rank (placements of its model state, say) agree bit for bit: losses and every
    entry this rank holds."""
    differ = [k for k, v in a.stage_state.items() if not torch.equal(v, b.stage_state[k])]
    if differ or a.losses != b.losses:
        raise Mismatch(f"{where}: {differ[:3]} differ, losses {b.losses} and {a.losses}")


# ---------------------------------------------------------------- drivers
def run(comm, kind: str, schedule: str, K: int, m: int, steps: int, rtol: float,
        clip: float | None = None, side: int = SIDE, policy: str = "none", memory_format: str = "contiguous",
        optim: str = "sgd", placement: str = "device", shard: bool = False, group_units: int = 0) -> str:
    """One rank of an mpiexec launch: train, check, and return the "ok ..." line (raises
    Mismatch otherwise). COLLECTIVE."""
    D = comm.size // K
    plan = make_plan(kind, schedule, K, m, D, side, policy, memory_format=memory_format, placement=placement,
                     shard=shard, group_units=group_units)
    result = train(comm, build(kind), plan, steps, side, clip, optim)
    where = describe(kind, schedule, K, D, m, clip, policy) + (f" {memory_format}" if memory_format != "contiguous" else "")
    check_calls(where, result)
    if memory_format == "channels_last" and not (result.channels_last and all(result.channels_last)):
        raise Mismatch(f"{where}: rank {comm.rank}'s 4-D parameters or gradients left channels_last")
    moved = sum(comm.allgather_object(result.offloaded))
    if policy != "none":
        where += f" ({sum(result.calls)} unit forwards on rank {comm.rank}, {moved} B offloaded)"
    if kind == "batchnorm":
        copies = comm.allgather_object(result.stage_state)
        check_copies(where, result.state, copies)
        return f"ok {where}: {len(copies)} ranks, every copy identical"
    ref_state, ref_losses, _ = reference(kind, plan.batch_size, steps, clip, side, optim)
    worst, loss_err = check_reference(where, result.state, result.losses, ref_state, ref_losses, rtol)
    return f"ok {where}: max relative error {worst:.1e} params, {loss_err:.1e} loss"


def per_rank(kind: str, schedule: str, K: int, m: int, D: int, side: int = SIDE,
             policy: str = "none", split: bool | None = False, shard: bool = False,
             order: str = "", memory_format: str = "contiguous",
             placement: str = "device", group_units: int = 0,
             grouped: bool = False) -> tuple[list[nn.Sequential], list[partition.Plan]]:
    """For each of the K x D loopback ranks, its own copy of ``build(kind)`` and of the plan,
    made here in the calling (main) thread: rank r trains ``copies[r]`` under ``plans[r]``."""
    model, plan = build(kind), make_plan(kind, schedule, K, m, D, side, policy, split=split, shard=shard, order=order,
                                               memory_format=memory_format, placement=placement,
                                               group_units=group_units, grouped=grouped)
    return [copy.deepcopy(model) for _ in range(K * D)], [copy.deepcopy(plan) for _ in range(K * D)]


def _rank(comm, models_: list[nn.Sequential], plans: list, steps, side: int, clip: float | None,
          optim: str) -> Result:
    return train(comm, models_[comm.rank], plans[comm.rank], steps, side, clip, optim)


def run_loopback(kind: str, schedule: str, K: int, m: int, D: int, steps: int | tuple[int, ...] = 3,
                 rtol: float = 1e-5, clip: float | None = None, side: int = SIDE, policy: str = "none",
                 semantics: str = "mpi", timeout: float = 20.0, split: bool | None = False,
                 shard: bool = False, order: str = "", memory_format: str = "contiguous", optim: str = "sgd",
                 placement: str = "device", group_units: int = 0, grouped: bool = False) -> list[Result]:
    """Train on K x D loopback ranks (threads) with ``OPTIMIZERS[optim]``, model state at
    ``placement``, and check, as ``run`` does: the recompute rule on every rank; every copy
    identical ("batchnorm"), else the reference's state and losses (rank 0's, and every rank reports
    the same losses). Returns every rank's Result; raises Mismatch, or what a rank raised
    (loopback.Deadlock when the ranks cannot progress)."""
    copies, plans = per_rank(kind, schedule, K, m, D, side, policy, split, shard, order, memory_format, placement,
                             group_units, grouped)
    results = loopback.run(K * D, _rank, copies, plans, steps, side, clip, optim, semantics=semantics,
                           timeout=timeout)
    chosen = "auto, " * (split is None) + ("split backward" if plans[0].split_backward else "not split")
    where = describe(kind, schedule, K, D, m, clip, policy) + f" ({semantics}, {chosen})"
    for r in results:
        check_calls(where, r)
        if r.losses != results[0].losses:
            raise Mismatch(f"{where}: rank {r.rank} reports losses {r.losses}, rank 0 {results[0].losses}")
    if kind == "batchnorm":
        check_copies(where, results[0].state, [r.stage_state for r in results])
    else:
        ref_state, ref_losses, _ = reference(kind, plans[0].batch_size, steps, clip, side, optim)
        check_reference(where, results[0].state, results[0].losses, ref_state, ref_losses, rtol)
    return results
