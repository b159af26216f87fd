"""The graph front-end: any ``nn.Module`` as a chain of units the planner may cut between.

    units = graph_units(torchvision.models.resnet50(), input_shape=(3, 2048, 2048), batch=1)
    units.unit_names[:3]     # ['conv1', 'bn1', 'relu']
    units(images)            # the model's own forward, unit after unit

``torch.fx`` traces the model's forward symbolically with its usual leaves (the modules of
``torch.nn``, plus ``leaf_modules`` the caller names); one propagation on fake tensors at the
plan's micro-batch shape (nothing allocated, no real forward) gives every value of the graph.
Where fx cannot trace the forward, ``torch.export`` does, and its ATen ops are grouped back into
the calls of the same leaf modules (``gems.graph.export``). An ``nn.Sequential`` is not traced:
its children are its units, its graph is written down (``gems.graph.chain``). Then:

* values that are not tensors -- sizes, ``x.shape[2:]``, counts -- become constants of the plan
  (shapes are static for a plan: batch and image size fixed), so no cut ever has to carry one;
* a tuple of tensors that a consumer takes whole is taken apart where it is made and rebuilt
  before that consumer, so its tensors may cross boundaries one by one;
* the nodes, in the traced (topological) order, are grouped into units: a node starts a new unit
  unless a value that is not a tensor (a nested tuple, a dtype) would cross the boundary before
  it, so every boundary between units is one the planner may cut;
* each unit becomes a small ``GraphModule`` that takes the tensors alive before it and returns
  the tensors alive after it (its own results and the ones it passes on). The result is an
  ``nn.Sequential`` of those units (``GraphUnits``): what the planner profiles and the engine
  runs, unchanged, for any model.

A tensor produced early and used much later (a U-Net's skip connection) is part of every unit
boundary between its producer and its consumer; each unit records which of its inputs it reads
(``READS``), so that a stage receives only those, straight from the stage that made them
(``stage_routes``). The units' parameters are the
model's own (shared, not copied) and keep their names: a unit's state-dict key ``7.layer1.0.conv1.weight``
is the model's ``layer1.0.conv1.weight`` (``model_key``).

Why not ``torch.fx.passes.split_module``: it splits at fixed partitions, while the planner needs
every possible cut priced first; units with explicit live sets give exactly that. The module sits
below both the planner (which prices the units) and the runtime (which runs them): the two must
build the same chain from the same model and plan shape.
"""
from __future__ import annotations

import difflib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from torch import fx, nn

from gems.errors import GemsError
from .chain import chain_graph, input_error
from .export import Together, export_graph
from .routes import UNREAD, stage_routes
from .split import INPLACE_INPUTS, READS, fold_constants, split, unpack_tuples, writes_inputs
from .trace import TRACING, VALUE, Tracer, untraceable

__all__ = ["GraphUnits", "graph_units", "balance_at", "check_tied", "stage_routes", "input_error", "writes_inputs",
           "INPLACE_INPUTS",
           "READS", "UNREAD"]


class GraphUnits(nn.Sequential):
    """The units of a traced model, in order; ``unit_names`` are module paths of the model
    (``encoder.layer3.2.conv1``; a function between modules is named after the module whose
    forward calls it, plus the function: ``layer1.0:add``)."""

    def __init__(self, units: Sequence[nn.Module], names: Sequence[str], model: nn.Module) -> None:
        super().__init__(*units)
        self.unit_names = list(names)
        state = model.state_dict()
        self.model_keys = list(state)   # the model's own state-dict keys, in its order
        used = {self.model_key(k) for k in self.state_dict()}
        # what no unit uses (an unused head, say): not trained, kept so state dicts stay whole
        self.extras = {k: v for k, v in state.items() if k not in used}

    def __getitem__(self, idx):
        """A unit, or a slice as a plain ``nn.Sequential`` that keeps the units' numbers (so a
        stage's state-dict keys still map back through ``model_key``)."""
        if isinstance(idx, slice):
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)

    def model_key(self, key: str) -> str:
        """The model's own state-dict key for one of this chain's keys ("7.layer1.0.conv1.weight")."""
        return key.split(".", 1)[1]


def graph_units(model: nn.Module, input_shape: Sequence[int], batch: int,
                leaf_modules: Iterable[type[nn.Module] | str] = (), tracer: str = "auto",
                model_name: str | None = None) -> GraphUnits:
    """``model`` as ``GraphUnits`` for inputs of ``batch`` x ``input_shape`` (see module docstring).

    ``leaf_modules``: module classes, class names or module paths traced as one call (never cut
    inside). ``tracer``: "fx", "export", or "auto" (an ``nn.Sequential``'s children are its units,
    as written (``gems.graph.chain``); any other module by fx, and by torch.export where fx cannot).
    GemsError naming the offending line and the fix when the forward cannot be traced.
    ``torch.fx`` patches ``nn.Module`` process-wide while it traces: trace before starting other
    threads that run models (one trace at a time is enforced).
    """
    if tracer not in ("auto", "fx", "export"):
        raise GemsError(f"tracer must be auto, fx or export, not {tracer!r}")
    shape = (batch, *input_shape)
    together: Together = {}
    first: Exception | None = None
    if isinstance(model, nn.Sequential) and tracer == "auto":   # its children are its units
        with TRACING:
            gm, values = chain_graph(model, shape, model_name)
        return GraphUnits(*_units(gm, values, together), model)
    fx_tracer = Tracer(model, tuple(leaf_modules))
    if tracer != "export":
        try:
            with TRACING:
                graph = fx_tracer.trace(model, shape)
            gm = fx.GraphModule(fx_tracer.root, graph, type(model).__name__)
            values = {n: n.meta[VALUE] for n in gm.graph.nodes if VALUE in n.meta}
        except GemsError:
            raise
        except Exception as exc:  # noqa: BLE001 -- fx cannot: torch.export may
            if tracer == "fx":
                raise GemsError(untraceable(model, exc)) from None
            first = exc
    if tracer == "export" or first is not None:
        try:
            with TRACING:
                gm, values, together = export_graph(model, shape, fx_tracer.is_leaf_module)
        except GemsError:
            raise
        except Exception as second:  # noqa: BLE001 -- neither can: one sentence
            raise GemsError(untraceable(model, first or second, second if first else None)) from None
    return GraphUnits(*_units(gm, values, together), model)


def _units(gm: fx.GraphModule, values: dict, together: Together) -> tuple[list[fx.GraphModule], list[str]]:
    """The units of a model's graph, whichever way it was made, and their names."""
    fold_constants(gm.graph, values)
    unpack_tuples(gm.graph, values)
    return split(gm, values, together)


def check_tied(units: nn.Sequential, cuts: Sequence[int]) -> None:
    """GemsError if a parameter is used by units of two stages (tied weights cut apart): each
    stage would train its own copy. Keep such units in one stage (split points, or the plan)."""
    owner: dict[int, tuple[int, str]] = {}
    for s in range(len(cuts) - 1):
        for i in range(cuts[s], cuts[s + 1]):
            for name, p in units[i].named_parameters():
                first = owner.setdefault(id(p), (s, name))
                if first[0] != s:
                    raise GemsError(f"parameter {name} is used in stage {first[0]} and stage {s}: tied weights "
                                    f"must stay in one stage; cut elsewhere (e.g. --split-points)")


def balance_at(unit_names: Sequence[str], split_points: Sequence[str], stages: int) -> list[int]:
    """Units per stage when stage s+1 begins at the first unit inside module ``split_points[s]``
    (a unit is inside "encoder.layer3" when its name is that path or starts with it and "." or
    ":"). GemsError for a point that names no unit, points out of order, or the wrong count."""
    points = list(split_points)
    if len(points) != stages - 1:
        raise GemsError(f"{stages} stages need {stages - 1} split points, got {len(points)}: {points}")
    starts = [0]
    for point in points:
        inside = [i for i, name in enumerate(unit_names)
                  if name == point or name.startswith((point + ".", point + ":", point + "#"))]
        if not inside:
            close = difflib.get_close_matches(point, sorted({n.split(":")[0] for n in unit_names}), 3)
            raise GemsError(f"split point {point!r} names no module of the model"
                            + (f"; did you mean {', '.join(close)}?" if close else ""))
        if inside[0] <= starts[-1]:
            raise GemsError(f"split point {point!r} does not come after the previous one: give the split points "
                            f"in the order of the forward")
        starts.append(inside[0])
    return [b - a for a, b in zip(starts, [*starts[1:], len(unit_names)])]
