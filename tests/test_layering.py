"""The layering of the README's layout section, checked from the source (every import statement,
lazy ones too).

    gems.cli                      command-line tools: parsing and messages
    gems.bench                    the benchmark runner (drives an Engine)
    gems.train                    the training application
    gems.partition                the planner (may use the schedule world and the runtime's message layouts)
    gems.obs                      measuring: memory meters, traces
    gems.pipeline                 the runtime: executes the schedule's action lists
    gems.spatial                  tiles of one image across ranks (the runtime's spatial part)
    gems.schedule                 the schedule world, pure Python: IR, generators, search, validation,
                                  wire order, topology, simulator, sweeps
    gems.comm                     transports
    gems.models                   model builders
    gems.graph                    any model as a chain of units (what the planner prices and the runtime runs)
    gems.plan                     the plan types the runtime reads
    gems.errors, gems.units       the base

Each layer may import only the layers its row allows; no import cycles between files or
between these packages; no library module imports the CLI; nothing gems.schedule reaches, through
any chain of imports, is torch, mpi4py or a gems package above the base (and it imports and runs
with torch and mpi4py unimportable); only gems.comm imports mpi4py or torch.distributed. A module
over WARN_LINES lines gets a warning (look for two concepts in it), over MAX_LINES a failure.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import warnings
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
    "gems.schedule": BASE,
    "gems.spatial": BASE | {"gems.plan", "gems.graph", "gems.comm"},
    "gems.pipeline": BASE | {"gems.plan", "gems.graph", "gems.comm", "gems.schedule", "gems.spatial"},
    "gems.obs": BASE | {"gems.plan", "gems.schedule", "gems.pipeline"},
    "gems.partition": BASE | {"gems.plan", "gems.graph", "gems.models", "gems.schedule", "gems.pipeline", "gems.obs",
                              "gems.spatial"},
    "gems.train": BASE | {"gems.plan", "gems.graph", "gems.models", "gems.comm", "gems.schedule", "gems.pipeline",
                          "gems.obs", "gems.partition", "gems.spatial"},
    "gems.bench": BASE | {"gems.plan", "gems.graph", "gems.models", "gems.comm", "gems.schedule", "gems.pipeline",
                          "gems.obs", "gems.partition", "gems.train", "gems.spatial"},
    "gems.cli": BASE | {"gems.plan", "gems.graph", "gems.models", "gems.comm", "gems.schedule", "gems.pipeline",
                        "gems.obs", "gems.partition", "gems.train", "gems.bench", "gems.spatial"},
}
# Of the runtime, the planner may use the message layouts only, so it prices the very buffers the
# runtime packs (never the executor or the engine).
PARTITION_MAY_USE = {"gems.pipeline.routes", "gems.pipeline.packing"}
# Outside libraries the schedule world must never reach.
IMPURE = ("torch", "mpi4py", "numpy")
WARN_LINES, MAX_LINES = 400, 600


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
        assert not runtime, f"{module}: of the runtime the planner may use the message layouts only, not {runtime}"


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


def reached(module: str) -> set[str]:
    """``module`` and every gems module it imports, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        if (m := todo.pop()) not in seen:
            seen.add(m)
            todo.extend(t for t in GRAPH[m] if t != "gems")
    return seen


SCHEDULE = sorted(m for m in MODULES if layer(m) == "gems.schedule")


@pytest.mark.parametrize("module", SCHEDULE)
def test_the_schedule_world_is_pure(module):
    above = sorted(m for m in reached(module) if layer(m) not in BASE | {"gems.schedule"})
    assert not above, f"{module} reaches {above}: the schedule world imports nothing of gems above the base"
    impure = sorted({f"{m} imports {n}" for m in reached(module) for n in imports(m)
                     if n.split(".")[0] in IMPURE})
    assert not impure, f"{module} reaches outside libraries it must not: {impure}"


BLOCKED = """
import importlib, pkgutil, sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is blocked in this test")

sys.meta_path.insert(0, Refuse())
import gems.schedule
for info in pkgutil.iter_modules(gems.schedule.__path__):
    importlib.import_module("gems.schedule." + info.name)
from gems.schedule import generators, simulate, validate
lists = generators.schedule("mast", 4, 4)
validate.validate("mast", 4, 4, lists)
costs = simulate.Costs(forward=[1.0] * 4, backward=[2.0] * 4, boundary_bytes=[1 << 20] * 4)
result = simulate.simulate("mast", 4, 4, costs)
assert not any(name.split(".")[0] in {blocked!r} for name in sys.modules), sorted(sys.modules)
print(f"mast K=4 m=4: {{sum(map(len, lists))}} actions, step {{result.step_time:.3f}} s, "
      f"bubble {{result.bubble_fraction:.3f}}")
"""


def test_the_schedule_world_runs_without_torch_or_mpi():
    """Every module of gems.schedule imports, and mast K=4 m=4 is generated, validated and
    simulated, in a process where torch and mpi4py cannot be imported."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", BLOCKED.format(blocked=set(IMPURE[:2]))], capture_output=True,
                          text=True, timeout=120, env=env, cwd=REPO / "tests")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mast K=4 m=4:" in done.stdout, done.stdout


def test_modules_stay_small():
    sizes = {m: p.read_text().count("\n") for m, p in MODULES.items()}
    big = {m: n for m, n in sizes.items() if n > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by concept): {big}"
    for module, lines in sorted(sizes.items()):
        if lines > WARN_LINES:
            warnings.warn(f"{module} has {lines} lines: does it hold two concepts?", stacklevel=1)
