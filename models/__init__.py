"""Model builders: gems' own zoo, third-party libraries, and the user's factories.

Each zoo classifier is an ``nn.Sequential`` of coarse units gems may cut between (the U-Net, with
its long skips, is a plain module that gems traces). A unit is a piece
whose inside cannot be cut (a stem, a residual block, an AmoebaNet cell, a head), so a partition
is just a list of cut points. Boundary convention: each unit's forward takes exactly what the
previous unit returned, a tensor or a tuple of tensors (AmoebaNet cells pass ``(prev, cur)``),
so the whole ``nn.Sequential`` runs unchanged on one device. Dim 0 of every tensor is the batch.

``torchvision:``, ``timm:`` and ``smp:`` names (``sources``) and user factories (``user``) give
whatever module their builder returns, unchanged. Models know nothing of stages, ranks or
devices; ``load_initial_state`` (``init_state``) starts one from a saved state dict.

    >>> from gems.models import build
    >>> model = build("resnet50", num_classes=10)
    >>> model = build("preact-resnet", depth=1001)
    >>> model = build("timm:convnext_small", num_classes=10, drop_path_rate=0.1)
    >>> model = build("smp:Unet:resnet34", num_classes=2)
    >>> model = build("my_models.py:make_net", num_classes=2)     # your own factory
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from gems.errors import GemsError
from .amoebanet import amoebanet_d
from .init_state import load_initial_state
from .preact_resnet import preact_resnet
from .resnet import resnet, torchvision_state_dict
from .unet import unet
from .sources import FORMS, build_from_source, is_source_spec
from .user import SYNTAX, build_user_model, is_user_spec

__all__ = ["build", "load_initial_state", "names", "torchvision_state_dict"]

# name -> (builder, arguments the name fixes). Other builder arguments are the name's options.
_REGISTRY: dict[str, tuple[Callable[..., nn.Module], dict[str, Any]]] = {
    **{f"resnet{d}": (resnet, {"depth": d}) for d in (18, 34, 50, 101, 152)},
    "wide-resnet50-2": (resnet, {"depth": 50, "width_per_group": 128}),
    "wide-resnet101-2": (resnet, {"depth": 101, "width_per_group": 128}),
    "preact-resnet": (preact_resnet, {}),
    "preact-resnet110": (preact_resnet, {"depth": 110}),
    "preact-resnet164": (preact_resnet, {"depth": 164}),
    "preact-resnet1001": (preact_resnet, {"depth": 1001}),
    "amoebanet-d": (amoebanet_d, {}),
    "unet": (unet, {}),
}


def names() -> list[str]:
    """The registered model names, in registry order."""
    return list(_REGISTRY)


def options(name: str) -> dict[str, Any]:
    """The keyword options of a registered model with their defaults (for CLI help)."""
    builder, fixed = _lookup(name)
    return {p.name: p.default for p in inspect.signature(builder).parameters.values()
            if p.name not in fixed and p.name != "num_classes"}


def build(name: str, num_classes: int = 1000, **kw: Any) -> nn.Module:
    """Build model ``name`` with ``num_classes`` outputs and builder keyword arguments ``kw``:
    a zoo name (see ``names()``, an ``nn.Sequential`` of units), ``torchvision:NAME``, ``timm:NAME``,
    ``smp:ARCH:ENCODER`` (see ``sources``), or a user factory ``file.py:factory`` /
    ``package.module:factory``; the last four return exactly what their builder returns."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise GemsError(f"num_classes must be a positive integer; got {num_classes!r}.")
    if is_source_spec(name):
        return build_from_source(name, num_classes, kw)
    if is_user_spec(name):
        return build_user_model(name, num_classes, kw)
    builder, fixed = _lookup(name)
    clash = sorted(set(kw) & set(fixed))
    if clash:
        raise GemsError(f"{name} fixes {', '.join(clash)}; drop the option or use the general name "
                        f"(e.g. 'preact-resnet' with depth=...).")
    allowed = options(name)
    unknown = sorted(set(kw) - set(allowed))
    if unknown:
        raise GemsError(f"{name} has no option {', '.join(unknown)}; its options are: "
                        f"{', '.join(allowed) or 'none'}.")
    return builder(num_classes=num_classes, **fixed, **kw)


def _lookup(name: str) -> tuple[Callable[..., nn.Sequential], dict[str, Any]]:
    if name not in _REGISTRY:
        raise GemsError(f"unknown model {name!r}; choose one of {', '.join(_REGISTRY)}, a library's model as "
                        f"{FORMS}, or your own with {SYNTAX}.")
    return _REGISTRY[name]
