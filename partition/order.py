"""The plan's order of compute: the schedule search's candidates replayed on the plan's own stage costs.

The schedule search (``gems.schedule.search``) ranks its candidate orders in ticks, every stage
costing alike, so that every rank can derive an order from (schedule, K, m) alone. Planned stages
seldom cost alike: cuts balanced by memory (the default) give the stage of the last, small
activations most of the FLOPs, and a spatial part or a memory policy adds time to some stages
only. Under ``mast`` another of the qualified orders (each within the search's memory bound) is
then sometimes faster: a chain of equal units cut 1, 2 and 5 under mast K = 3, m = 2, split
backward, by 21%; resnet50 at 1024^2, K = 4, m = 4, split, cut by memory, by 0.8% (582.0 against
577.6 ms with the network free; 651.8 against 618.5, -5.1%, with ``gems-sim``'s default network,
which the planner does not assume).

So the planner list-schedules every candidate a second time with the stages' weights (their costs
relative to the cheapest, ``search.weights_of``; an order the search on equal ticks cannot make),
replays every qualified order of both with the plan's stage costs (the simulator, network not
counted, as ``Plan.step_seconds``), estimates the plan again under the fastest -- the order decides
which micro-batches are alive together, so memory changes with it -- and keeps it when it is
shorter by more than ``TIE`` and fits the budget wherever the search's order does; its name
(weights included) goes into ``Plan.order``, from which the engine, the simulator and the memory
model all build it. Chain of 1, 1, 2 and 4 equal units, mast K = 4, m = 2, split: 4.8% shorter
than the search's order, in a weighted one. Simulated over 30 draws of stage costs from 0.5 to 2
(split): the best order on equal weights gains a median 1.2% (K = 4, m = 4; at most 3.5%) and 0.0%
(K = 8, m = 4; at most 1.7%), with weighted orders too 2.5% (at most 9.2%) and 1.4% (at most 10.5%).
"""
from __future__ import annotations

from collections.abc import Callable

from gems.plan import Plan
from gems.schedule import search
from gems.schedule.simulate import costs_from_plan
from gems.units import format_ms
from .backward import TIE, predicted_step


def fastest_order(plan: Plan, reordered: Callable[[str], Plan]) -> Plan:
    """``plan``, or ``reordered(order)``: the same cuts and policies estimated under another order of
    the schedule search, when that is faster on the plan's stage costs and fits as well (module
    docstring; where neither fits, when it needs no more memory), with a note saying so."""
    timed = costs_from_plan(plan, plan.flops_per_second, 1.0)
    weights = search.weights_of([f + b for f, b in zip(timed.forward, timed.backward)])
    layout = (plan.schedule, plan.stages, plan.micro_batches, plan.split_backward)
    found = search.qualified(*layout) + (search.qualified(*layout, weights) if weights else ())
    if len(found) < 2:
        return plan
    now = predicted_step(plan, timed)
    ranked = sorted((predicted_step(plan, timed, str(v)), i, str(v)) for i, (_, v) in enumerate(found)
                    if str(v) != plan.order)
    for seconds, _, order in ranked:
        if seconds >= now * (1 - TIE):
            break
        other = reordered(order)
        faster = predicted_step(other)   # its policies' time under this order counted too
        fits = other.fits is not False or (plan.fits is False and _peak(other) <= _peak(plan))
        if faster < now * (1 - TIE) and fits:
            other.notes = [*plan.notes, f"order {order}, not the schedule search's {plan.order}: on this plan's "
                           f"stage costs its step is {1 - faster / now:.1%} shorter ({format_ms(faster)} against "
                           f"{format_ms(now)}, network not counted)"]
            return other
    return plan


def _peak(plan: Plan) -> int:
    return max(p.peak_bytes for p in plan.positions)
