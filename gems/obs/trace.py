"""Timeline traces of training steps: a Chrome/Perfetto JSON file and, optionally, a PNG.

Every rank keeps its engine's per-action timelines (``Engine.timeline()``) for the steps it
is asked to record; ``Recorder.write`` gathers them to rank 0, which writes

- a trace in the Chrome trace-event format (open it in https://ui.perfetto.dev or
  chrome://tracing): one row per rank, named "rank R (group d, position r)", one slice per
  action ("forward d0.s1" = forward of replica down, micro-batch 0, stage 1), with the
  replica, micro-batch, stage and peer position in the slice's arguments;
- a picture of the same timeline (matplotlib, the optional ``plot`` extra), coloured by what
  a rank does -- compute, waiting for a message, syncing -- so the bubbles show as gaps::

      rank 0 |F d0.s0|F u0.s1|B u0.s1 ......|B d0.s0 ......|sync|
      rank 1 |F u0.s0|F d0.s1|B d0.s1 ......|B u0.s0 ......|sync|

Ranks are lined up by the wall-clock time at which each step started on each rank
(``engine.timer.started``), so on one node they line up exactly; across nodes, up to the
nodes' clock offset.
"""
from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from gems.errors import GemsError
from gems.schedule import generators as sch

BUSY = sch.COMPUTE + (sch.STEP, sch.ZERO)   # what counts as a rank doing useful work
# What a slice's colour says; recv_* slices are the time spent waiting for a message.
KINDS = {sch.FORWARD: "forward", sch.BACKWARD: "backward", sch.BACKWARD_INPUT: "backward",
         sch.BACKWARD_WEIGHT: "backward", sch.RECV_ACT: "recv wait", sch.RECV_GRAD: "recv wait",
         sch.SEND_ACT: "send", sch.SEND_GRAD: "send", sch.REDUCE: "sync", sch.SYNC: "sync", sch.STEP: "optimizer",
         sch.SHARE: "sync", sch.ZERO: "optimizer"}
# A tile group's waits (gems.spatial.tiles.TileGroup.timer), inside the forward and backward that make
# them: "halo layer1.0.conv1", "stats-grad layer1.0.bn1", "gather" -- drawn over their action.
TILE_KINDS = {"halo": "halo wait", "stats": "statistics wait", "sum": "statistics wait", "gather": "gather wait",
              "scatter": "gather wait"}
KINDS.update({f"{word}{grad}": k for word, k in TILE_KINDS.items() for grad in ("", "-grad")})
# The host tier's work (--state-placement; gems.pipeline.hostopt.HostTier.timer), inside the action that
# does it: "copy-out s1", "copy-back", "weights-in g2", "grads-out", "host-update" -- drawn over it too.
HOST_KINDS = {"copy-out": "host copy", "copy-back": "host copy", "weights-in": "host copy", "grads-out": "host copy",
              "host-update": "host update"}
KINDS.update(HOST_KINDS)
INSIDE = set(TILE_KINDS.values()) | set(HOST_KINDS.values())   # kinds of spans inside an action's
COLOURS = {"forward": "#4c72b0", "backward": "#55a868", "recv wait": "#c44e52", "send": "#8c8c8c",
           "sync": "#8172b2", "optimizer": "#ccb974", "halo wait": "#dd8452", "statistics wait": "#da8bc3",
           "gather wait": "#937860", "host copy": "#64b5cd", "host update": "#e5ae38"}
_LABEL = re.compile(r"^(?P<op>\w+) (?P<replica>[du])(?P<micro>\d+)\.s(?P<stage>\d+)(?:[<>]s(?P<other>\d+))?"
                    r"(?: @(?P<peer>\d+))?$")

Span = tuple[str, float, float]   # (label, start s, end s) from the step's start, as Engine.timeline()


def parse(label: str) -> dict:
    """The parts of an action label: op, and for per-micro-batch actions replica ("down"/"up"),
    micro, stage and (messages) peer position, and the stage at the other end of a skip edge."""
    match = _LABEL.match(label)
    if match is None:   # sync, step, or "reduce s1"
        op, _, stage = label.partition(" s")
        return {"op": op, "stage": int(stage)} if stage.isdigit() else {"op": label}
    parts: dict = {"op": match["op"], "replica": "down" if match["replica"] == "d" else "up",
                   "micro": int(match["micro"]), "stage": int(match["stage"])}
    for part in ("other", "peer"):
        if match[part] is not None:
            parts[part] = int(match[part])
    return parts


def kind(label: str) -> str:
    """What the action is, for colours and sums: forward, backward, recv wait, send, sync, optimizer;
    or work inside one: a tile group's halo wait, statistics wait, gather wait; the host tier's host
    copy, host update."""
    return KINDS.get(label.split(" ", 1)[0], "other")


def busy_seconds(spans: list[Span]) -> float:
    """Seconds of forward, backward and optimizer work in one step's timeline."""
    return sum(end - start for label, start, end in spans if label.split(" ", 1)[0] in BUSY)


@dataclass
class StepTimeline:
    step: int
    started: float          # wall clock (time.time()) at the step's start on this rank
    spans: list[Span]


@dataclass
class RankTimeline:
    rank: int
    group: int
    position: int
    steps: list[StepTimeline] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"rank {self.rank} (group {self.group}, position {self.position})"


class Recorder:
    """Keeps this rank's engine timelines of the last ``keep`` recorded steps (None: all).

    Call ``record(step)`` right after ``engine.step``; reading the timeline costs nothing on
    CPU and one device synchronisation on CUDA.
    """

    def __init__(self, engine, keep: int | None = 3) -> None:
        self.engine, self.keep = engine, keep
        self.timeline = RankTimeline(engine.comm.rank, engine.group, engine.position)

    def record(self, step: int) -> None:
        steps = self.timeline.steps
        steps.append(StepTimeline(step, self.engine.timer.started, list(self.engine.timeline())))
        if self.keep is not None and len(steps) > self.keep:
            del steps[0]

    def gather(self, comm) -> list[RankTimeline]:
        """COLLECTIVE: every rank's timeline, in rank order (on every rank)."""
        return comm.allgather_object(self.timeline)

    def write(self, comm, json_path: str | Path | None, png_path: str | Path | None = None,
              metadata: dict | None = None) -> None:
        """COLLECTIVE: gather to rank 0, which writes the trace and/or the picture."""
        ranks = self.gather(comm)
        if comm.rank != 0:
            return
        if json_path:
            write_json(json_path, ranks, metadata)
        if png_path:
            write_png(png_path, ranks, heading=title(metadata))


def _origin(ranks: list[RankTimeline]) -> float:
    return min((s.started for r in ranks for s in r.steps), default=0.0)


def chrome_trace(ranks: list[RankTimeline], metadata: dict | None = None) -> dict:
    """The trace-event JSON object: metadata events naming each rank's row, then one complete
    ("X") event per action, in microseconds from the earliest recorded step start."""
    origin = _origin(ranks)
    events: list[dict] = []
    for r in ranks:
        events.append({"ph": "M", "name": "process_name", "pid": r.rank, "tid": 0, "args": {"name": r.name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r.rank, "tid": 0,
                       "args": {"sort_index": r.rank}})
        events.append({"ph": "M", "name": "thread_name", "pid": r.rank, "tid": 0, "args": {"name": "actions"}})
    for r in ranks:
        for step in r.steps:
            offset = step.started - origin
            for label, start, end in step.spans:
                args = {"step": step.step, **{k: v for k, v in parse(label).items() if k != "op"}}
                events.append({"ph": "X", "name": label, "cat": kind(label), "pid": r.rank, "tid": 0,
                               "ts": round((offset + start) * 1e6, 3),
                               "dur": round(max(0.0, end - start) * 1e6, 3), "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}


def write_json(path: str | Path, ranks: list[RankTimeline], metadata: dict | None = None) -> None:
    Path(path).write_text(json.dumps(chrome_trace(ranks, metadata)), encoding="utf-8")


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def require_matplotlib(flag: str = "--trace-png", what: str = "a timeline") -> None:
    """GemsError unless matplotlib can be imported (checked before a run, not after it)."""
    if not have_matplotlib():
        raise GemsError(f"drawing {what} needs matplotlib: pip install 'gems[plot]' (or matplotlib), or drop {flag}")


def idle_fraction(ranks: list[RankTimeline]) -> float:
    """1 - busy / (ranks x wall time) over the recorded steps; a step's wall time runs from its
    first start to its last action's end on any rank."""
    busy, wall = 0.0, 0.0
    for number in {s.step for r in ranks for s in r.steps}:
        steps = [s for r in ranks for s in r.steps if s.step == number]
        busy += sum(busy_seconds(s.spans) for s in steps)
        wall += (max(s.started + max((b for _, _, b in s.spans), default=0.0) for s in steps)
                 - min(s.started for s in steps))
    return 1.0 - busy / (len(ranks) * wall) if wall > 0 else 0.0


def _short(label: str) -> str:
    """"forward d0.s1 ..." -> "F d0.s1" (what fits inside a slice)."""
    parts = label.split(" ")
    return f"{parts[0][0].upper()} {parts[1]}" if len(parts) > 1 and parts[0] in sch.COMPUTE else ""


def title(metadata: dict | None) -> str:
    """"key value, key value" of a trace's metadata, for a picture's title."""
    if not metadata:
        return ""
    return ", ".join(f"{k} {v}" for k, v in metadata.items() if isinstance(v, (str, int, float)))


def write_png(path: str | Path, ranks: list[RankTimeline], heading: str = "") -> None:
    """Draw the timelines, one row per rank, with the share of rank-time spent idle in the title."""
    require_matplotlib()
    import matplotlib  # noqa: PLC0415 - an optional extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.7 * len(ranks)))
    draw_timelines(ax, ranks, heading)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def draw_timelines(ax, ranks: list[RankTimeline], heading: str = "") -> None:
    """The timelines on matplotlib axes ``ax``: one row per rank, slices coloured by ``kind``, the
    idle share in the title, the colours' legend below (``write_png``, and the plan's picture)."""
    from matplotlib.patches import Patch  # noqa: PLC0415 - an optional extra

    origin = _origin(ranks)
    spans = [(r, (s.started - origin) + a, (s.started - origin) + b, label)
             for r in ranks for s in r.steps for label, a, b in s.spans]
    spans.sort(key=lambda span: kind(span[3]) in INSIDE)   # over the action they are part of
    first = min((a for _, a, _, _ in spans), default=0.0)
    last = max((b for _, _, b, _ in spans), default=1.0)
    width = max(last - first, 1e-9)
    for r, a, b, label in spans:
        y = len(ranks) - 1 - ranks.index(r)
        ax.broken_barh([(a, b - a)], (y - 0.4, 0.8), facecolors=COLOURS.get(kind(label), "#dddddd"),
                       edgecolor="white", linewidth=0.3)
        text = _short(label)
        if text and (b - a) > 0.04 * width:
            ax.text((a + b) / 2, y, text, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([r.name for r in reversed(ranks)], fontsize=8)
    ax.set_xlim(first, last)
    ax.set_xlabel("seconds")
    idle = idle_fraction(ranks)
    ax.set_title(f"{heading}{'  |  ' if heading else ''}idle {idle:.0%} of rank-time "
                 "(not forward, backward or optimizer)", fontsize=9)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
