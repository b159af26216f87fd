"""Models from the user's own code: ``"path/to/file.py:factory"`` or ``"package.module:factory"``.

The factory is called as ``factory(num_classes=..., **kw)`` when it takes ``num_classes``
(or ``**kwargs``), else as ``factory(**kw)``. It may return any ``nn.Module``, which gems
uses as it is: an ``nn.Sequential`` whose elements follow the boundary convention of
``gems.models`` (each unit takes exactly what the previous one returned), or any other module,
which the graph front-end splits.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn

from gems.errors import GemsError

SYNTAX = "'path/to/file.py:factory' or 'package.module:factory'"
_LOADING = threading.RLock()   # model files are executed one at a time (see _load_file)


def is_user_spec(name: str) -> bool:
    """True when ``name`` points at user code rather than a registered model."""
    return ":" in name or name.endswith(".py")


def build_user_model(spec: str, num_classes: int, kw: dict[str, Any]) -> nn.Module:
    """Import the factory named by ``spec``, call it, and check that it returned a module."""
    factory = load_factory(spec)
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    args = dict(kw)
    if takes_any or "num_classes" in params:
        args["num_classes"] = num_classes
    if not takes_any:
        unknown = sorted(set(args) - set(params))
        if unknown:
            raise GemsError(f"{spec} does not accept {', '.join(unknown)}; its parameters are "
                            f"({', '.join(params) or 'none'}): add them to the factory or drop those options.")
    model = factory(**args)
    if not isinstance(model, nn.Module):
        raise GemsError(f"{spec} must return an nn.Module (the model to train); got {type(model).__name__}.")
    return model


def load_factory(spec: str) -> Callable[..., Any]:
    """Resolve ``spec`` to the factory callable, with an error naming the fix at each step."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise GemsError(f"{spec!r} does not name a factory; write {SYNTAX}.")
    module = _load_file(where) if where.endswith(".py") or "/" in where else _import(where)
    factory = getattr(module, attr, None)
    if factory is None:
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise GemsError(f"{where} has no {attr!r}; define def {attr}(num_classes=1000, ...) -> nn.Module "
                        f"there or name one of: {', '.join(found) or 'no public callables found'}.")
    if not callable(factory):
        raise GemsError(f"{where}:{attr} is a {type(factory).__name__}, not a function; point at a factory "
                        "that returns an nn.Module.")
    return factory


def _load_file(path: str) -> ModuleType:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise GemsError(f"model file {path} does not exist; pass the path of a .py file that defines the factory.")
    # A stable, unique module name, registered in sys.modules so pickling and dataclasses work.
    name = "gems_user_model_" + hashlib.sha1(str(file).encode()).hexdigest()[:12]
    # one load at a time: ranks run as threads of one process (the loopback communicator) must not
    # see another thread's half-executed module in sys.modules
    with _LOADING:
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, file)
        if spec is None or spec.loader is None:
            raise GemsError(f"cannot load {path} as Python; pass a .py file.")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        # Let the file import its sibling modules, as it would when run as a script.
        sys.path.insert(0, str(file.parent))
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        finally:
            sys.path.remove(str(file.parent))
    return module


def _import(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name) and (module == e.name or module[len(e.name)] == "."):
            raise GemsError(f"cannot import module {module!r} ({e}); install it or add its folder to "
                            "PYTHONPATH, or give a file path instead: path/to/file.py:factory.") from e
        raise  # the module exists but one of its own imports is missing: show the real error
