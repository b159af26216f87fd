"""A plan as a picture (``--plan-png`` of gems-plan and gems-train): where each position's memory
goes, and how one step's time is spent.

(a) Per position, a stacked bar of its estimated peak: parameters (with buffers), gradients,
    optimizer state, kept activations, messages in flight and working memory, with the memory
    budget as a line when the plan has one.
(b) The simulator's replay of one step (``gems.schedule.simulate``, at the plan's own rate), one
    row per position of group 0, coloured like ``--trace-png``'s timelines.

matplotlib is the optional ``plot`` extra: ``require_matplotlib("--plan-png", ...)`` says so
before any work.
"""
from __future__ import annotations

from pathlib import Path

from gems.obs.trace import RankTimeline, StepTimeline, draw_timelines, require_matplotlib
from gems.schedule import generators as sch
from gems.schedule.simulate import simulate_plan

# The parts of a position's peak, bottom to top, and their colours.
PARTS = {"parameters": "#4c72b0", "gradients": "#55a868", "optimizer state": "#ccb974",
         "activations": "#c44e52", "messages": "#8c8c8c", "working memory": "#8172b2"}


def memory_parts(plan) -> list[dict[str, int]]:
    """Per position, the bytes of each of ``PARTS``, summing to its estimated peak. The static part
    splits as its stages' estimates do (optimizer state: what sharding leaves of it); messages are the
    position's send and receive buffers; working memory the rest of the peak."""
    found = []
    for position, est in enumerate(plan.positions):
        held = [plan.stage_estimates[s] for s in sch.holds(plan.schedule, plan.stages, position)]
        params = sum(s.param_bytes + s.buffer_bytes for s in held)
        grads = sum(s.grad_bytes for s in held)
        optimizer = max(0, est.static_bytes - params - grads)
        messages = est.send_bytes
        working = max(0, est.peak_bytes - est.static_bytes - est.activation_bytes - messages)
        found.append({"parameters": params, "gradients": grads, "optimizer state": optimizer,
                      "activations": est.activation_bytes, "messages": messages, "working memory": working})
    return found


def step_timelines(plan) -> list[RankTimeline]:
    """The simulator's one step of the plan, per position of group 0, as timelines ``draw_timelines``
    reads: a wait for a message becomes the receive's slice, as the engine records it."""
    rate = plan.flops_per_second   # sustained already; a plan of measured times has none: the default device
    result = simulate_plan(plan, device_flops=rate, efficiency=1.0) if rate else simulate_plan(plan)
    return [RankTimeline(p, 0, p, [StepTimeline(1, 0.0, [(label.removeprefix("wait "), a, b)
                                                         for a, b, label in spans])])
            for p, spans in enumerate(result.timeline)]


def write_plan_png(path: str | Path, plan) -> None:
    """Draw (a) and (b) of the module docstring into one PNG."""
    import matplotlib.pyplot as plt  # noqa: PLC0415 - an optional extra, checked by figure()

    fig = figure(plan)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def figure(plan):
    """The matplotlib figure of (a) above (b): its first axes hold one bar per position for each of
    ``PARTS`` and the budget's line, its second the timelines."""
    require_matplotlib("--plan-png", "a plan")
    import matplotlib  # noqa: PLC0415 - an optional extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    parts = memory_parts(plan)
    K = len(parts)
    fig, (bars, times) = plt.subplots(2, 1, figsize=(12, 5.5 + 0.6 * K),
                                      gridspec_kw={"height_ratios": [3, 1 + 0.4 * K]})
    gib = 2.0 ** 30
    bottom = [0.0] * K
    for name, colour in PARTS.items():
        heights = [p[name] / gib for p in parts]
        bars.bar(range(K), heights, bottom=bottom, color=colour, label=name, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    if plan.memory_budget:
        bars.axhline(plan.memory_budget / gib, color="black", linestyle="--", linewidth=1.2,
                     label=f"budget {plan.memory_budget / gib:.2f} GiB")
    bars.set_xticks(range(K))
    bars.set_xticklabels([f"position {p}\nstages {', '.join(map(str, sch.holds(plan.schedule, plan.stages, p)))}"
                          for p in range(K)], fontsize=8)
    bars.set_ylabel("GiB")
    shape = "x".join(map(str, plan.input_shape))
    bars.set_title(f"{plan.model_name}, input {shape}, batch {plan.batch_size}, {plan.schedule} K={plan.stages} "
                   f"m={plan.micro_batches}: estimated peak per position", fontsize=10)
    bars.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    draw_timelines(times, step_timelines(plan), heading="one step, simulated")
    fig.tight_layout()
    return fig
