"""Checkpoints that survive a kill at any moment and load on any partition.

Layout::

    DIR/step-00000120/stage-0.pt ... stage-{K-1}.pt   one shard per stage (model + optimizer)
                     rng-rank-{R}.pt                  every rank's RNG state
                     manifest.json                    written last: step, plan, shard checksums

Group 0's position s writes stage s (every copy of a stage is identical after the sync,
so one writer per stage suffices). Each file is written under a temporary name, flushed
to disk and renamed; rank 0 writes the manifest only after every shard is in place, so a
directory without a manifest is an interrupted save and is ignored: the previous
checkpoint stays the newest complete one. Shards are keyed by the model's own parameter
names, so a checkpoint loads on another K or D, and ``export`` merges it into one plain
``state_dict`` file. Loading reads tensors and plain data only (``weights_only=True``)
and checks every shard against the manifest's SHA-256.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from gems.errors import GemsError

MANIFEST = "manifest.json"
FORMAT = 1


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_writable(directory: str | os.PathLike) -> Path:
    """Fail at start, not at the first save, when checkpoints cannot be written."""
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise GemsError(f"cannot write checkpoints to {d} ({e.strerror}): choose a writable "
                        "--checkpoint-dir") from None
    return d


def complete(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (those with a manifest), oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(p for p in d.glob("step-*") if (p / MANIFEST).is_file())


def save(engine, directory: str | os.PathLike, step: int, meta: dict, keep: int = 0) -> Path:
    """Collective: every rank calls it after the same step. Returns the checkpoint path."""
    comm = engine.comm
    path = Path(directory) / f"step-{step:08d}"
    if comm.rank == 0:
        if path.exists():  # an interrupted save of the same step, or a re-run: start clean
            shutil.rmtree(path)
        path.mkdir(parents=True)
    comm.barrier()
    files: dict[str, str] = {}
    if engine.group == 0:
        name = f"stage-{engine.position}.pt"
        state = engine.stage_state(engine.position)
        _write_atomic(path / name, lambda f: torch.save(state, f))
        files[name] = _sha256(path / name)
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    name = f"rng-rank-{comm.rank}.pt"
    _write_atomic(path / name, lambda f: torch.save(rng, f))
    files[name] = _sha256(path / name)
    shards: dict[str, str] = {}
    for part in comm.allgather_object(files):
        shards.update(part)
    if comm.rank == 0:
        manifest = {"format": FORMAT, "step": step, "world": comm.size, "cuts": list(engine.plan.cuts),
                    "shards": dict(sorted(shards.items())), **meta}
        _write_atomic(path / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        if keep > 0:
            for old in complete(directory)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    comm.barrier()
    return path


def read_manifest(path: str | os.PathLike) -> dict:
    p = Path(path) / MANIFEST
    try:
        manifest = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise GemsError(f"{p} is not a readable gems manifest ({e}): point --resume at a checkpoint "
                        "directory written by gems-train") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise GemsError(f"{p} is not a gems checkpoint manifest of format {FORMAT}")
    return manifest


def _load(path: Path, name: str, manifest: dict):
    file = path / name
    expected = manifest["shards"].get(name)
    if not file.is_file() or expected is None:
        raise GemsError(f"checkpoint {path} lacks shard {name}: it is incomplete, resume from an older one")
    if _sha256(file) != expected:
        raise GemsError(f"checkpoint shard {file} does not match its checksum (corrupt or changed): "
                        "resume from an older checkpoint")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is unusable
        raise GemsError(f"checkpoint shard {file} cannot be read ({type(e).__name__}): "
                        "resume from an older checkpoint") from None


def load_stages(path: str | os.PathLike, units: range | None = None) -> tuple[dict, dict, dict, list]:
    """Read (manifest, model state, optimizer state by name, param groups) of the stages
    that overlap ``units`` (all stages when None), verifying each shard's checksum."""
    path = Path(path)
    manifest = read_manifest(path)
    cuts = manifest["cuts"]
    model: dict = {}
    optimizer: dict = {}
    groups: list = []
    for s in range(len(cuts) - 1):
        if units is not None and (cuts[s + 1] <= units.start or cuts[s] >= units.stop):
            continue
        shard = _load(path, f"stage-{s}.pt", manifest)
        model.update(shard["model"])
        optimizer.update(shard["optimizer"])
        groups = shard["param_groups"]
    return manifest, model, optimizer, groups


def restore_rng(path: str | os.PathLike, manifest: dict, engine) -> None:
    """Restore this rank's RNG state when the launch matches the checkpoint's layout
    (a re-partitioned resume has no per-rank state to take)."""
    if manifest["world"] != engine.comm.size or list(manifest["cuts"]) != list(engine.plan.cuts):
        return
    rng = _load(Path(path), f"rng-rank-{engine.comm.rank}.pt", manifest)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def export(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Merge a checkpoint's stage shards into one plain ``state_dict`` file for inference."""
    _, model, _, _ = load_stages(path)
    out = Path(out)
    _write_atomic(out, lambda f: torch.save(model, f))
    return out
