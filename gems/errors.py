"""The exception type gems raises for bad input, and how the command-line tools report it.

``GemsError`` is bad user input: raised at the edges (CLI, ``partition.plan``, ``Engine``) with a
single sentence that names the fix; the CLIs print it on one line (``one_line``) and exit with
``USER_ERROR``, library users catch it like a ValueError. (``gems.pipeline.oom.OutOfMemory`` is
the one GemsError raised while training.)
"""
from __future__ import annotations

USER_ERROR = 2  # the exit status of argparse for bad usage; gems uses it for every user error


class GemsError(ValueError):
    """User-facing error whose message is one sentence that says how to fix the input."""


def one_line(message: object) -> str:
    """``message`` with every run of whitespace (newlines, carriage returns from a file name or a
    JSON key quoted in it) made one space, so an error is always exactly one line."""
    return " ".join(str(message).split())
