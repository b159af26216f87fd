"""The partition plan's types: where the cuts are, what each stage and position is estimated to
need, the inputs it was made for, and the check that these agree. Serialisable to JSON
(``Plan.to_json``/``Plan.from_json``, done in ``gems.plan.json_io``) so ``gems-plan --json`` output
can be reviewed, edited (``cuts``) and handed to training.

The engine reads: ``stages``, ``schedule``, ``micro_batches``, ``cuts``, ``input_shape``,
``stage_output_shapes``, ``stage_output_dtypes`` and ``policies``. Everything else is an
estimate for people. Bytes and FLOPs of a stage are per micro-batch; those of a position are
per step (a position runs ``micro_batches`` micro-batches of each replica it serves).
Estimates include the stages' policies (``gems.partition.policy`` prices them); the
``plain_*`` fields give the same cuts without policies.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field


# Saved tensors smaller than this stay on the device when a stage offloads: a copy each way
# costs more in launches and synchronisation than the few bytes are worth (BatchNorm's
# per-channel statistics, small masks, the logits of the loss). The engine and the planner agree on it.
MIN_OFFLOAD_BYTES = 64 * 1024


# How a plan's stages hold 4-D tensors (Plan.memory_format): torch.contiguous_format, torch.channels_last.
MEMORY_FORMATS = ("contiguous", "channels_last")

# Where a stage's model state lives (StagePolicy.state_placement): "device" -- parameters, gradients and
# optimizer state on the stage's device; "host-optimizer" -- the optimizer's state and its update in host
# memory, gradients copied out after the stage's last backward and the new parameters copied back
# (gems.pipeline.hostopt); "host" -- parameters in host memory too, on the device per weight group (Harmony).
STATE_PLACEMENTS = ("device", "host-optimizer", "host")
# What --state-placement (and partition.plan's state_placement) may ask for: one of those on every stage,
# "host" (parameters on the host too, Harmony's swapping) or "auto" (the planner chooses per stage).
PLACEMENT_CHOICES = (*STATE_PLACEMENTS, "auto")


@dataclass
class StagePolicy:
    """How one stage trades time for memory (applied by the engine, chosen by the planner).

    ``recompute``: checkpoint segments, each ``[first_unit, end_unit)`` in the model's unit
    indices, inside the stage, increasing and disjoint; a segment keeps only its input for
    backward and re-runs its forward then (``torch.utils.checkpoint``, non-reentrant). One
    segment per unit is per-unit recomputation; units in no segment keep their activations.
    ``offload``: tensors the stage saves for backward (after recomputation, only what is
    still saved) go to host memory and come back before the backward.
    ``state_placement``: where the stage's model state lives, one of ``STATE_PLACEMENTS``.
    ``weight_groups``: under ``state_placement == "host"``, the unit groups whose weights are
    resident on the device together, each ``[first_unit, end_unit)``, covering the stage's units
    in order (empty: the whole stage is one group); empty under any other placement.
    """

    recompute: list[list[int]] = field(default_factory=list)
    offload: bool = False
    state_placement: str = "device"
    weight_groups: list[list[int]] = field(default_factory=list)

    def checkpointed(self, waiting: bool, end_unit: int) -> list[list[int]]:
        """The recompute segments one forward of the stage ending before unit ``end_unit`` runs
        under checkpoint: all of them, but the last of an immediate forward when it ends the stage
        (``gems.pipeline.stage`` says why)."""
        segments = [list(seg) for seg in self.recompute]
        if not waiting and segments and segments[-1][1] == end_unit:
            segments.pop()
        return segments

    @property
    def kind(self) -> str:
        """"none", "recompute", "offload" or "recompute+offload", for tables."""
        parts = [name for name, on in (("recompute", bool(self.recompute)), ("offload", self.offload)) if on]
        return "+".join(parts) or "none"

    @property
    def label(self) -> str:
        """``kind`` with the recompute segments and the units they cover, e.g.
        "recompute x3 (12 units)+offload"."""
        units = sum(end - first for first, end in self.recompute)
        return self.kind.replace("recompute", f"recompute x{len(self.recompute)} ({units} unit{'s' * (units != 1)})")


@dataclass
class StageEstimate:
    """One stage = units [first_unit, end_unit). Activation and boundary bytes per micro-batch."""

    stage: int
    first_unit: int
    end_unit: int
    unit_names: list[str]
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    activation_bytes: int     # kept for backward per micro-batch in flight (input + saved + output), policy applied
    transient_bytes: int      # largest working memory of one unit's forward or backward
    input_bytes: int          # received per micro-batch (0 for stage 0: the data)
    output_bytes: int         # sent per micro-batch
    forward_flops: int
    backward_flops: int
    plain_activation_bytes: int = 0   # activation_bytes without the policy
    recompute_bytes: int = 0          # the largest recompute segment, rematerialised at a backward
    offload_bytes: int = 0            # sent to the host and back per micro-batch (waiting forwards only)
    extra_seconds: float = 0.0        # time the policy adds per step, over every position running the stage
    spatial_seconds: float = 0.0      # per micro-batch, forward + backward: a spatial part's halos and gather
    split_bytes: int = 0              # kept per micro-batch between the halves of a split backward: the
                                      # gradients the weight half starts from (gems.pipeline.splitgrad)
    sends: list[list[int]] = field(default_factory=list)   # [consumer stage, bytes] per message it sends per micro-batch
    # model state its placement keeps in host memory on each holder (optimizer state, the parameters' and the
    # gradient segment's host copies), and what goes between device and host per step, both ways together
    # (gems.partition.placement); 0 on the device
    host_state_bytes: int = 0
    swap_bytes: int = 0
    host_seconds: float = 0.0   # per step on each holder: the host update and the parameters' copy back
    group_bytes: list[int] = field(default_factory=list)   # "host": per weight group, parameter bytes per visit

    @property
    def static_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buffer_bytes


@dataclass
class PositionEstimate:
    """One position (rank in a group) for one training step."""

    position: int
    stages: list[int]                 # stages whose parameters it holds
    units: int
    param_bytes: int
    static_bytes: int                 # parameters + gradients + optimizer state + buffers
    in_flight: dict[int, int]         # stage -> micro-batches whose activations are alive at the peak
    activation_bytes: int             # then: sum over stages of in_flight * activation bytes, plus
                                      # split_bytes per micro-batch between the halves of a split backward
    transient_bytes: int              # then: working memory + what a policy brings back, of the stage computed
    peak_bytes: int                   # static + activations + transient + gradients + send
    flops: int                        # forward FLOPs per step (all micro-batches it runs)
    load: float                       # the balanced objective's value for this position
    plain_peak_bytes: int = 0         # peak_bytes without policies
    recompute_flops: int = 0          # forward FLOPs re-run per step by recomputation
    seconds: float = 0.0              # forward + backward + policies per step, at Plan.flops_per_second
    extra_seconds: float = 0.0        # of which the policies
    send_bytes: int = 0               # message buffers at most (in peak_bytes): receives posted ahead, packed
                                      # copies of activations still being sent
    member_peak_bytes: int = 0        # a tile group's other ranks' peak (0: not a tile group, or an older plan)
    received_bytes: list[int] = field(default_factory=list)   # pipeline message bytes each rank receives per
                                      # step: the leader's, then each tile group member's ([]: an older plan)
    gradient_bytes: int = 0           # then: gradients of its host-optimizer stages, which exist from a stage's
                                      # first backward to its copy out (not in static_bytes)


@dataclass
class Plan:
    """A partition of a model into stages, with estimates (see module docstring)."""

    # What it was made for.
    model_name: str
    input_shape: tuple[int, ...]          # per sample, e.g. (3, 2048, 2048)
    batch_size: int                       # images per optimizer step over the whole job
    groups: int                           # data-parallel groups
    stages: int                           # K
    schedule: str
    micro_batches: int                    # per replica per step
    balance_by: str
    optimizer: str
    dtype: str
    memory_budget: int | None
    micro_batch_size: int                 # batch_size / (groups * replicas * micro_batches)
    # The partition.
    cuts: list[int]                       # K+1 boundaries: stage s = units [cuts[s], cuts[s+1])
    unit_names: list[str]
    stage_output_shapes: list[list[tuple[int, ...]]]   # per stage, its output tuple, per sample
    stage_output_dtypes: list[list[str]]
    # Estimates.
    stage_estimates: list[StageEstimate]
    positions: list[PositionEstimate]
    load_unit: str                        # "B", "FLOP" or "s": the unit of PositionEstimate.load
    imbalance: float                      # max / mean of the positions' loads
    fits: bool | None = None              # None without a memory budget
    smallest_fitting_stages: int | None = None   # when it does not fit: the least K that would
    notes: list[str] = field(default_factory=list)
    policies: list[StagePolicy] = field(default_factory=list)   # per stage; empty = none everywhere
    device: str = "cuda"                  # where stages run: "cpu" gains nothing from offloading
    host_bandwidth: float | None = None   # bytes/s between device and host, for offloading
    flops_per_second: float | None = None   # sustained rate behind the seconds (measured times aside)
    # predicted step with the policies or a spatial part (gems.schedule.simulate, free network but for the
    # spatial part's halos); None with neither
    step_seconds: float | None = None
    plain_step_seconds: float | None = None   # the same without the policies (None without policies)
    amp: str = "none"                     # "bf16": forwards under autocast, activations priced at its sizes
    # Per rank on a GPU besides the tensors, by part (gems.partition.overhead): the CUDA context and
    # communicator buffers. Not in any *_bytes above; counted against memory_budget. Empty unless asked.
    device_overhead: dict[str, int] = field(default_factory=dict)
    # Per position, host memory that offload holds at its highest (the bound of the rank's pinned
    # pool, gems.pipeline.offload.HostPool); not in any *_bytes above. Empty unless offloading saves memory.
    host_bytes: list[int] = field(default_factory=list)
    # Per position, host memory that model state placed on the host holds (StageEstimate.host_state_bytes of its
    # stages); not in host_bytes nor in any *_bytes above. Empty when every stage's state is on the device.
    state_host_bytes: list[int] = field(default_factory=list)
    swap_bytes: list[list[int]] = field(default_factory=list)   # per position, model state [up, down] per step
    swap_grouped: bool = False   # "host" stages run each run of consecutive forwards (backwards) group-major
    # Module paths or class names traced whole (gems.graph.graph_units): the engine traces the
    # model with them too, so both see the same units.
    leaf_modules: list[str] = field(default_factory=list)
    # Per position, what a forward-only step (evaluation, prediction) holds at its highest beyond
    # static_bytes, at micro_batch_size rows (gems.partition.forward); it scales with the rows, see
    # forward_peak_bytes. Empty in plans written before it was priced.
    forward_bytes: list[int] = field(default_factory=list)
    # Per stage, per position of its input tuple: [stage that made the tensor, its position in that
    # stage's output, whether its gradient goes back], or [-1, -1, false] for a tensor the stage only
    # passes on (gems.graph.stage_routes; stage 0: []). Skip tensors go straight from maker to reader
    # (gems.pipeline.routes). Empty: every stage takes its neighbour's whole output (plain nn.Sequential).
    routes: list[list[list]] = field(default_factory=list)
    # Each backward split into an input-gradient and a later weight-gradient action
    # (gems.pipeline.splitgrad), and how the schedule search made the step's order.
    split_backward: bool = False
    order: str = ""
    # Each rank of a sync group updates its share of the parameters and keeps only their optimizer
    # state (gems.pipeline.gradsync.GradSync.optimized); the updated values are exchanged after the step.
    shard_optimizer: bool = False
    # Spatial part (gems.spatial): units [0, spatial_end) of stage 0 run on a tile group of
    # rows x cols ranks at every position holding stage 0, each rank one tile of every activation;
    # the boundary at spatial_end is gathered on the group's first rank, which runs the rest. Empty:
    # no spatial part. World = groups x (stages + (tiles - 1) x tile groups).
    # A suffix (spatial_start > 0, for models at full resolution again at their end: U-Nets): units
    # [spatial_start, end of the model) of the last stage on tile groups too, every position holding
    # the last stage then one of them (under mp/gpipe/1f1b with K >= 2: position K-1, P - 1 more
    # ranks); its inputs scattered from the leader, its outputs gathered.
    spatial_grid: list[int] = field(default_factory=list)
    spatial_end: int = 0
    spatial_start: int = 0
    # How stages hold 4-D tensors: "contiguous" (NCHW) or "channels_last" (NHWC); parameters,
    # activations, gradients and messages alike (gems.plan.formats). The profile prices each.
    memory_format: str = "contiguous"
    # Each unit compiled by torch.compile before the first step (gems.pipeline.compiled): a compiled
    # unit's backward is one autograd node, so such a stage's backward is never split.
    compiled: bool = False

    def __post_init__(self) -> None:
        if not self.policies:
            self.policies = [StagePolicy() for _ in range(self.stages)]

    @property
    def tiles(self) -> int:
        """P: ranks per tile group (1 without a spatial part)."""
        return self.spatial_grid[0] * self.spatial_grid[1] if self.spatial_grid else 1

    @property
    def tiled_stages(self) -> tuple[int, ...]:
        """Stages with tiled units: 0 with a spatial part, and the last with a suffix."""
        if not self.spatial_grid:
            return ()
        return (0, self.stages - 1) if self.spatial_start and self.stages > 1 else (0,)

    @property
    def balance(self) -> list[int]:
        """Units per stage."""
        return [b - a for a, b in zip(self.cuts, self.cuts[1:])]

    @property
    def peak_bytes(self) -> int:
        """The largest estimated peak over positions."""
        return max(p.peak_bytes for p in self.positions)

    @property
    def overhead_bytes(self) -> int:
        """``device_overhead`` in all: what a rank holds on its GPU besides tensors."""
        return sum(self.device_overhead.values())

    def forward_peak_bytes(self, position: int, batch_size: int) -> int | None:
        """A position's estimated peak in a forward-only step on global batches of ``batch_size``
        images (``Engine.evaluate``/``predict``): its static memory plus ``forward_bytes`` scaled
        to that batch's micro-batches. None when the plan has no forward figures."""
        if not self.forward_bytes:
            return None
        # micro-batch rows scale with the batch: batch_size / batch_size of the plan
        return self.positions[position].static_bytes + -(-self.forward_bytes[position] * batch_size
                                                         // self.batch_size)

    def forward_worst(self, batch_size: int) -> tuple[int, int] | None:
        """(bytes, position) of the highest ``forward_peak_bytes`` over positions; None without figures."""
        if not self.forward_bytes:
            return None
        return max((self.forward_peak_bytes(p, batch_size), p) for p in range(self.stages))

    # -- JSON ------------------------------------------------------------------------
    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The plan as JSON text; also written to ``path`` when given. Fields added since plans were
        first written are left out while they hold their defaults, so such a plan reads as before."""
        from gems.plan.json_io import write  # noqa: PLC0415 - kept out of the types' import

        return write(self, path)

    @classmethod
    def from_json(cls, path_or_text: str | os.PathLike) -> Plan:
        """A plan from JSON text or from a file holding it."""
        from gems.plan.json_io import read  # noqa: PLC0415 - kept out of the types' import

        return read(cls, path_or_text)

    def check(self) -> None:
        """Raise GemsError unless the plan describes a layout training can run (``gems.plan.checks``):
        its cuts split the units into ``stages`` non-empty stages, one estimate and policy per stage."""
        from gems.plan.checks import check  # noqa: PLC0415 - kept out of the types' import

        check(self, MEMORY_FORMATS, STATE_PLACEMENTS)

    # -- people ----------------------------------------------------------------------
    def table(self) -> str:
        """A human summary: inputs, one row per stage and per position, the messages, the budget
        (``gems.plan.text``)."""
        from gems.plan.text import table  # noqa: PLC0415 - kept out of the types' import

        return table(self)
