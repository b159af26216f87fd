"""Models from third-party libraries, named by a prefix (on the command line, ``--model``)::

    torchvision:NAME        torchvision.models.get_model(NAME, weights=None, num_classes=N, **kw)
    timm:NAME               timm.create_model(NAME, pretrained=False, num_classes=N, **kw)
    smp:ARCH:ENCODER        segmentation_models_pytorch.create_model(ARCH, encoder_name=ENCODER,
                                encoder_weights=None, classes=N, **kw)

``build`` returns exactly the module the library builds; splitting it is the graph
front-end's job. Weights always start random: every rank builds the same model from the seed
without a download, and pretrained weights come in through ``load_initial_state`` from a file
every rank reads. timm and segmentation-models-pytorch are an optional extra, imported only when
their prefix is used, so ``gems`` itself never needs them.
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import nn

from gems.errors import GemsError

PREFIXES = ("torchvision", "timm", "smp")
FORMS = "torchvision:NAME, timm:NAME, smp:ARCH:ENCODER"
EXTRA = "pip install 'gems[models]'"

# Arguments each source sets itself, and what to do instead of passing them.
_WEIGHTS = "gems builds it with random weights; load pretrained ones with --init-from FILE (load_initial_state)"
_CLASSES = "the class count comes from num_classes (--num-classes)"


def is_source_spec(name: str) -> bool:
    """True when ``name`` starts with one of the third-party prefixes (they win over the
    ``package.module:factory`` form, so a package named ``timm`` needs ``timm.sub:factory``)."""
    prefix, sep, _ = name.partition(":")
    return bool(sep) and prefix in PREFIXES


def build_from_source(spec: str, num_classes: int, kw: dict[str, Any]) -> nn.Module:
    """Build the model ``spec`` names (see the module docstring) with ``num_classes`` outputs."""
    prefix, _, rest = spec.partition(":")
    return {"torchvision": _torchvision, "timm": _timm, "smp": _smp}[prefix](spec, rest, num_classes, kw)


def _torchvision(spec: str, name: str, num_classes: int, kw: dict[str, Any]) -> nn.Module:
    import torchvision  # noqa: PLC0415 - a hard dependency, but slow to import

    _check_name(spec, name, "torchvision:NAME, e.g. torchvision:resnet50")
    known = torchvision.models.list_models()
    if name.lower() not in known:
        raise GemsError(f"torchvision has no model {name!r}{_closest(name.lower(), known)}; "
                        "torchvision.models.list_models() lists them all.")
    fixed = {"weights": _WEIGHTS, "num_classes": _CLASSES}
    _check_fixed(spec, kw, fixed)
    builder = torchvision.models.get_model_builder(name.lower())
    return _call(spec, lambda: builder(weights=None, num_classes=num_classes, **kw), kw, _takes(builder, fixed))


def _timm(spec: str, name: str, num_classes: int, kw: dict[str, Any]) -> nn.Module:
    timm = _optional("timm", spec)
    _check_name(spec, name, "timm:NAME, e.g. timm:convnext_small")
    if not timm.is_model(name):
        raise GemsError(f"timm has no model {name!r}{_closest(name, timm.list_models())}; "
                        "timm.list_models() lists them all.")
    fixed = {"pretrained": _WEIGHTS, "num_classes": _CLASSES}
    _check_fixed(spec, kw, fixed)
    builder = timm.models.model_entrypoint(name.split(".")[0])   # "name.tag" names a pretrained variant
    return _call(spec, lambda: timm.create_model(name, pretrained=False, num_classes=num_classes, **kw), kw,
                 _takes(builder, fixed))


def _smp(spec: str, rest: str, num_classes: int, kw: dict[str, Any]) -> nn.Module:
    smp = _optional("segmentation_models_pytorch", spec)
    arch, _, encoder = rest.partition(":")
    if not arch or not encoder:
        raise GemsError(f"{spec!r} must name an architecture and an encoder: smp:ARCH:ENCODER, "
                        "e.g. smp:Unet:resnet34.")
    archs = {cls.__name__.lower(): cls for cls in smp.MODEL_ARCHITECTURES_MAPPING.values()}
    if arch.lower() not in archs:
        close = difflib.get_close_matches(arch.lower(), archs, n=5) or list(archs)
        raise GemsError(f"segmentation_models_pytorch has no architecture {arch!r}; choose one of "
                        f"{', '.join(archs[name].__name__ for name in close)}.")
    _check_encoder(spec, encoder, smp)
    fixed = {"encoder_name": "the encoder is the spec's last part (smp:ARCH:ENCODER)",
             "encoder_weights": _WEIGHTS, "classes": _CLASSES}
    _check_fixed(spec, kw, fixed)
    takes = _takes(archs[arch.lower()], fixed)
    # The architecture passes arguments it does not name to a tu- (timm) encoder only; smp's own
    # encoders drop them silently, so a misspelt argument would change nothing without a word.
    timm_encoder = encoder.startswith("tu-")
    unknown = sorted(set(kw) - set(takes))
    if unknown and not timm_encoder:
        raise GemsError(f"{spec} does not take the argument {', '.join(unknown)}; it takes {', '.join(takes)}.")
    build = lambda: smp.create_model(arch, encoder_name=encoder, encoder_weights=None,  # noqa: E731
                                     classes=num_classes, **kw)
    return _call(spec, build, kw, takes, also="and passes others to the timm encoder" if timm_encoder else "")


def _check_encoder(spec: str, encoder: str, smp: ModuleType) -> None:
    """smp's own encoders, or ``tu-NAME`` for any timm model (smp's "timm universal" encoder)."""
    if encoder.startswith("tu-"):
        import timm  # noqa: PLC0415 - segmentation_models_pytorch depends on it

        if not timm.is_model(encoder[3:]):
            close = _closest(encoder[3:], timm.list_models(), prefix="tu-")
            raise GemsError(f"{spec}: timm has no model {encoder[3:]!r} for the tu- encoder{close}.")
    elif encoder not in smp.encoders.encoders:
        raise GemsError(f"segmentation_models_pytorch has no encoder {encoder!r}"
                        f"{_closest(encoder, list(smp.encoders.encoders))}; any timm model also works as "
                        "tu-NAME (e.g. tu-convnext_small).")


def _optional(package: str, spec: str) -> ModuleType:
    """Import an optional package, or say how to install it."""
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as error:
        if error.name != package:
            raise  # the package is there but one of its own imports is missing: show the real error
        raise GemsError(f"{spec} needs {package}, which is not installed: it comes with the optional extra: "
                        f"{EXTRA}.") from None


def _check_name(spec: str, name: str, form: str) -> None:
    if not name:
        raise GemsError(f"{spec!r} names no model; write {form}.")


def _check_fixed(spec: str, kw: dict[str, Any], fixed: dict[str, str]) -> None:
    """Refuse arguments the source sets itself, each with what to do instead."""
    for key, fix in fixed.items():
        if key in kw:
            raise GemsError(f"{spec} takes no {key} argument: {fix}.")


def _closest(name: str, known: list[str], prefix: str = "") -> str:
    """" (closest: a, b)" for an error message (up to 5 names), or "" when nothing is close."""
    close = difflib.get_close_matches(name, known, n=5)
    return f" (closest: {', '.join(prefix + c for c in close)})" if close else ""


def _takes(builder: Callable[..., Any], fixed: dict[str, str]) -> list[str]:
    """The keyword arguments ``builder`` accepts besides the ``fixed`` ones, as far as signatures
    say: its own named parameters, plus those of the model class it is annotated to return, since
    torchvision and timm builders forward ``**kwargs`` to that class (a class builder is its own
    ``__init__``)."""
    returned = inspect.signature(builder).return_annotation
    targets = [builder] + ([returned] if inspect.isclass(returned) and issubclass(returned, nn.Module) else [])
    names: list[str] = []
    for target in targets:
        for p in inspect.signature(target).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in fixed and p.name not in names:
                names.append(p.name)
    return names


def _call(spec: str, build: Callable[[], nn.Module], kw: dict[str, Any], takes: list[str],
          also: str = "") -> nn.Module:
    """Run ``build``; a TypeError about the user's arguments becomes one sentence naming them
    and, where the signatures tell, the arguments the builder takes."""
    try:
        return build()
    except TypeError as error:
        unexpected = re.search(r"unexpected keyword argument '(\w+)'", str(error))
        if not unexpected and not kw:
            raise   # nothing the user passed: a bug, keep the traceback
        listed = f"it takes {', '.join(takes)}" + (f" {also}" if also else "") if takes else ""
        if unexpected:
            raise GemsError(f"{spec} does not take the argument {unexpected.group(1)}"
                            + (f"; {listed}." if listed else ".")) from None
        raise GemsError(f"{spec} refused the arguments {kw} ({error}): check their names and types"
                        + (f" ({listed})." if listed else ".")) from None
