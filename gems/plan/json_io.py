"""A plan as JSON and back: ``Plan.to_json`` and ``Plan.from_json``, written by ``gems-plan --json``,
reviewed and edited by people, read by training. The plan's class comes in as an argument and its
nested dataclasses through its annotations: this module imports no plan type, so nothing imports
in a circle."""
from __future__ import annotations

import json
import os
import types
import typing
from dataclasses import asdict, fields, is_dataclass

from gems.errors import GemsError


# Fields of Plan added after its JSON was first written, with the defaults that leave them out of it.
_LATER_FIELDS = {"amp": "none", "device_overhead": {}, "host_bytes": [], "state_host_bytes": [], "leaf_modules": [],
                 "forward_bytes": [],
                 "routes": [], "spatial_grid": [], "spatial_end": 0, "spatial_start": 0,
                 "memory_format": "contiguous", "compiled": False}


def write(plan, path: str | os.PathLike | None) -> str:
    """``plan`` as JSON text; also written to ``path`` when given. Fields added since plans were
    first written are left out while they hold their defaults, so such a plan reads as before."""
    data = {k: v for k, v in asdict(plan).items() if k not in _LATER_FIELDS or v != _LATER_FIELDS[k]}
    text = json.dumps(data, indent=2) + "\n"
    if path is not None:
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as error:
            raise GemsError(f"cannot write the plan to {os.fspath(path)!r} ({error.strerror}): "
                            "choose a writable path") from None
    return text


def read(cls, path_or_text: str | os.PathLike):
    """A plan of class ``cls`` (``Plan``) from JSON text or from a file holding it, checked."""
    text = os.fspath(path_or_text)
    if not text.lstrip().startswith("{"):
        try:
            with open(text, encoding="utf-8") as f:
                text = f.read()
        except OSError as error:
            raise GemsError(f"cannot read plan file {text!r} ({error.strerror}): "
                            "give the path of a JSON file written by gems-plan --json") from None
    # the dataclasses of its lists, from the annotations: list[StageEstimate] and so on
    hints = typing.get_type_hints(cls)
    stage_estimate, policy, position = (typing.get_args(hints[name])[0]
                                        for name in ("stage_estimates", "policies", "positions"))
    try:
        data = json.loads(text)
        data["input_shape"] = tuple(data["input_shape"])
        data["stage_output_shapes"] = [[tuple(s) for s in stage] for stage in data["stage_output_shapes"]]
        data["stage_estimates"] = [stage_estimate(**s) for s in data["stage_estimates"]]
        data["policies"] = [policy(**p) for p in data.get("policies", [])]
        data["positions"] = [position(**{**p, "in_flight": {int(k): v for k, v in p["in_flight"].items()}})
                             for p in data["positions"]]
        known = {f.name for f in fields(cls)}
        plan = cls(**{k: v for k, v in data.items() if k in known})
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise GemsError(f"the plan JSON is not valid ({type(error).__name__}: {' '.join(str(error).split())}): "
                        "regenerate it with gems-plan --json") from None
    problem = _type_problem(plan, cls, "plan")
    if problem is not None:
        raise GemsError(f"the plan JSON is not valid ({problem}): regenerate it with gems-plan --json")
    plan.check()
    return plan


def _type_problem(value: object, hint: object, where: str) -> str | None:
    """Where JSON-loaded ``value`` departs from its annotation ``hint`` (None if nowhere): plain
    types, ``X | None``, lists, ``tuple[T, ...]``, dicts and the plan's dataclasses, field by field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        problems = [_type_problem(value, a, where) for a in args]
        return None if None in problems else problems[0]
    if origin in (list, tuple, dict):
        if not isinstance(value, origin):
            return f"{where} should be a {origin.__name__}, got {value!r:.40}"
        items = value.items() if origin is dict else enumerate(value)
        for key, item in items:
            problem = ((origin is dict and _type_problem(key, args[0], f"{where} key"))
                       or _type_problem(item, args[-1] if origin is dict else args[0], f"{where}[{key!r}]"))
            if problem:
                return problem
        return None
    if is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        for f in fields(hint):
            problem = _type_problem(getattr(value, f.name), hints[f.name], f"{where}.{f.name}")
            if problem:
                return problem
        return None
    if hint is type(None):
        ok = value is None
    elif hint is float:  # JSON writes 2.0 as 2.0 but people write 2
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:                # bool is an int to Python, never to a plan
        ok = isinstance(value, hint) and (hint is bool or not isinstance(value, bool))
    return None if ok else f"{where} should be {getattr(hint, '__name__', hint)}, got {value!r:.40}"
