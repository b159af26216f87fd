"""The layering of ARCHITECTURE.md, checked from the source (every import statement, lazy ones too).

    gems.cli                      command-line tools: parsing and messages
    gems.bench                    the benchmark runner (drives an Engine)
    gems.train                    the training application
    gems.partition                the planner (may use the pure schedule IR and the simulator)
    gems.obs                      measuring: memory meters, traces
    gems.pipeline                 the runtime
    gems.spatial                  tiles of one image across ranks (the runtime's spatial part)
    gems.comm                     transports
    gems.models                   model builders
    gems.graph                    any model as a chain of units (what the planner prices and the runtime runs)
    gems.plan                     the plan types the runtime reads
    gems.errors, gems.units       the base

Each layer may import only the layers its row allows; no import cycles between files or
between these packages; no library module imports the CLI; the pure schedule modules import
no torch; only gems.comm imports mpi4py or torch.distributed; no module over 400 lines, and
the engine's under 300.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"gems": "gems", "partition": "gems.partition", "models": "gems.models"}
BASE = {"gems.errors", "gems.units"}
ALLOWED = {
    "gems.errors": set(),
    "gems.units": {"gems.errors"},
    "gems.plan": BASE,
    "gems.graph": BASE,
    "gems.models": BASE,
    "gems.comm": BASE,
    "gems.spatial": BASE | {"gems.plan", "gems.graph", "gems.comm"},
    "gems.pipeline": BASE | {"gems.plan", "gems.graph", "gems.comm", "gems.spatial"},
    "gems.obs": BASE | {"gems.plan", "gems.pipeline"},
    "gems.partition": BASE | {"gems.plan", "gems.graph", "gems.models", "gems.pipeline", "gems.obs", "gems.spatial"},
    "gems.train": BASE | {"gems.plan", "gems.graph", "gems.models", "gems.comm", "gems.pipeline", "gems.obs",
                          "gems.partition", "gems.spatial"},
    "gems.bench": BASE | {"gems.plan", "gems.graph", "gems.models", "gems.comm", "gems.pipeline", "gems.obs",
                          "gems.partition", "gems.train", "gems.spatial"},
    "gems.cli": BASE | {"gems.plan", "gems.graph", "gems.models", "gems.comm", "gems.pipeline", "gems.obs",
                        "gems.partition", "gems.train", "gems.bench", "gems.spatial"},
}
# The planner may use the pipeline's pure parts only (never the executor or the engine).
PURE = {"gems.pipeline.ir", "gems.pipeline.schedule", "gems.pipeline.validate",   # schedule modules: no torch
        "gems.pipeline.simulate", "gems.pipeline.topology", "gems.pipeline.posting", "gems.pipeline.search"}
# and the message layouts, so the planner prices the very buffers the runtime packs
PARTITION_MAY_USE = PURE | {"gems.pipeline.routes", "gems.pipeline.packing"}
MAX_LINES, ENGINE_MAX_LINES = 400, 300


def modules() -> dict[str, Path]:
    found = {}
    for top, package in ROOTS.items():
        for path in sorted((REPO / top).rglob("*.py")):
            parts = list(path.relative_to(REPO / top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


MODULES = modules()


def _resolve(name: str) -> str | None:
    for top, package in ROOTS.items():
        if name == top or name.startswith(top + "."):
            name = package + name[len(top):]
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _exact(name: str) -> bool:
    for top, package in ROOTS.items():
        if name == top or name.startswith(top + "."):
            name = package + name[len(top):]
    return name in MODULES


def imports(module: str) -> set[str]:
    """Every name ``module`` imports (absolute), lazy imports included."""
    path = MODULES[module]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from gems import comm`` imports the module gems.comm, ``from gems.x import f`` gems.x
            names |= {f"{base}.{a.name}" if _exact(f"{base}.{a.name}") else base for a in node.names}
    return names


GRAPH = {m: {r for n in imports(m) if (r := _resolve(n)) and r != m} for m in MODULES}


def layer(module: str) -> str:
    """The layer of a module: its subpackage, or the top-level module itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_every_module_is_in_a_layer():
    unknown = sorted(m for m in MODULES if m != "gems" and layer(m) not in ALLOWED)
    assert not unknown, f"modules outside every layer (add them to ARCHITECTURE.md and ALLOWED): {unknown}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "gems"))
def test_imports_follow_the_layers(module):
    own = layer(module)
    bad = sorted(t for t in GRAPH[module] if t != "gems" and layer(t) != own and layer(t) not in ALLOWED[own])
    assert not bad, f"{module} ({own}) imports {bad}: not below it"
    if own == "gems.partition":
        runtime = sorted(t for t in GRAPH[module] if layer(t) == "gems.pipeline" and t not in PARTITION_MAY_USE)
        assert not runtime, f"{module}: the planner may use only the pure schedule modules, not {runtime}"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_files():
    graph = {m: targets - {"gems"} for m, targets in GRAPH.items()}
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_no_import_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for m, targets in GRAPH.items():
        if m != "gems":
            graph.setdefault(layer(m), set()).update(layer(t) for t in targets if t != "gems" and layer(t) != layer(m))
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_only_comm_talks_to_the_transports():
    bad = sorted(m for m in MODULES if layer(m) != "gems.comm"
                 and any(n == "mpi4py" or n.startswith(("mpi4py.", "torch.distributed")) for n in imports(m)))
    assert not bad, f"only gems.comm may import mpi4py or torch.distributed: {bad}"


def test_the_schedule_ir_is_pure():
    bad = sorted(m for m in PURE if any(n == "torch" or n.startswith("torch.") for n in imports(m)))
    assert not bad, f"the schedule modules must not import torch: {bad}"


def test_modules_stay_small():
    sizes = {m: p.read_text().count("\n") for m, p in MODULES.items()}
    big = {m: n for m, n in sizes.items() if n > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"
    engine = sizes["gems.pipeline.engine"]
    assert engine <= ENGINE_MAX_LINES, f"the engine has {engine} lines (> {ENGINE_MAX_LINES})"
