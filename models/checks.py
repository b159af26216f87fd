"""Argument checks shared by the model builders.

Model arguments come from the user (CLI flags, ``build(**kw)``), so a wrong value raises
``GemsError`` with one sentence naming the fix, never an ``assert`` or a deep torch error.
"""
from __future__ import annotations

from gems.errors import GemsError


def positive_int(model: str, name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 1, else raise GemsError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GemsError(f"{model}: {name} must be a positive integer; got {value!r}.")
    return value
