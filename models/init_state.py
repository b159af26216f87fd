"""Initial weights from a file: ``load_initial_state(model, "resnet50.safetensors", exclude=["fc.*"])``.

Fine-tuning starts from someone else's weights (a torchvision, timm or smp checkpoint, or a
``gems-export``), loaded into the freshly built model before anything else sees it, so every rank
starts from the same parameters. Loading is strict: every key of the model must come from the
file and every key of the file must land in the model, with the same shapes, except keys that
match an ``exclude`` glob (``fnmatch``: ``fc.*``, ``*.head.*``) on either side, which keep their
initial values -- a classifier head of another size. Files are read without running their
code: ``torch.load(weights_only=True)`` for ``.pt``/``.pth``, ``safetensors`` for
``.safetensors``.
"""
from __future__ import annotations

import fnmatch
import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from gems.errors import GemsError

SHOWN = 5   # keys listed per kind of mismatch; the counts say how many there are


def load_initial_state(model: nn.Module, path: str | Path, exclude: Iterable[str] = ()) -> None:
    """Load the state dict in ``path`` into ``model`` strictly, leaving keys that match an
    ``exclude`` glob at their initial values; a mismatch raises GemsError listing the keys."""
    globs = list(exclude)
    state = read_state_dict(path)
    own = model.state_dict()
    unmatched = [g for g in globs if not any(fnmatch.fnmatchcase(k, g) for k in (*own, *state))]
    if unmatched:
        raise GemsError(f"--init-exclude {unmatched[0]!r} matches no key of the model or of {path}; "
                        f"exclude keys by their names, e.g. {_example(own)}.")

    def kept(key: str) -> bool:
        return not any(fnmatch.fnmatchcase(key, g) for g in globs)

    wanted = {k for k in own if kept(k)}
    given = {k: v for k, v in state.items() if kept(k)}
    missing = sorted(wanted - given.keys())
    unexpected = sorted(given.keys() - wanted)
    reshaped = [f"{k} (file {_shape(given[k])}, model {_shape(own[k])})" for k in sorted(wanted & given.keys())
                if isinstance(own[k], torch.Tensor) and given[k].shape != own[k].shape]
    head = _head(own, given, wanted & given.keys())
    if head and not (missing or unexpected):
        key, file_rows, model_rows = head
        raise GemsError(f"{path} has a head ({key}) of {file_rows} outputs but the model's has {model_rows} "
                        f"(another number of classes): leave the head at its initial values with "
                        f"--init-exclude '{key}.*' (exclude=[...])")
    if missing or unexpected or reshaped:
        parts = [f"{len(keys)} {kind} ({_first(keys)})" for kind, keys in
                 (("missing key(s)", missing), ("unexpected key(s)", unexpected), ("shape mismatch(es)", reshaped))
                 if keys]
        raise GemsError(f"{path} does not match the model: {', '.join(parts)}; load a file saved from the same "
                        "model, or leave the differing keys at their initial values with --init-exclude GLOB "
                        "(exclude=[...]).")
    model.load_state_dict(given, strict=False)   # strict by the checks above; excluded keys stay


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict in ``path``: a plain one, or one under a ``"state_dict"`` or ``"model"`` entry
    (how training scripts often save it next to optimizer state)."""
    file = Path(path)
    if not file.is_file():
        raise GemsError(f"--init-from file {path} does not exist; pass the path of a .pt, .pth or .safetensors "
                        "state dict.")
    loaded = _read_safetensors(file) if file.suffix == ".safetensors" else _read_torch(file)
    for candidate in (loaded, *(loaded.get(k) for k in ("state_dict", "model") if isinstance(loaded, Mapping))):
        if _is_state_dict(candidate):
            return dict(candidate)
    raise GemsError(f"{path} is not a state dict (it holds {_describe(loaded)}); save "
                    "torch.save(model.state_dict(), path), or a dict with the state dict under 'state_dict' or "
                    "'model'.")


def _read_torch(file: Path) -> object:
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise GemsError(f"{file} does not load with torch.load(weights_only=True) ({type(error).__name__}): it is "
                        "not a PyTorch file or holds pickled objects besides tensors (a whole model?); save "
                        "model.state_dict() instead.") from None


def _read_safetensors(file: Path) -> object:
    try:
        from safetensors import SafetensorError  # noqa: PLC0415 - an optional extra
        from safetensors.torch import load_file  # noqa: PLC0415
    except ModuleNotFoundError:
        raise GemsError(f"reading {file} needs safetensors, which is not installed: it comes with the optional "
                        "extra: pip install 'gems[models]'.") from None
    try:
        return load_file(file, device="cpu")
    except SafetensorError as error:
        raise GemsError(f"{file} is not a readable .safetensors file ({error}); check the file or save it "
                        "again.") from None


def _is_state_dict(value: object) -> bool:
    return (isinstance(value, Mapping) and bool(value)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items()))


def _describe(value: object) -> str:
    """What a file holds instead of a state dict, in a few words."""
    if isinstance(value, Mapping) and value:
        return f"a dict with keys {_first([repr(k) for k in value])}"
    return f"an empty {type(value).__name__}" if isinstance(value, (Mapping, list, tuple)) and not value \
        else f"a {type(value).__name__}"


def _first(keys: list[str]) -> str:
    return ", ".join(keys[:SHOWN]) + (", ..." if len(keys) > SHOWN else "")


def _head(own: dict, given: dict, common: set[str]) -> tuple[str, int, int] | None:
    """(module, file rows, model rows) when every shape mismatch is in one module and only in the
    first dimension -- a classifier head for another number of classes; else None."""
    differ = [k for k in common if isinstance(own[k], torch.Tensor) and given[k].shape != own[k].shape]
    modules = {k.rpartition(".")[0] for k in differ}
    if len(modules) != 1 or any(given[k].dim() == 0 or given[k].shape[1:] != own[k].shape[1:] for k in differ):
        return None
    return modules.pop(), given[differ[0]].shape[0], own[differ[0]].shape[0]


def _shape(tensor: torch.Tensor) -> str:
    return "x".join(map(str, tensor.shape)) or "scalar"


def _example(own: Mapping[str, object]) -> str:
    """A glob that would match the model's last module (usually its head), for the error message."""
    last = next(reversed(own), "fc.weight")
    return repr(last.rpartition(".")[0] + ".*" if "." in last else last)
