"""Compiled stages: every unit of a rank's stages compiled by ``torch.compile`` before the first step.

``Engine(..., compile=True)`` (``--compile`` in gems-train, gems-bench and gems-predict; default the
plan's ``compiled``) compiles each unit -- one element of the plan's chain -- in place
(``nn.Module.compile``: parameters, buffers and state-dict keys stay the unit's) with fixed shapes
(``dynamic=False``), as one graph (``fullgraph=True``), by inductor in its default mode. The frame
torch.compile caches is a unit's own ``forward`` (each unit is a ``GraphModule`` with code of its own,
``gems.graph``), so its compiled entries are its own. (``isolate_recompiles`` is not used: with two
ranks as threads of one process, ``gems.comm.loopback``, torch 2.14 then lost compiled entries of one
thread's units while the other compiled, and compiled them again at the first step.)

Warm-up (``CompiledUnits.warm_up``), in the engine's constructor on every rank: each stage's units run
one after another on example inputs of the micro-batch's shapes, made as a step makes them -- stage
0's from images (the engine's ``arrive``: device and memory format), a later stage's from its
messages packed and unpacked in the plan's layout (``gems.pipeline.routes``: the same dtypes,
strides and ``requires_grad``) -- forward under the engine's autocast, then backward (AOTAutograd
compiles a unit's backward at its first backward). A unit inside a recompute segment that carries a
``RECOMPUTING`` flag (a deferred BatchNorm layer reads it) runs once more as a recomputation runs it
(``gems.pipeline.stage.recomputation``), the flag raised: a variant of its own. Forward-only steps
(evaluate, predict: no grad, eval mode) warm their own variant when the engine first makes them
(``training=False``). Nothing of a warm-up stays: gradients are asked of autograd, never
accumulated, buffers (running statistics, ``num_batches_tracked``) are copied back, the RNG is
forked. Its time is split into tracing (dynamo, AOTAutograd) and code generation (inductor, forwards
and backwards) from torch's compile-time metrics, which are the process's: with loopback ranks they
add up every rank's.

Recompiles: the backend counts the graphs it makes for each unit; graphs made outside a warm-up are
recompiles (``recompiles``), 0 when every step runs as the warm-up did. Recompute's scratch buffers
are other tensors of the same metadata (a compiled unit's buffers are its graph's inputs, guarded
on metadata, not identity); checkpoint's and offload's saved-tensor hooks act on a compiled
unit's saved tensors from outside it; a deferred BatchNorm layer tells a recomputation by its flag.

Eager: the tiled units (``gems.spatial``: halo exchanges run inside their forwards and backwards and
stay outside compiled regions) -- the leader's other units of a tiled stage are compiled, warmed on
the whole-image values the tiled units gather, found on the meta device -- and a unit that does not
compile (a graph break under ``fullgraph``, an op the backend lacks): it runs eagerly, named once.
A compiled unit's backward is one autograd node, which the split backward (``gems.pipeline.splitgrad``)
cannot split: compiled stages never split it (``gems.partition.plan(compile=True)``).

``use_cache`` points the compiler's caches (inductor's FX graph cache, AOTAutograd's cache, triton's)
at a directory kept across runs, so a resumed job does not compile from scratch; ``check_backend``
says in one sentence what the backend lacks on this machine.
"""
from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable

import torch
from torch import nn

from gems.errors import GemsError
from gems.pipeline.oom import is_out_of_memory
from gems.pipeline.stage import RECOMPUTING, as_tuple, recomputation, unpack
from gems.plan import formats
from gems.spatial import TiledUnit
from gems.spatial.stage import Pass

BACKEND = "inductor"
# Seconds a rank done with its warm-up waits for the others' at least (``summary``): ranks compile
# different units, for minutes each when cold, and the communicator's timeout is meant for peers that hang.
PATIENCE = 3600.0
Inputs = tuple[torch.Tensor, ...]


def check_backend(device: torch.device | str) -> None:
    """GemsError, one sentence naming what is missing, when inductor cannot compile for ``device``:
    a C++ compiler on CPU (``CXX`` or g++), triton on CUDA."""
    kind = torch.device(device).type
    if kind == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise GemsError("--compile needs triton for torch.compile's inductor backend on CUDA, and it is not "
                            "installed: install triton (pip install triton) or drop --compile")
        return
    from torch._inductor import config, cpp_builder  # noqa: PLC0415 - inductor loads only with --compile
    from torch._inductor.exc import InvalidCxxCompiler  # noqa: PLC0415

    try:
        cpp_builder.get_cpp_compiler()
    except InvalidCxxCompiler:
        tried = " or ".join(c for c in config.cpp.cxx if c) or "none"
        raise GemsError(f"--compile needs a C++ compiler for torch.compile's inductor backend on CPU, and {tried} "
                        "does not run here (CXX names the compiler): install g++ or set CXX to a working one, or "
                        "drop --compile") from None


def check(plan, device: torch.device | str) -> None:
    """GemsError unless ``plan`` can run compiled on ``device``: its backward not split (a compiled
    unit's backward is one autograd node), the backend's tools present (``check_backend``)."""
    if plan.split_backward:
        raise GemsError("the plan splits the backward, which a compiled unit's backward (one autograd node) "
                        "cannot be: make the plan with --compile (gems-plan --compile) or drop --compile")
    check_backend(device)


def use_cache(directory: str | os.PathLike) -> str:
    """Keep the compiler's caches in ``directory`` (made if missing): inductor's FX graph cache, the
    AOTAutograd cache and triton's kernels; call it before the first compile. Returns the path."""
    path = os.path.abspath(os.fspath(directory))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise GemsError(f"the compile cache directory {path} cannot be made ({error.strerror}): pass "
                        "--compile-cache with a writable directory") from None
    os.environ.update({"TORCHINDUCTOR_CACHE_DIR": path, "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
                       "TORCHINDUCTOR_AUTOGRAD_CACHE": "1", "TRITON_CACHE_DIR": os.path.join(path, "triton")})
    from torch._functorch import config as functorch_config  # noqa: PLC0415 - read at import: set them too
    from torch._inductor import config as inductor_config  # noqa: PLC0415

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return path


class _Counted:
    """The backend of one unit: inductor, counting the graphs it compiles."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        self.graphs += 1
        return torch._dynamo.lookup_backend(BACKEND)(gm, example_inputs)


class CompiledUnits:
    """The units of a rank's stages, compiled (module docstring).

    Args:
        stages: {stage: its module} of this rank (units in order).
        plan: the plan (cuts, unit names, recompute segments).

    Tiled units (``gems.spatial.TiledUnit``) and a tile group member's stand-ins stay eager.
    """

    def __init__(self, stages: dict[int, nn.Sequential], plan) -> None:
        self.stages, self.plan = stages, plan
        self.units: dict[int, nn.Module] = {}   # model unit index -> compiled unit
        self.eager: dict[int, str] = {}         # unit index -> why it did not compile
        self.tiled: list[int] = []              # unit indices of tiled units (eager)
        self._backends: dict[int, _Counted] = {}
        self._warm_graphs = 0                   # graphs made by the warm-ups
        self.seconds = self.tracing = self.codegen = 0.0
        for s, stage in stages.items():
            for i, unit in enumerate(stage, start=plan.cuts[s]):
                if isinstance(unit, (TiledUnit, Pass)):
                    self.tiled += [i] * isinstance(unit, TiledUnit)
                    continue
                self._backends[i] = _Counted()
                unit.compile(fullgraph=True, dynamic=False, backend=self._backends[i])
                self.units[i] = unit

    @property
    def graphs(self) -> int:
        """Graphs compiled so far, every unit's."""
        return sum(b.graphs for b in self._backends.values())

    @property
    def recompiles(self) -> int:
        """Graphs compiled outside the warm-ups: 0 while every step runs as the warm-up did."""
        return self.graphs - self._warm_graphs

    def warm_up(self, inputs: Callable[[int], Inputs], rows: int, device: torch.device,
                autocast: torch.dtype | None, training: bool = True) -> None:
        """Run every compiled unit once (module docstring). ``inputs(stage)``: example inputs of that
        stage for micro-batches of ``rows`` images, made as a step makes them; ``training``: forward and
        backward, else forward-only steps' variant (no grad, eval mode)."""
        start, before, graphs = time.perf_counter(), _compile_times(), self.graphs
        modules = [m for s in self.stages for m in self.stages[s].modules()]
        buffers = [(b, b.clone()) for s in self.stages for b in self.stages[s].buffers()]
        modes = [m.training for m in modules]
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):   # dropout draws
            try:
                for s, stage in sorted(self.stages.items()):
                    self._warm_stage(s, stage, inputs, rows, device, autocast, training)
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

    def _warm_stage(self, s: int, stage: nn.Sequential, inputs: Callable[[int], Inputs], rows: int,
                    device: torch.device, autocast: torch.dtype | None, training: bool) -> None:
        """One unit after another, each on the previous one's outputs (detached: one unit's graph at a
        time), up to the stage's last compiled unit; a tiled unit on the meta device (its gathered values'
        shapes, dtypes and strides: no halo exchange), its outputs then made real."""
        first, end = self.plan.cuts[s], self.plan.cuts[s + 1]
        last = max((i for i in range(first, end) if i in self.units), default=-1)
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
        recomputed = {u for lo, hi in self.plan.policies[s].recompute for u in range(lo, hi)}
        for i, unit in enumerate(stage, start=first):
            if i > last:
                return
            if isinstance(unit, TiledUnit):
                grad = training and any(t.requires_grad for t in (*xs, *unit.parameters()))
                xs = tuple(_example(o, device, grad) for o in _on_meta(unit.flat, xs))
                continue
            flagged = training and i in recomputed and any(hasattr(m, RECOMPUTING) for m in unit.modules())
            out = self._run(i, unit, xs, device, autocast, training, flagged)
            xs = tuple(o.detach().requires_grad_(o.requires_grad) for o in out)

    def _run(self, i: int, unit: nn.Module, xs: Inputs, device: torch.device, autocast: torch.dtype | None,
             training: bool, flagged: bool) -> Inputs:
        """Unit ``i`` forward (and backward) on ``xs``, and again as a recomputation when ``flagged``. A
        unit that fails to compile is made eager again, its error kept, and run eagerly."""
        try:
            out = _pass(unit, xs, device, autocast, training)
            if flagged:
                with recomputation(unit):
                    _pass(unit, xs, device, autocast, training)
            return out
        except Exception as error:  # noqa: BLE001 - which exceptions a backend raises is open-ended
            if i not in self.units or is_out_of_memory(error):
                raise
            unit._compiled_call_impl = None   # nn.Module.compile undone: the unit's own __call__ again
            del self.units[i]
            self.eager[i] = _first_line(error)
            return _pass(unit, xs, device, autocast, training)   # eager: its errors are the unit's own

    def summary(self, comm) -> list[str]:
        """The warm-up in words for rank 0 (``[]`` elsewhere): units compiled over all ranks, the
        slowest rank's time split into tracing and code generation, the units left eager. COLLECTIVE,
        waiting ``PATIENCE`` seconds at least for the slowest rank."""
        mine = (sorted(self.units), self.eager, self.tiled, self.seconds, self.tracing, self.codegen, self.graphs,
                self.recompiles)
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
        lines = [f"compiled {len(units)} units in {slowest[3]:.1f} s ({which}tracing {slowest[4]:.1f} s, code "
                 f"generation {slowest[5]:.1f} s), {sum(r[6] for r in every)} graphs, {sum(r[7] for r in every)} "
                 "recompiles"]
        tiled = sorted({u for r in every for u in r[2]})
        if tiled:
            lines[0] += f"; the {len(tiled)} tiled units run eagerly (halo exchanges stay outside compiled regions)"
        eager = {u: why for r in every for u, why in r[1].items()}
        if eager:
            lines.append(f"{len(eager)} unit(s) run eagerly, they do not compile: "
                         + "; ".join(f"unit {u} ({names[u]}): {why}" for u, why in sorted(eager.items())))
        return lines


def _pass(unit: nn.Module, xs: Inputs, device: torch.device, autocast: torch.dtype | None, training: bool) -> Inputs:
    """One forward of ``unit`` as a stage runs it and, ``training``, its backward (no ``.grad`` written)."""
    with torch.set_grad_enabled(training), torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        out = as_tuple(unit(unpack(xs)))
    if training:
        seeds = [o for o in out if o.requires_grad]
        wrt = [x for x in xs if x.requires_grad] + [p for p in unit.parameters() if p.requires_grad]
        if seeds and wrt:
            torch.autograd.grad(seeds, wrt, [torch.ones_like(o) for o in seeds], allow_unused=True)
    return out


def _on_meta(module: nn.Module, xs: Inputs) -> Inputs:
    """``module``'s outputs on the meta device (shapes, dtypes, strides; nothing computed or kept), its
    ``RECOMPUTING`` flags raised so that deferred BatchNorm layers count nothing."""
    state = {name: t.to("meta") for name, t in (*module.named_parameters(), *module.named_buffers())}
    with torch.no_grad(), recomputation(module):
        return as_tuple(torch.func.functional_call(module, state, (unpack(tuple(x.to("meta") for x in xs)),)))


def _example(t: torch.Tensor, device: torch.device, grad: bool) -> torch.Tensor:
    """A real tensor like ``t`` (shape, dtype, strides) on ``device``, random where floating."""
    real = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    with torch.no_grad():
        real.copy_(torch.randn(t.shape, dtype=t.dtype) if t.dtype.is_floating_point
                   else torch.zeros(t.shape, dtype=t.dtype))
    return real.requires_grad_(grad and t.dtype.is_floating_point)


def example_inputs(plan, routes, stage: int, rows: int, device: torch.device,
                   arrive: Callable[[torch.Tensor], torch.Tensor]) -> Inputs:
    """Stage ``stage``'s inputs for a micro-batch of ``rows`` images, made as a step makes them: the
    images through ``arrive`` (stage 0), else its messages packed and unpacked in the plan's layout,
    ``requires_grad`` where their gradients go back (``gems.pipeline.executor``). Random values of a
    generator of their own."""
    g = torch.Generator().manual_seed(rows)
    if stage == 0:
        return (arrive(torch.randn(rows, *plan.input_shape, dtype=getattr(torch, plan.dtype), generator=g)),)
    received = {}
    for edge, e in routes.edges.items():
        if e.consumer != stage:
            continue
        layout = routes.layout("act", edge, rows)
        values = [torch.randn(shape, dtype=dtype, generator=g) if dtype.is_floating_point
                  else torch.zeros(shape, dtype=dtype) for shape, dtype in zip(layout.shapes, layout.dtypes)]
        tensors = layout.unpack(layout.pack(values, "the warm-up", device), "the warm-up")
        for t, grad in zip(tensors, e.grads):
            t.requires_grad_(grad)
        received[edge] = tensors
    return routes.assemble(stage, received, device)


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
