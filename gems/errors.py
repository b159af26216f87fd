"""The one exception type for bad user input.

Raised at the edges (CLI, ``partition.plan``, ``Engine``) with a single sentence that names
the fix; the CLIs print it and exit with code 2, library users catch it like a ValueError.
"""


class GemsError(ValueError):
    """User-facing error whose message is one sentence that says how to fix the input."""
