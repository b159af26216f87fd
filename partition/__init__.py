"""gems.partition: profile a model at the real input size and cut it into balanced stages.

    >>> from gems.partition import plan
    >>> p = plan(model, (3, 2048, 2048), batch_size=2, stages=4, schedule="mast", memory_budget="40GiB")
    >>> print(p.table()); p.to_json("plan.json")

Modules: ``profile`` (fake-tensor run: parameters, saved activations, FLOPs per unit),
``costs`` (memory / time / FLOPs of a stage on a position under a schedule), ``solver``
(exact min-max cuts, plain or mirrored), ``plan`` (the Plan dataclass and its JSON),
``planner`` (``plan()``: validation and assembly), ``measure`` (optional real timings).

Note: the name ``plan`` in this package is the function; the dataclass module is
``gems.partition.plan`` only through ``from gems.plan import ...``.
"""
from .measure import measure_times
from gems.plan import Plan, PositionEstimate, StageEstimate, StagePolicy
from .profile import OPTIMIZER_STATE, ModelProfile, UnitProfile, profile
from .costs import BALANCE_BY, CostModel
from .solver import Solution, cuts_from_balance, solve
from .planner import plan

__all__ = ["plan", "Plan", "StageEstimate", "PositionEstimate", "StagePolicy", "profile", "ModelProfile", "UnitProfile",
           "measure_times", "solve", "Solution", "cuts_from_balance", "CostModel", "BALANCE_BY", "OPTIMIZER_STATE"]
