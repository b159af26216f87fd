"""gems.partition: profile a model at the real input size and cut it into balanced stages.

    >>> from gems.partition import plan
    >>> p = plan(model, (3, 2048, 2048), batch_size=2, stages=4, schedule="mast", memory_budget="40GiB")
    >>> print(p.table()); p.to_json("plan.json")

Modules, in the order of the flow (each imports only from its own step or earlier ones):

* measure once: ``profile`` (the fake-tensor run at the real size; ``tracking``: its storage
  keys and allocation log) fills ``records`` (per unit: parameters, saved activations, FLOPs;
  the storages; activation and working memory of any segment of units);
* price: ``options`` (the user-facing policy options: modes, kinds, host bandwidth),
  ``policy`` (what recompute / offload keep and cost for one stage; ``segments``: its exact
  recompute segmentation), ``costs`` (memory / time / FLOPs of a stage on a position under a
  schedule, as matrices over segments), ``placement`` (model state in host memory: the optimizer,
  ``host-optimizer``) and ``swapping`` (the parameters too, per weight group: ``host``);
* solve: ``solver`` (exact min-max cuts: ``loads``, the costs and each position's load;
  ``plain`` and ``mirrored``, the DPs of either placement), ``budget`` (the cheapest
  policies within a memory budget, the smallest stage count that fits);
* assemble: ``planner`` (``plan()``: validation and choosing), ``job`` (one candidate's shared
  inputs, and its estimates assembled into a Plan), ``backward`` (with
  ``split_backward`` None: the plan with the backward split or without, whichever is faster and fits).

Besides: ``sweep`` (every layout on a number of ranks planned and ranked, tile groups included:
``gems-plan --sweep``), ``measure`` (optional real timings per unit), ``accuracy`` (the profile against
real CPU runs), ``calibrate`` (this device's sustained FLOP/s and host link, and the host's optimizer
updates, for ``gems-plan --calibrate``), ``overhead`` (what a rank holds on a GPU besides tensors). The Plan
dataclasses and their JSON live in ``gems.plan``.

Note: the name ``plan`` in this package is the function; the dataclass module is
``gems.partition.plan`` only through ``from gems.plan import ...``.
"""
from .measure import measure_times
from gems.plan import Plan, PositionEstimate, StageEstimate, StagePolicy
from .records import ModelProfile, UnitProfile
from .profile import OPTIMIZER_STATE, profile
from .costs import BALANCE_BY, CostModel
from .solver import Solution, cuts_from_balance, solve
from .planner import plan

__all__ = ["plan", "Plan", "StageEstimate", "PositionEstimate", "StagePolicy", "profile", "ModelProfile", "UnitProfile",
           "measure_times", "solve", "Solution", "cuts_from_balance", "CostModel", "BALANCE_BY", "OPTIMIZER_STATE"]
