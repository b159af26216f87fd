"""Schedule simulator: replay the engine's own action lists with costs to predict a step.

Every position executes ``gems.schedule.generators.schedule(name, K, m)[position]`` in order -- the
lists the engine runs, so there is one source of truth for every schedule:

    forward / backward   take the stage's cost for one micro-batch (split: the input-gradient
                         and the weight-gradient share the backward's, ``Costs.input_share``)
    send_act / send_grad non-blocking; the message leaves when its directed link is free
                         (messages on one link queue behind each other) and arrives
                         latency + bytes / bandwidth after it leaves
    recv_act / recv_grad block until the message has arrived
    reduce               starts the allreduce of one stage's gradients (its param bytes) over
                         the position's sync group (``Topology.sync_group``), without waiting:
                         it runs once every member has started it and the group's previous
                         reduce is done, while the members compute on
    sync                 waits for the position's reduces; all ranks of the group finish
                         together, when the last of them is done
    step                 ``optimizer_time``, plus the host updates of the stages it holds whose
                         optimizer runs on the host (``Costs.host_seconds``); with ``shard`` (a
                         sharded optimizer, whose reduces are reduce-scatters: an allreduce
                         without its allgather half) 1/n of it on
                         each of a sync group's n ranks, then the parameter exchange: each
                         value crosses once (``Network.allgather_time`` of the position's parameters)

K = 2, m = 1, ``mast``, forward f = 1, backward b = 2, free messages: no bubble, step 2(f+b)::

    position 0 |F d0.s0|F u0.s1|B u0.s1 ......|B d0.s0 ......|
    position 1 |F u0.s0|F d0.s1|B d0.s1 ......|B u0.s0 ......|
               0       1       2              4              6

A stage whose parameters live in host memory (``--state-placement host``) adds, at the first compute
action of each visit (``gems.schedule.visits``), its weights' transfer beyond what the visit's compute
hides, on the host link it shares with activation offload (``gems.schedule.visits.transfer_seconds``);
grouped (``Costs.grouped``), each run replays group-major (``gems.schedule.visits.group_major``).

Timing is a max-plus function of the costs, so a faster network or device never slows a step.
Groups are identical, so only groups whose point-to-point links differ (a pipeline split
across nodes differently) are replayed; they meet in the sync. Pure Python: no torch, no MPI.

``benchmarks/resnet1001_scaling.py`` uses it for a weak-scaling prediction of ResNet-1001;
``utilization`` times any action lists (other systems' schedules too, ``gems.schedule.peers``)
with unit costs for ``gems-sim utilization``.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from gems.errors import GemsError
from gems.schedule import generators as sch
from gems.schedule.network import Network
from gems.schedule.topology import Topology
from gems.schedule.visits import group_major, transfer_seconds

# The default device when nothing was measured (gems-plan --calibrate measures this one instead).
V100_FLOPS = 15.7e12   # fp32 peak of a V100 SXM2
EFFICIENCY = 0.4       # fraction of peak that cuDNN convolutions of a deep ResNet typically sustain
ALLREDUCE = ("ring", "tree")


@dataclass
class Costs:
    """Per stage s (lists of length K), for ONE micro-batch: seconds and bytes."""

    forward: list[float]                        # seconds of stage s's forward
    backward: list[float]                       # seconds of stage s's backward
    boundary_bytes: list[int]                   # output of stage s = the message to stage s + 1
    activation_bytes: list[int] | None = None   # kept from forward start to backward end
    static_bytes: list[int] | None = None       # parameters, gradients, optimizer state, buffers
    param_bytes: list[int] | None = None        # gradient bytes allreduced by sync
    # per edge (producer, consumer), skip connections included: the message's bytes (replaces
    # boundary_bytes when given; the schedule then carries the skip edges' messages too)
    edge_bytes: dict[tuple[int, int], int] | None = None
    # a split backward's input-gradient share of ``backward`` per stage (None: half; convolutions'
    # input and weight gradients each cost about one forward)
    input_share: list[float] | None = None
    # a stage whose parameters live in host memory (--state-placement host, gems.partition.swapping): per
    # weight group, seconds to bring its parameters to the device (empty: a stage on the device), and per
    # stage seconds to copy its gradients down per backward visit; ``grouped``: a run of a stage's
    # consecutive forwards (backwards) moves them once (gems.schedule.visits)
    uploads: list[list[float]] | None = None
    download: list[float] | None = None
    grouped: bool = False
    # per stage, seconds one micro-batch's offloaded activations take on the host link each way (the
    # waiting forwards' only, ``generators.waiting_forwards``), which weight transfers share (None: none)
    offload: list[float] | None = None
    # seconds each holder spends per step after the sync on a stage whose optimizer runs on the host
    # (--state-placement host-optimizer, host): the host update, and the parameters' copy back (None: none)
    host_seconds: list[float] | None = None

    def seconds(self, a: sch.Action) -> float:
        """Seconds of one compute action of stage ``a.stage``."""
        if a.op == sch.FORWARD:
            return self.forward[a.stage]
        if a.op == sch.BACKWARD:
            return self.backward[a.stage]
        share = 0.5 if self.input_share is None else self.input_share[a.stage]
        return self.backward[a.stage] * (share if a.op == sch.BACKWARD_INPUT else 1.0 - share)

    def check(self, K: int) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("edge_bytes", "grouped") and value is not None and len(value) != K:
                raise GemsError(f"costs.{f.name} has {len(value)} entries for {K} stages: give one per stage")


@dataclass
class Result:
    """One simulated training step; per-position lists describe group 0."""

    schedule: str
    stages: int
    micro_batches: int
    groups: int
    step_time: float                                  # seconds until the last rank finishes
    busy: list[float]                                 # seconds of forward + backward + step per position
    peak_activation_bytes: list[int]                  # exact peak over time per position
    static_bytes: list[int]                           # per position, the stages it holds
    timeline: list[list[tuple[float, float, str]]]    # per position (start, end, label), waits included

    @property
    def bubble_fraction(self) -> float:
        """1 - busy / (K x step time): the share of rank-time spent waiting or syncing."""
        return 1.0 - sum(self.busy) / (self.stages * self.step_time) if self.step_time > 0 else 0.0

    @property
    def peak_bytes(self) -> list[int]:
        return [s + a for s, a in zip(self.static_bytes, self.peak_activation_bytes)]

    def throughput(self, micro_batch_size: int = 1) -> float:
        """Images per second over the whole job (all groups, replicas and micro-batches)."""
        images = micro_batch_size * self.groups * sch.replicas(self.schedule) * self.micro_batches
        return images / self.step_time if self.step_time > 0 else math.inf


def simulate(name: str, K: int, m: int, costs: Costs, network: Network = Network(), groups: int = 1,
             optimizer_time: float = 0.0, split: bool = False, shard: bool = False, order: str = "") -> Result:
    """Replay schedule (name, K, m) on ``groups`` data-parallel groups (see module docstring);
    ``split``: with the backward split into input- and weight-gradient actions; ``shard``: with the
    optimizer sharded over each sync group (``optimizer_time`` is then the unsharded step's);
    ``order``: the schedule search's variant to replay (a plan's ``order``; empty: its default)."""
    sch.check(name, K, m)
    costs.check(K)
    if not isinstance(groups, int) or groups < 1:
        raise GemsError(f"the number of groups must be a positive integer, got {groups!r}")
    if network.allreduce not in ALLREDUCE:
        raise GemsError(f"unknown allreduce {network.allreduce!r}: choose one of {', '.join(ALLREDUCE)}")
    edges = costs.edge_bytes
    lists = sch.schedule(name, K, m, [e for e in edges or () if e[1] > e[0] + 1], split=split, order=order)
    planned = lists   # what is alive when: the schedule's own order
    swapped = {s: len(groups) for s, groups in enumerate(costs.uploads or ()) if groups}
    if swapped and costs.grouped:
        lists = group_major(lists, swapped)
    waiting = [{(a.replica, a.micro, a.stage) for a in sch.waiting_forwards(actions)} for actions in planned]

    def offloaded(p: int, a: sch.Action) -> float:   # seconds on the host link of a's offloaded activations
        moved = costs.offload[a.stage] if costs.offload and (a.replica, a.micro, a.stage) in waiting[p] else 0.0
        return moved * getattr(a, "share", 1.0)
    transfers = transfer_seconds(lists, lambda a: costs.seconds(a) * getattr(a, "share", 1.0), costs.uploads,
                                 costs.download, costs.grouped, offloaded) if swapped else {}
    topo = Topology(world=K * groups, stages=K, schedule=name)
    reps = _representatives(K, groups, network)
    sync_key, sync_seconds = _sync_costs(topo, costs, network, shard)
    members = {key: len(reps) * len(key) for key in sync_seconds}
    issued: dict[tuple[frozenset, int], list[float]] = {}   # (sync key, stage) -> members' reduce starts
    link_free: dict[tuple[int, int, int], float] = {}      # (group, from, to) -> link free again
    sync_end: dict[frozenset, float] = {}

    def reduce(d: int, p: int, a: sch.Action, t: float) -> None:
        issued.setdefault((sync_key[p], a.stage), []).append(t)

    def send(d: int, p: int, a: sch.Action, t: float) -> float:
        msg = a.message(p)
        nbytes = edges[msg.edge] if edges else costs.boundary_bytes[msg.producer]
        latency, bandwidth = network.link(d * K + p, d * K + a.peer)
        leave = max(t, link_free.get((d, p, a.peer), 0.0))
        link_free[(d, p, a.peer)] = leave + nbytes / bandwidth
        return leave + nbytes / bandwidth + latency

    def sync(d: int, p: int, t: float) -> float | None:
        key = sync_key[p]
        order = [a.stage for a in lists[p] if a.op == sch.REDUCE]
        if key not in sync_end and all(len(issued.get((key, s), ())) == members[key] for s in order):
            end = 0.0   # the key's reduces run one after another, each once every member started it
            for s in order:
                end = max(end, *issued[(key, s)]) + sync_seconds[key][s]
            sync_end[key] = end
        return None if key not in sync_end else max(t, sync_end[key])

    steps = [optimizer_time] * K
    if shard:
        params = costs.param_bytes or [0] * K
        for p in range(K):
            ranks = topo.sync_group(p)
            latency, bandwidth = network.link(ranks[0], ranks[-1])
            exchange = network.allgather_time(sum(params[s] for s in topo.holds(p)), len(ranks), latency,
                                              network.collective(bandwidth))
            steps[p] = optimizer_time / len(ranks) + exchange
    for p in range(K) if costs.host_seconds else ():
        steps[p] += sum(costs.host_seconds[s] for s in topo.holds(p))
    clock, busy, timeline = _replay(lists, reps, lambda a: costs.seconds(a) * getattr(a, "share", 1.0)
                                    + transfers.get(a, 0.0), send, reduce, sync, steps.__getitem__)
    static = costs.static_bytes or [0] * K
    return Result(
        schedule=name, stages=K, micro_batches=m, groups=groups,
        step_time=max(clock.values()),
        busy=[busy[(0, p)] for p in range(K)],
        peak_activation_bytes=[_peak_activations(actions, costs.activation_bytes) for actions in planned],
        static_bytes=[sum(static[s] for s in sch.holds(name, K, p)) for p in range(K)],
        timeline=[timeline[(0, p)] for p in range(K)])


Clock = dict[tuple[int, int], float]


def _replay(lists: list[list[sch.Action]], groups: Sequence[int], seconds: Callable[[sch.Action], float],
            send: Callable[[int, int, sch.Action, float], float],
            reduce: Callable[[int, int, sch.Action, float], None],
            sync: Callable[[int, int, float], float | None],
            step: Callable[[int], float]) -> tuple[Clock, Clock, dict[tuple[int, int], list[tuple[float, float, str]]]]:
    """Run every position of ``groups`` through its list: compute takes ``seconds(action)``,
    ``send`` gives a message's arrival, a receive waits for it, ``reduce`` notes a stage's
    reduce starting, ``sync`` gives when the sync group is done (None: not every member has
    arrived yet), the optimizer step ``step(position)``. Returns per (group, position) the
    finishing time, the busy seconds and the timeline."""
    arrival: dict[tuple, float] = {}                       # (group, message) -> arrival time
    pc = {(d, p): 0 for d in groups for p in range(len(lists))}
    clock = dict.fromkeys(pc, 0.0)
    busy = dict.fromkeys(pc, 0.0)
    timeline: dict[tuple[int, int], list[tuple[float, float, str]]] = {key: [] for key in pc}
    progress = True
    while progress:   # lists are deadlock-free (gems.schedule.validate), so every pass advances someone
        progress = False
        for d, p in pc:
            actions, i, t, line = lists[p], pc[(d, p)], clock[(d, p)], timeline[(d, p)]
            while i < len(actions):
                a = actions[i]
                if a.op in sch.COMPUTE:
                    cost = seconds(a)
                    line.append((t, t + cost, f"{a.op} {sch.REPLICA_NAMES[a.replica]}{a.micro}.s{a.stage}"))
                    t += cost
                    busy[(d, p)] += cost
                elif a.op in sch.SENDS:
                    arrival[(d, a.message(p))] = send(d, p, a, t)
                elif a.op in sch.RECVS:
                    ready = arrival.get((d, a.message(p)))
                    if ready is None:
                        break
                    if ready > t:
                        line.append((t, ready, f"wait {a}"))
                        t = ready
                elif a.op == sch.REDUCE:
                    reduce(d, p, a, t)
                elif a.op == sch.SYNC:
                    end = sync(d, p, t)
                    if end is None:
                        break
                    line.append((t, end, "sync"))
                    t = end
                else:   # step
                    cost = step(p)
                    line.append((t, t + cost, "step"))
                    t += cost
                    busy[(d, p)] += cost
                i += 1
            progress |= i != pc[(d, p)]
            pc[(d, p)], clock[(d, p)] = i, t
    stuck = [(d, p) for (d, p), i in pc.items() if i < len(lists[p])]
    if stuck:   # only reachable with hand-edited lists
        raise RuntimeError(f"the simulation stopped at {stuck[:3]}: the action lists deadlock")
    return clock, busy, timeline


UNIT = {sch.FORWARD: 1.0, sch.BACKWARD: 2.0, sch.BACKWARD_INPUT: 1.0, sch.BACKWARD_WEIGHT: 1.0}


def utilization(lists: list[list[sch.Action]], ticks: dict[str, float] = UNIT) -> float:
    """Compute time summed over positions / (positions x step time) for one step of ``lists``,
    every stage taking ``ticks[op]`` per micro-batch (forward 1, backward 2, or input-gradient 1 +
    weight-gradient 1), messages free, sync and optimizer left out."""
    lists = [[a for a in actions if a.op not in (sch.SYNC, sch.STEP)] for actions in lists]
    clock, busy, _ = _replay(lists, [0], lambda a: ticks[a.op], lambda d, p, a, t: t, lambda d, p, a, t: None,
                             lambda d, p, t: t, lambda p: 0.0)
    step = max(clock.values())
    return sum(busy.values()) / (len(lists) * step) if step > 0 else 1.0


def _representatives(K: int, groups: int, network: Network) -> list[int]:
    """One group per distinct layout of its K ranks over nodes (all groups alike without nodes)."""
    rpn = network.ranks_per_node
    if not rpn:
        return [0]
    layouts: dict[tuple[int, ...], int] = {}
    for d in range(groups):
        layouts.setdefault(tuple((d * K + r) // rpn - d * K // rpn for r in range(K)), d)
    return sorted(layouts.values())


def _sync_costs(topo: Topology, costs: Costs, network: Network,
                shard: bool = False) -> tuple[dict[int, frozenset], dict[frozenset, dict[int, float]]]:
    """Per position, the positions of group 0 it syncs with (its key); per key, the allreduce
    (``shard``: reduce-scatter) seconds of each stage it holds."""
    K, rpn = topo.stages, network.ranks_per_node
    params = costs.param_bytes or [0] * K
    ranks = {frozenset(r for r in topo.sync_group(p) if r < K): topo.sync_group(p) for p in range(K)}
    key_of = {p: key for key in ranks for p in key}
    crossing = {key for key, g in ranks.items() if rpn and g[0] // rpn != g[-1] // rpn}
    rings: dict[int, set[frozenset]] = {}   # node -> crossing rings with a member on it
    for rank in range(topo.world) if crossing else ():
        if key_of[rank % K] in crossing:
            rings.setdefault(rank // rpn, set()).add(key_of[rank % K])
    share = max((len(keys) for keys in rings.values()), default=1)
    seconds = {}
    for key, g in ranks.items():
        latency, bandwidth = network.link(g[0], g[-1])
        link = network.collective(bandwidth) / (share if key in crossing else 1)
        # sharded, the gradients are reduce-scattered: an allreduce without its allgather half
        seconds[key] = {s: network.allreduce_time(params[s], len(g), latency, link)
                        - (network.allgather_time(params[s], len(g), latency, link) if shard else 0.0)
                        for s in topo.holds(g[0])}
    return key_of, seconds


def _peak_activations(actions: list[sch.Action], activation_bytes: Sequence[int] | None) -> int:
    """Largest bytes alive at once: a micro-batch's activations live from forward start to backward
    end; one position runs one action at a time, so list order is time order."""
    if activation_bytes is None:
        return 0
    return max((sum(n * activation_bytes[s] for s, n in live.items()) for _, live, *_ in sch.moments(actions)),
               default=0)


def costs_from_plan(plan, device_flops: float = V100_FLOPS, efficiency: float = EFFICIENCY) -> Costs:
    """Costs of a ``gems.partition`` Plan's stages, timing FLOPs at ``device_flops x efficiency``.

    The seconds a stage's memory policies add per step (``StageEstimate.extra_seconds``:
    recomputation, exposed host copies) are spread over its backward passes, where the
    recomputation and the copies back happen. A spatial part's halo and gather messages
    (``StageEstimate.spatial_seconds``) block its tiled layers: half is added to the forward, half
    to the backward. A stage whose parameters live in host memory (``StageEstimate.group_bytes``) moves its
    weight groups and gradients at the plan's ``host_bandwidth`` (``Costs.uploads``)."""
    if device_flops <= 0 or not 0 < efficiency <= 1:
        raise GemsError("the device rate must be positive and the efficiency in (0, 1], e.g. 15.7e12 and 0.4")
    rate = device_flops * efficiency
    stages = plan.stage_estimates
    runs = getattr(plan, "micro_batches", 1) * sch.replicas(getattr(plan, "schedule", "mp"))
    link = getattr(plan, "host_bandwidth", None) or math.inf
    uploads = [[b / link for b in getattr(s, "group_bytes", ())] for s in stages]
    return Costs(forward=[s.forward_flops / rate + getattr(s, "spatial_seconds", 0.0) / 2 for s in stages],
                 backward=[s.backward_flops / rate + getattr(s, "extra_seconds", 0.0) / runs
                           + getattr(s, "spatial_seconds", 0.0) / 2 for s in stages],
                 boundary_bytes=[s.output_bytes for s in stages], edge_bytes=edge_bytes(plan),
                 activation_bytes=[s.activation_bytes for s in stages],
                 static_bytes=[s.static_bytes for s in stages],
                 param_bytes=[s.param_bytes for s in stages],
                 uploads=uploads if any(uploads) else None,
                 download=[s.grad_bytes / link if getattr(s, "group_bytes", ()) else 0.0 for s in stages],
                 offload=[getattr(s, "offload_bytes", 0) / link for s in stages],
                 host_seconds=[getattr(s, "host_seconds", 0.0) for s in stages],
                 grouped=getattr(plan, "swap_grouped", False))


def edge_bytes(plan) -> dict[tuple[int, int], int] | None:
    """A plan's message bytes per edge (``StageEstimate.sends``), or None for a plan without them."""
    edges = {(s.stage, j): b for s in plan.stage_estimates for j, b in getattr(s, "sends", [])}
    return edges or None


def simulate_plan(plan, network: Network = Network(), device_flops: float = V100_FLOPS,
                  efficiency: float = EFFICIENCY, optimizer_time: float = 0.0) -> Result:
    """``simulate`` for the configuration a Plan was made for (e.g. behind ``gems-plan --simulate``)."""
    return simulate(plan.schedule, plan.stages, plan.micro_batches, costs_from_plan(plan, device_flops, efficiency),
                    network, plan.groups, optimizer_time, getattr(plan, "split_backward", False),
                    getattr(plan, "shard_optimizer", False), getattr(plan, "order", ""))
