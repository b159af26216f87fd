"""Compiled stages: the units of a rank's stages compiled by ``torch.compile`` before the first step.

``Engine(..., compile=True)`` (``--compile`` in gems-train, gems-bench and gems-predict; default the
plan's ``compiled``) compiles what a stage's forward runs as one (a *piece*,
``gems.pipeline.stage.Piece``: a recompute segment, or the units between two) as one graph
(``fullgraph=True``) per run of consecutive units, with fixed shapes (``dynamic=False``), by inductor
in its default mode; a stage without recompute segments is one piece, so one graph, as a plain loop
compiling its whole model gets. Whole runs rather than each unit on its own: on resnet18 at 512^2
(channels_last, bf16, one CPU thread) a step with every unit its own graph took 1.13x the CPU time of
the model compiled whole, the units compiled as one sequence 1.03x (medians of 6 steps, one process;
inductor fuses and plans what backward saves within a graph only). Parameters, buffers and state-dict keys
stay the units' (the piece's ``call`` changes, not its modules). Each run is a function with a code
object of its own (``_own_code``), so the graphs dynamo caches for it are its own. A run that does not
compile as one graph (a graph break under ``fullgraph``, an op the backend lacks) is compiled unit by
unit (``nn.Module.compile``, in place), and a unit that does not compile on its own runs eagerly,
named once. (``isolate_recompiles`` is not used: with two ranks as threads of one process,
``gems.comm.loopback``, torch 2.14 then lost compiled entries of one thread's units while the other
compiled, and compiled them again at the first step.)

Warm-up (``CompiledUnits.warm_up``), in the engine's constructor on every rank: each stage's runs, for
both kinds of forward (waiting, immediate: ``StageRunner.pieces``), run one after another on example inputs of the micro-batch's shapes, made as a step makes them -- stage
0's from images (the engine's ``arrive``: device and memory format), a later stage's from its
messages packed and unpacked in the plan's layout (``gems.pipeline.routes``: the same dtypes,
strides and ``requires_grad``) -- forward under the engine's autocast, then backward (AOTAutograd
compiles a run's backward at its first backward). A run of a recompute segment whose modules carry a
``RECOMPUTING`` flag (a deferred BatchNorm layer reads it) runs once more as a recomputation runs it
(``gems.pipeline.stage.recomputation``), the flag raised: a variant of its own. Forward-only steps
(evaluate, predict: no grad, eval mode) warm their own variant when the engine first makes them
(``training=False``). Nothing of a warm-up stays: gradients are asked of autograd, never
accumulated, buffers (running statistics, ``num_batches_tracked``) are copied back, the RNG is
forked. Its time is split into tracing (dynamo, AOTAutograd) and code generation (inductor, forwards
and backwards) from torch's compile-time metrics, which are the process's: with loopback ranks they
add up every rank's.

Recompiles: the backend counts the graphs it makes for each run; graphs made outside a warm-up are
recompiles (``recompiles``), 0 when every step runs as the warm-up did. Recompute's scratch buffers
are other tensors of the same metadata (a compiled run's buffers are its graph's inputs, guarded
on metadata, not identity); checkpoint's and offload's saved-tensor hooks act on a compiled
run's saved tensors from outside it; a deferred BatchNorm layer tells a recomputation by its flag.

Eager: the tiled units (``gems.spatial``: halo exchanges run inside their forwards and backwards and
stay outside compiled regions; they end a run) -- the leader's other units of a tiled stage are
compiled, warmed on the whole-image values the tiled units gather, found on the meta device -- and a
unit that does not compile on its own. A compiled run's backward is one autograd node, which the split
backward (``gems.pipeline.splitgrad``) cannot split: compiled stages never split it (``gems.partition.plan(compile=True)``).

Whether a plan can run compiled on this machine, and where the compiler keeps its caches:
``gems.pipeline.compiler``.
"""
from __future__ import annotations

import time
import types
from collections.abc import Callable

import torch
from torch import nn

from gems.pipeline.examples import Inputs, example, on_meta
from gems.pipeline.oom import is_out_of_memory
from gems.pipeline.stage import RECOMPUTING, as_tuple, recomputation, unpack
from gems.plan import formats
from gems.spatial import TiledUnit
from gems.spatial.stage import Pass

BACKEND = "inductor"
# Seconds a rank done with its warm-up waits for the others' at least (``summary``): ranks compile
# different units, for minutes each when cold, and the communicator's timeout is meant for peers that hang.
PATIENCE = 3600.0


class _Counted:
    """The backend of one unit: inductor, counting the graphs it compiles."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        self.graphs += 1
        return torch._dynamo.lookup_backend(BACKEND)(gm, example_inputs)


class _Run:
    """Consecutive units of a piece compiled as one graph (module docstring), callable like them; or,
    when that graph cannot be made, each unit compiled on its own (``per_unit``)."""

    def __init__(self, units: nn.Sequential, first: int) -> None:
        self.units, self.first = units, first
        self.indices = range(first, first + len(units))
        self.backend = _Counted()
        self.unit_backends: dict[int, _Counted] = {}   # per unit, once ``per_unit``
        self.call: Callable = torch.compile(_own_code(units, f"units_{first}_{first + len(units)}"),
                                            fullgraph=True, dynamic=False, backend=self.backend)

    def __call__(self, x):
        return self.call(x)

    def per_unit(self) -> None:
        """Compile each unit in place instead (its own graph), the units then run one after another."""
        for i, unit in zip(self.indices, self.units):
            self.unit_backends[i] = _Counted()
            unit.compile(fullgraph=True, dynamic=False, backend=self.unit_backends[i])
        self.call = self.units

    @property
    def graphs(self) -> int:
        return self.backend.graphs + sum(b.graphs for b in self.unit_backends.values())


def _own_code(units: nn.Sequential, name: str) -> Callable:
    """``units`` as a function whose code object is its own. Dynamo keeps the graphs it compiles on
    the code object of the frame it compiles; every run calling one shared code (``nn.Sequential``'s
    ``forward``) would share one cache and its size limit (8 entries), and lose entries past it."""
    def run(x):
        return units(x)

    code = run.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, run.__globals__, name, None, run.__closure__)


class _Chain:
    """A piece whose units are not all compiled: its runs (``_Run``) and eager units in order."""

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def __call__(self, x):
        for part in self.parts:
            x = part(x)
        return x


class CompiledUnits:
    """The units of a rank's stages, compiled (module docstring).

    Args:
        runners: {stage: its StageRunner} of this rank; each piece a forward runs
            (``StageRunner.pieces``) is compiled as one graph per run of consecutive units
            that are neither tiled (``gems.spatial.TiledUnit``) nor a member's stand-ins.
        plan: the plan (cuts, unit names).
    """

    def __init__(self, runners: dict, plan) -> None:
        self.runners, self.plan = runners, plan
        self.units: dict[int, _Run] = {}        # model unit index -> the compiled run it is in
        self.eager: dict[int, str] = {}         # unit index -> why it did not compile
        self.tiled: list[int] = []              # unit indices of tiled units (eager)
        self.runs: list[_Run] = []
        self._parts: dict[int, list] = {}       # id(piece) -> its runs and eager units
        self._warm_graphs = 0                   # graphs made by the warm-ups
        self.seconds = self.tracing = self.codegen = 0.0
        for runner in runners.values():
            for piece in {id(p): p for w in (True, False) for p in runner.pieces(w)}.values():
                parts = self._parts[id(piece)] = self._split(piece.module, piece.first)
                if len(parts) == 1 and isinstance(parts[0], _Run):
                    piece.call = parts[0]
                elif any(isinstance(part, _Run) for part in parts):
                    piece.call = _Chain(parts)

    def _split(self, module: nn.Sequential, first: int) -> list:
        """A piece's units as runs to compile, and the tiled units and stand-ins between them."""
        parts, at = [], 0
        for k, unit in enumerate([*module, None]):
            if unit is None or isinstance(unit, (TiledUnit, Pass)):
                if k > at:
                    run = _Run(module[at:k], first + at)
                    self.runs.append(run)
                    self.units.update(dict.fromkeys(run.indices, run))
                    parts.append(run)
                if unit is not None:
                    parts.append(unit)
                    self.tiled += [first + k] * isinstance(unit, TiledUnit)
                at = k + 1
        return parts

    @property
    def graphs(self) -> int:
        """Graphs compiled so far, every run's."""
        return sum(run.graphs for run in self.runs)

    @property
    def recompiles(self) -> int:
        """Graphs compiled outside the warm-ups: 0 while every step runs as the warm-up did."""
        return self.graphs - self._warm_graphs

    def warm_up(self, inputs: Callable[[int], Inputs], rows: int, device: torch.device,
                autocast: torch.dtype | None, training: bool = True) -> None:
        """Run every compiled run once (module docstring). ``inputs(stage)``: example inputs of that
        stage for micro-batches of ``rows`` images, made as a step makes them; ``training``: forward and
        backward, both kinds of forward's pieces, else forward-only steps' variant (no grad, eval mode)."""
        start, before, graphs = time.perf_counter(), _compile_times(), self.graphs
        modules = [m for r in self.runners.values() for m in r.module.modules()]
        buffers = [(b, b.clone()) for r in self.runners.values() for b in r.module.buffers()]
        modes = [m.training for m in modules]
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):   # dropout draws
            try:
                for s, runner in sorted(self.runners.items()):
                    warmed: set[int] = set()
                    for waiting in (True, False) if training else (False,):
                        pieces = runner.pieces(waiting)
                        if all(id(p) in warmed for p in pieces):
                            continue
                        self._warm_stage(s, runner.module, pieces, inputs, rows, device, autocast, training)
                        warmed.update(id(p) for p in pieces)
            finally:
                with torch.no_grad():
                    for b, saved in buffers:
                        b.copy_(saved)
                for m, mode in zip(modules, modes):
                    m.training = mode
        self._warm_graphs += self.graphs - graphs
        after = _compile_times()
        self.seconds += time.perf_counter() - start
        codegen = _delta(before, after, "compile_fx_inner")
        self.tracing += max(0.0, _delta(before, after, "_compile.compile_inner")
                            + _delta(before, after, "bw_compiler") - codegen)
        self.codegen += codegen

    def _warm_stage(self, s: int, stage: nn.Sequential, pieces: list, inputs: Callable[[int], Inputs], rows: int,
                    device: torch.device, autocast: torch.dtype | None, training: bool) -> None:
        """One piece after another, run after run, each on the previous one's outputs (detached: one
        run's graph at a time), up to the last compiled run; a tiled unit on the meta device (its
        gathered values' shapes, dtypes and strides: no halo exchange), its outputs then made real."""
        parts = [(piece, part) for piece in pieces for part in self._parts[id(piece)]]
        last = max((k for k, (_, part) in enumerate(parts) if isinstance(part, _Run)), default=-1)
        if last < 0:
            return
        if isinstance(stage[0], TiledUnit):   # a tile group's stage 0: whole images, for the meta pass
            xs = (torch.empty(rows, *self.plan.input_shape, dtype=getattr(torch, self.plan.dtype), device="meta"),)
            if xs[0].dim() == 4:
                xs = (xs[0].contiguous(memory_format=formats.of_name(self.plan.memory_format)),)
        else:
            xs = inputs(s)
        if not training:   # as forward-only steps run: eval mode, received tensors without grad
            stage.eval()
            xs = tuple(x.detach() for x in xs)
        for k, (piece, part) in enumerate(parts[:last + 1]):
            if isinstance(part, Pass):
                continue
            if isinstance(part, TiledUnit):
                grad = training and any(t.requires_grad for t in (*xs, *part.parameters()))
                xs = tuple(example(o, device, grad) for o in on_meta(part.flat, xs))
                continue
            if piece.copies and part.first == piece.first:   # as the piece runs it: on copies of its inputs
                xs = tuple(x.clone() for x in xs)
            flagged = training and piece.recompute and any(hasattr(m, RECOMPUTING) for m in part.units.modules())
            out = self._run(part, xs, device, autocast, training, flagged)
            xs = tuple(o.detach().requires_grad_(o.requires_grad) for o in out)

    def _run(self, run: _Run, xs: Inputs, device: torch.device, autocast: torch.dtype | None,
             training: bool, flagged: bool) -> Inputs:
        """``run`` forward (and backward) on ``xs``, and again as a recomputation when ``flagged``. A run
        that does not compile as one graph is compiled unit by unit; a unit that does not compile on
        its own is made eager again, its error kept, and runs eagerly."""
        try:
            return _passes(run, xs, device, autocast, training, flagged)
        except Exception as error:  # noqa: BLE001 - which exceptions a backend raises is open-ended
            if is_out_of_memory(error) or run.unit_backends:
                raise
        run.per_unit()
        for i, unit in zip(run.indices, run.units):
            try:
                out = _passes(unit, xs, device, autocast, training, flagged)
            except Exception as error:  # noqa: BLE001
                if is_out_of_memory(error):
                    raise
                unit._compiled_call_impl = None   # nn.Module.compile undone: the unit's own __call__ again
                del self.units[i]
                self.eager[i] = _first_line(error)
                out = _passes(unit, xs, device, autocast, training, flagged)   # eager: its errors are its own
            xs = tuple(o.detach().requires_grad_(o.requires_grad) for o in out)
        return xs

    def summary(self, comm) -> list[str]:
        """The warm-up in words for rank 0 (``[]`` elsewhere): units compiled over all ranks, the
        slowest rank's time split into tracing and code generation, the units left eager. COLLECTIVE,
        waiting ``PATIENCE`` seconds at least for the slowest rank."""
        whole = sum(not run.unit_backends for run in self.runs)
        mine = (sorted(self.units), self.eager, self.tiled, self.seconds, self.tracing, self.codegen, self.graphs,
                self.recompiles, whole)
        timeout, comm.timeout = comm.timeout, max(comm.timeout, PATIENCE)
        try:
            every = comm.allgather_object(mine)
        finally:
            comm.timeout = timeout
        if comm.rank != 0:
            return []
        units = sorted({u for r in every for u in r[0]})
        slowest = max(every, key=lambda r: r[3])
        names = self.plan.unit_names
        which = f"the slowest of {len(every)} ranks: " if len(every) > 1 else ""
        runs = sum(r[8] for r in every)
        lines = [f"compiled {len(units)} units ({runs} run{'s' * (runs != 1)} of consecutive units, one graph "
                 f"each) in {slowest[3]:.1f} s ({which}tracing {slowest[4]:.1f} s, code generation "
                 f"{slowest[5]:.1f} s), {sum(r[6] for r in every)} graphs, {sum(r[7] for r in every)} recompiles"]
        tiled = sorted({u for r in every for u in r[2]})
        if tiled:
            lines[0] += f"; the {len(tiled)} tiled units run eagerly (halo exchanges stay outside compiled regions)"
        eager = {u: why for r in every for u, why in r[1].items()}
        if eager:
            lines.append(f"{len(eager)} unit(s) run eagerly, they do not compile: "
                         + "; ".join(f"unit {u} ({names[u]}): {why}" for u, why in sorted(eager.items())))
        return lines


def _passes(call: Callable, xs: Inputs, device: torch.device, autocast: torch.dtype | None, training: bool,
            flagged: bool) -> Inputs:
    """``_pass``, and again as a recomputation (flags raised) when ``flagged``."""
    out = _pass(call, xs, device, autocast, training)
    if flagged:
        with recomputation(call.units if isinstance(call, _Run) else call):
            _pass(call, xs, device, autocast, training)
    return out


def _pass(call: Callable, xs: Inputs, device: torch.device, autocast: torch.dtype | None, training: bool) -> Inputs:
    """One forward of ``call`` (a run or a unit) as a stage runs it and, ``training``, its backward (no
    ``.grad`` written)."""
    with torch.set_grad_enabled(training), torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        out = as_tuple(call(unpack(xs)))
    if training:
        module = call.units if isinstance(call, _Run) else call
        seeds = [o for o in out if o.requires_grad]
        wrt = [x for x in xs if x.requires_grad] + [p for p in module.parameters() if p.requires_grad]
        if seeds and wrt:
            torch.autograd.grad(seeds, wrt, [torch.ones_like(o) for o in seeds], allow_unused=True)
    return out


def _compile_times() -> dict[str, float]:
    """torch's compile-time metrics so far: seconds per timed function, summed over its calls."""
    for _ in range(10):
        try:
            headers, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
            return {h: float(v) for h, v in zip(headers, values)}
        except RuntimeError:   # another thread (a loopback rank) compiling: the metrics changed under us
            time.sleep(0.01)
    return {}


def _delta(before: dict[str, float], after: dict[str, float], suffix: str) -> float:
    """Seconds the functions named ``...suffix`` took between the two readings."""
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k.endswith(suffix))


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:200]
