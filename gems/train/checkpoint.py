"""Checkpoints that survive a kill at any moment and load on any partition.

Layout::

    DIR/step-00000120/stage-0.pt ... stage-{K-1}.pt   one shard per stage (model + optimizer)
                     rng-rank-{R}.pt                  every rank's RNG state
                     manifest.json                    written last: step, plan, shard checksums,
                                                      the run's configuration and environment
    DIR/config.toml                                   the latest launch's configuration (--config)

Group 0's position s writes stage s (every copy of a stage is identical after the sync,
so one writer per stage suffices). Each file is written under a temporary name, flushed
to disk and renamed; rank 0 writes the manifest only after every shard is in place, so a
directory without a manifest is an interrupted save and is ignored: the previous
checkpoint stays the newest complete one. Shards are keyed by the model's own parameter
names, so a checkpoint loads on another K or D, and ``export`` merges it into one plain
``state_dict`` file.

Damage and failures:

* Loading never runs code: shards are read with ``weights_only=True`` (tensors and plain data);
  a shard holding other Python objects is refused, and so is any shard whose SHA-256 differs
  from the manifest's (truncated, bit-flipped, or another file put in its place), by name.
* ``--resume`` takes the newest *intact* complete checkpoint (:func:`newest_intact` checks every
  file the manifest lists, on every rank, so all ranks choose the same one); each newer damaged
  checkpoint is named in a warning, with the shard at fault, and left in place for inspection
  (until a save of the same step replaces it).
* A save that fails for lack of space (ENOSPC, EDQUOT) or any other I/O error raises
  :class:`CheckpointError` on every rank alike: the half-written directory is removed, no
  manifest is written, the previous checkpoint stays the newest, and ``gems-train`` stops
  with status 1 naming the step, the cause, the directory and the checkpoint kept.
* ``keep`` rotation deletes only other checkpoints, never the one just written.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pickle
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from gems.errors import GemsError

MANIFEST = "manifest.json"
CONFIG = "config.toml"    # beside the step directories: the latest launch's configuration
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (disk full, quota, I/O error); the previous one is kept."""


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: torch.save reports a failed write as a RuntimeError whose
    context is the OSError, e.g. ENOSPC."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _write_atomic(path: Path, write) -> None:
    """Write ``path`` through a temporary file, flushed to disk, then renamed into place; on
    failure remove the temporary file and raise the OSError behind it (naming the file)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        cause = _os_error(exc)
        if cause is None:
            raise
        raise OSError(cause.errno, cause.strerror, path.name) from exc


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
        probe = d / f".write-test-{os.getpid()}-{threading.get_ident()}"   # ranks may be threads (loopback)
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


def _reason(error: OSError) -> str:
    """"no space left on device (ENOSPC) writing stage-1.pt"."""
    code = errno.errorcode.get(error.errno, str(error.errno))
    what = (error.strerror or os.strerror(error.errno or 0)).lower()
    return f"{what} ({code})" + (f" writing {error.filename}" if error.filename else "")


def _attempt(rank: int, work: Callable[[], None]) -> str | None:
    """Run ``work``; None if it succeeded, the reason if the file system refused (any other
    exception is a bug and propagates)."""
    try:
        work()
    except OSError as error:
        return f"{_reason(error)} on rank {rank}"
    return None


def save(engine, directory: str | os.PathLike, step: int, meta: dict, keep: int = 0) -> Path:
    """Collective: every rank calls it after the same step. Returns the checkpoint path.

    Raises CheckpointError on every rank if any rank's write failed (see the module docstring)."""
    comm = engine.comm
    directory = Path(directory)
    path = directory / f"step-{step:08d}"
    earlier = [p for p in complete(directory) if p != path]

    def settle(files: dict[str, str], failure: str | None) -> dict[str, str]:
        """Every rank's written files, merged; CheckpointError everywhere if any rank failed."""
        gathered = comm.allgather_object((files, failure))
        failures = [f for _, f in gathered if f is not None]
        if failures:
            if comm.rank == 0:  # never leave a half-written checkpoint behind (it also holds space)
                shutil.rmtree(path, ignore_errors=True)
            kept = (f"the previous checkpoint {earlier[-1].name} is kept" if earlier
                    else "there is no earlier checkpoint")
            raise CheckpointError(f"checkpoint {path.name} not written: {failures[0]} in {directory}; {kept}: "
                                  "free space there or choose another --checkpoint-dir, then --resume")
        return {name: digest for part, _ in gathered for name, digest in part.items()}

    def fresh_directory() -> None:
        if path.exists():  # an interrupted save of the same step, or a re-run: start clean
            shutil.rmtree(path)
        path.mkdir(parents=True)

    settle({}, _attempt(comm.rank, fresh_directory) if comm.rank == 0 else None)
    files: dict[str, str] = {}
    # a sharded optimizer's state is gathered from the whole sync group: every rank takes part
    shard = engine.stage_state(engine.position) if engine.plan.shard_optimizer else None

    def write_files() -> None:
        if engine.group == 0 and not engine.tile:   # a tile group's members hold copies of the leader's
            name = f"stage-{engine.position}.pt"
            state = shard if shard is not None else engine.stage_state(engine.position)
            _write_atomic(path / name, lambda f: torch.save(state, f))
            files[name] = _sha256(path / name)
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        name = f"rng-rank-{comm.rank}.pt"
        _write_atomic(path / name, lambda f: torch.save(rng, f))
        files[name] = _sha256(path / name)

    shards = settle(files, _attempt(comm.rank, write_files))
    failure = None
    if comm.rank == 0:
        manifest = {"format": FORMAT, "step": step, "world": comm.size, "cuts": list(engine.plan.cuts),
                    "shards": dict(sorted(shards.items())), **meta}
        failure = _attempt(0, lambda: _write_atomic(
            path / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode())))
        if failure is None and keep > 0:
            others = [p for p in complete(directory) if p != path]
            for old in others[:max(0, len(others) - (keep - 1))]:
                shutil.rmtree(old, ignore_errors=True)
    settle({}, failure)
    return path


def write_config(directory: str | os.PathLike, text: str) -> Path:
    """``config.toml`` beside the checkpoints: the launch's resolved configuration (``--config``
    reads it back), replaced atomically once per launch."""
    path = Path(directory) / CONFIG
    Path(directory).mkdir(parents=True, exist_ok=True)
    _write_atomic(path, lambda f: f.write(text.encode()))
    return path


def _is_int_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of checkpoint ``path``, checked for the fields loading relies on."""
    p = Path(path) / MANIFEST
    try:
        manifest = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise GemsError(f"{p} is not a readable gems manifest ({e}): point --resume at a checkpoint "
                        "directory written by gems-train") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise GemsError(f"{p} is not a gems checkpoint manifest of format {FORMAT}")
    shards, cuts = manifest.get("shards"), manifest.get("cuts")
    if not (isinstance(manifest.get("step"), int) and isinstance(manifest.get("world"), int)
            and _is_int_list(cuts) and len(cuts) >= 2
            and isinstance(shards, dict) and all(isinstance(v, str) for v in shards.values())
            and all(f"stage-{s}.pt" in shards for s in range(len(cuts) - 1))):
        raise GemsError(f"{p} lacks its step, world, cuts or the checksum of every stage shard (damaged or "
                        "edited): resume from an older checkpoint")
    return manifest


def _verify(path: Path, name: str, manifest: dict) -> str | None:
    """Why file ``name`` of checkpoint ``path`` is not what the manifest says, or None."""
    file = path / name
    expected = manifest["shards"].get(name)
    if expected is None:
        return f"the manifest lists no shard {name}"
    if not file.is_file():
        return f"shard {name} is missing"
    try:
        actual = _sha256(file)
    except OSError as e:
        return f"shard {name} cannot be read ({e.strerror})"
    if actual != expected:
        return f"shard {name} does not match its checksum (truncated, bit-flipped or replaced)"
    return None


# What each kind of file holds at its top level: a file passing its checksum but of another kind
# (a foreign torch file put in place together with a rewritten manifest) is refused by name too.
_KEYS = {"stage": ("model", "optimizer", "param_groups"), "rng": ("torch",)}


def _load(path: Path, name: str, manifest: dict):
    problem = _verify(path, name, manifest)
    if problem is not None:
        raise GemsError(f"checkpoint {path} is damaged: {problem}: resume from an older checkpoint")
    file = path / name
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise GemsError(f"checkpoint shard {file} was refused: it holds Python objects other than tensors "
                        "and plain data, and loading those could run code; resume from a checkpoint "
                        "written by gems-train") from None
    except Exception as e:  # noqa: BLE001 - any other failure to read means the file is unusable
        raise GemsError(f"checkpoint shard {file} cannot be read ({type(e).__name__}): "
                        "resume from an older checkpoint") from None
    keys = _KEYS["stage" if name.startswith("stage-") else "rng"]
    if not isinstance(data, dict) or any(k not in data for k in keys):
        raise GemsError(f"checkpoint shard {file} is not a gems {name.split('-')[0]} shard (no "
                        f"{'/'.join(keys)} entries): resume from a checkpoint written by gems-train")
    return data


def damage(path: str | os.PathLike) -> str | None:
    """Why checkpoint ``path`` cannot be resumed from (an unreadable manifest, a missing file, a
    checksum that differs), or None when every file its manifest lists is intact. Reads every
    shard once (SHA-256)."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
    except GemsError:
        return f"its {MANIFEST} is unreadable or incomplete"
    for name in manifest["shards"]:
        problem = _verify(path, name, manifest)
        if problem is not None:
            return problem
    return None


def newest_intact(directory: str | os.PathLike) -> tuple[Path, list[str]]:
    """The newest complete checkpoint in ``directory`` whose files are all intact, and one
    warning per newer complete checkpoint skipped because it is damaged (naming the file at
    fault). Every rank reaches the same answer from the same files, with no communication.
    GemsError when there is no complete checkpoint, or when all are damaged."""
    found = complete(directory)
    if not found:
        raise GemsError(f"--resume found no complete checkpoint in {directory}: drop --resume to start fresh")
    damaged: list[tuple[Path, str]] = []
    for path in reversed(found):
        problem = damage(path)
        if problem is None:
            warnings = [f"checkpoint {p} is damaged: {why}. Resuming from the previous complete checkpoint, "
                        f"{path.name}; move the damaged one away once inspected" for p, why in damaged]
            return path, warnings
        damaged.append((path, problem))
    listing = "; ".join(f"{p.name}: {why}" for p, why in damaged)
    raise GemsError(f"--resume found no intact checkpoint in {directory} ({listing}): restore the files or "
                    "drop --resume to start fresh")


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
