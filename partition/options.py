"""The memory-policy options a user gives (``--recompute``, ``--offload``, ``--host-bandwidth``,
``--state-placement``):
their values, their parsing and validation, the policy kinds they allow, and their words in
messages.

A *mode* is what the user asks for per option: ``none``, ``auto`` (a policy only where a
memory budget needs it) or ``all`` (on every stage). A *kind* is what one stage gets:
``none``, ``offload``, ``recompute`` or ``recompute+offload``. ``gems.partition.policy``
prices the kinds; the planner tries those that ``kinds`` allows. Nothing else of the planner
is needed here, so the prices, the planner and the command line read the very same names.
"""
from __future__ import annotations

import re

from gems.errors import GemsError
from gems.plan import PLACEMENT_CHOICES
from gems.units import parse_size

HOST_BANDWIDTH = 12e9        # bytes/s each way between device and host: PCIe 3 x16 class
MODES = ("none", "auto", "all")
KINDS = ("none", "offload", "recompute", "recompute+offload")   # from the least to the most saving


def check_modes(recompute: object, offload: object) -> None:
    """Raise GemsError unless both options are one of ``MODES``."""
    for flag, value in (("recompute", recompute), ("offload", offload)):
        if value not in MODES:
            raise GemsError(f"--{flag} must be one of {', '.join(MODES)}, got {value!r}")


def check_placement(placement: object) -> None:
    """Raise GemsError unless ``placement`` is one of ``PLACEMENT_CHOICES``."""
    if placement not in PLACEMENT_CHOICES:
        raise GemsError(f"--state-placement must be one of {', '.join(PLACEMENT_CHOICES)}, got {placement!r}")


def kinds(recompute: str, offload: str, device: str, budgeted: bool) -> list[str]:
    """Policies a stage may get, least saving first: ``all`` forces a policy, ``auto`` allows
    it (only with a memory budget to meet; never offload on a CPU device, where it saves nothing)."""
    def choices(mode: str, useful: bool = True) -> list[bool]:
        return {"none": [False], "all": [True], "auto": [False, True] if budgeted and useful else [False]}[mode]
    return [KINDS[2 * r + o] for r in choices(recompute) for o in choices(offload, device != "cpu")]


def parts(kind: str) -> tuple[bool, bool]:
    """What a kind does: (recompute, offload)."""
    return "recompute" in kind, "offload" in kind


def kind_words(kind: str) -> str:
    """"recompute+offload" -> "recompute and offload", for messages."""
    return kind.replace("+", " and ")


def parse_bandwidth(text: str | float) -> float:
    """Bytes per second from 12e9, "12GB/s" or "11.2GiB/s" (sizes as ``gems.units.parse_size``)."""
    try:
        if isinstance(text, (int, float)) and not isinstance(text, bool):
            value = float(text)
        else:
            value = float(parse_size(re.sub(r"\s*/\s*s\s*$", "", str(text))))
    except GemsError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise GemsError(f"the host bandwidth must be a positive rate such as 12GB/s or 12e9, got {text!r}")
    return value
