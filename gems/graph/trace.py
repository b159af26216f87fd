"""The tracer of the graph front-end: ``torch.fx`` symbolic tracing that knows every value.

See ``gems.graph`` for what the front-end builds from the graph this produces.
"""
from __future__ import annotations

import inspect
import operator
import threading
import traceback
from pathlib import Path

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from gems.errors import GemsError

TORCH_DIR = str(Path(torch.__file__).parent)
VALUE = "gems_value"   # node.meta key: the node's value on the fake input
# fx patches nn.Module process-wide while it traces, so one trace at a time, and no fake run of modules
# (gems.graph.chain) beside one: another thread's module calls would go through its tracer. Re-entrant: a
# module run under it may trace (a tiled unit flattens its layers).
TRACING = threading.RLock()


def fake_state(mode: FakeTensorMode, model: nn.Module) -> dict[str, torch.Tensor]:
    """Fake copies of ``model``'s parameters and buffers, by name (a shared one under each of its names)."""
    return {name: mode.from_tensor(t) for name, t in
            [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]}


def state_of(state: dict[str, torch.Tensor], path: str) -> dict[str, torch.Tensor]:
    """The entries of ``state`` inside the module at ``path``, named relative to it (for
    ``torch.func.functional_call`` of that module)."""
    return {name[len(path) + 1:]: t for name, t in state.items() if name.startswith(path + ".")}


class Tracer(fx.Tracer):
    """``torch.fx`` symbolic tracing that also knows every value on a fake input of the plan's
    shape, so a forward may branch on shapes (``if h.shape[-1] != skip.shape[-1]``), unpack
    them (``n, c, h, w = x.shape``) or loop over them: static for a plan, such code takes the
    one path those shapes give. Branching on data (``if x.sum() > 0``) still fails, in one
    sentence. Values are computed with ``FakeTensorMode`` on fake copies of the parameters and
    buffers (so nothing is allocated and no BatchNorm statistic moves), each op as it is traced."""

    def __init__(self, model: nn.Module, leaves: tuple) -> None:
        super().__init__()
        self.leaf_types = tuple(c for c in leaves if isinstance(c, type))
        self.leaf_paths = {p for p in leaves if isinstance(p, str)}
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.fake = fake_state(self.mode, model)
        self.computing = False     # running real code on fake values: no nodes
        self._forward = None       # the original call of the leaf module being traced
        self._shape: tuple[int, ...] = ()
        self.defaults: dict[str, object] = {}   # the forward's arguments after the image batch

    def trace(self, root: nn.Module, shape: tuple[int, ...]) -> fx.Graph:  # type: ignore[override]
        """The graph of ``root.forward`` on one image batch of ``shape``; its other arguments take
        their defaults (gems feeds a model only the image batch)."""
        self._shape = shape
        params = list(inspect.signature(root.forward).parameters.values())[1:]
        needed = [p.name for p in params if p.default is inspect.Parameter.empty
                  and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if needed:
            raise GemsError(f"{type(root).__name__}.forward needs {', '.join(needed)} besides the image batch; "
                            f"gems feeds it only the images: give the other arguments defaults")
        self.defaults = {p.name: p.default for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        return super().trace(root, concrete_args=self.defaults or None)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return (isinstance(m, self.leaf_types) or qualname in self.leaf_paths or type(m).__name__ in self.leaf_paths
                or super().is_leaf_module(m, qualname))

    def call_module(self, m, forward, args, kwargs):
        if self.computing:
            return forward(*args, **kwargs)
        outer, self._forward = self._forward, (m, forward)
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self._forward = outer

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self.computing:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        node = proxy.node
        if kind == "placeholder":   # the image batch, then the other arguments at their defaults
            index = sum(1 for n in node.graph.nodes if n.op == "placeholder") - 1
            if index:
                node.meta[VALUE] = list(self.defaults.values())[index - 1]
            else:
                device = next(iter(self.fake.values())).device if self.fake else torch.device("cpu")
                node.meta[VALUE] = self.mode.from_tensor(torch.empty(self._shape, device=device))
        elif kind == "get_attr":
            if target in self.fake:
                node.meta[VALUE] = self.fake[target]
            else:   # a plain tensor attribute, not a parameter or buffer
                self.computing = True
                try:
                    node.meta[VALUE] = operator.attrgetter(target)(self.root)
                finally:
                    self.computing = False
        elif kind in ("call_function", "call_method", "call_module"):
            self._compute(node, kind, target, args, kwargs)
        return proxy

    def _compute(self, node: fx.Node, kind: str, target, args, kwargs) -> None:
        known = True

        def value(a):
            nonlocal known
            if isinstance(a, fx.Proxy):
                if VALUE not in a.node.meta:
                    known = False
                return a.node.meta.get(VALUE)
            return a

        a, k = fx.node.map_aggregate(args, value), fx.node.map_aggregate(kwargs, value)
        if not known:
            return
        self.computing = True
        try:
            with self.mode, torch.no_grad():
                if kind == "call_function":
                    node.meta[VALUE] = target(*a, **k)
                elif kind == "call_method":
                    node.meta[VALUE] = getattr(a[0], target)(*a[1:], **k)
                else:
                    module, _ = self._forward
                    node.meta[VALUE] = torch.func.functional_call(module, state_of(self.fake, target), a, k)
        except Exception:  # noqa: BLE001 -- unknown value: only branching on it fails
            pass
        finally:
            self.computing = False

    def to_bool(self, obj: fx.Proxy) -> bool:
        value = obj.node.meta.get(VALUE)
        if isinstance(value, (bool, int, float)):
            return bool(value)
        return super().to_bool(obj)   # data-dependent: fx's own TraceError

    def iter(self, obj: fx.Proxy):
        value = obj.node.meta.get(VALUE)
        if isinstance(value, (tuple, list, torch.Size)):
            return iter([obj[i] for i in range(len(value))])
        return super().iter(obj)


def untraceable(model: nn.Module, exc: Exception, second: Exception | None = None) -> str:
    """One sentence: what fx could not trace, where in the user's code, and the fix (and why the
    fallback, ``torch.export``, could not either)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(TORCH_DIR)
              and not f.filename == __file__]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({(frames[-1].line or '').strip()})" if frames else ""
    reason = " ".join(str(exc).split())[:200]
    also = f" (torch.export failed too: {type(second).__name__}: {' '.join(str(second).split())[:200]})" \
        if second is not None else ""
    return (f"cannot trace {type(model).__name__}.forward{where}: {type(exc).__name__}: {reason}{also}; remove "
            f"data-dependent control flow from the forward, or pass the module that holds it in leaf_modules "
            f"(--leaf-module) so that it runs as one unit")
