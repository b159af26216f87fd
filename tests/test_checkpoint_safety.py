"""Checkpoints under attack and accident: loading never runs code, damage is named and the previous
checkpoint is used instead, a full disk stops the run with the previous checkpoint intact, and
rotation never deletes the checkpoint just written.

Collective behaviour is tested in one process: ``ThreadComm`` runs each rank of ``save`` in a
thread, so a failure on one rank and the agreement of all ranks are checked without MPI. A real
full disk stops a real process; 2 real ranks resume past a damaged shard.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, run_mpi
from gems.train import checkpoint
from gems.train.checkpoint import CheckpointError
from gems.errors import GemsError

TRAIN = Path(sys.executable).parent / "gems-train"
TINY = "tests/assets/tiny_model.py:tiny"
BASE = ["--model", TINY, "--image-size", "32", "--workers", "0", "--no-progress", "--batch-size", "2"]
CUTS = [0, 2, 5]


class ThreadComm:
    """The collectives ``checkpoint.save`` uses, for ranks that are threads of this process."""

    def __init__(self, rank: int, shared: dict) -> None:
        self.rank, self.size, self.shared = rank, shared["size"], shared

    def allgather_object(self, obj):
        self.shared["slots"][self.rank] = obj
        self.shared["barrier"].wait(timeout=30)
        gathered = list(self.shared["slots"])
        self.shared["barrier"].wait(timeout=30)  # nobody overwrites a slot before all have read
        return gathered


def engine(rank: int, shared: dict) -> SimpleNamespace:
    """What ``save`` reads of an Engine: K=2, one group, rank r holds stage r."""
    def stage_state(stage: int) -> dict:
        return {"model": {f"{stage}.weight": torch.full((4, 4), float(stage))},
                "optimizer": {}, "param_groups": [{"lr": 0.1}]}
    return SimpleNamespace(comm=ThreadComm(rank, shared), group=0, position=rank, tile=0,
                           plan=SimpleNamespace(cuts=CUTS, shard_optimizer=False), stage_state=stage_state)


def save_on_all_ranks(directory: Path, step: int, keep: int = 0, ranks: int = 2) -> list:
    """Run ``save`` on every (thread) rank; each rank's return value or exception."""
    shared = {"size": ranks, "slots": [None] * ranks, "barrier": threading.Barrier(ranks)}
    results: list = [None] * ranks

    def one(rank: int) -> None:
        try:
            results[rank] = checkpoint.save(engine(rank, shared), directory, step, {"model": "m"}, keep)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[rank] = exc
    threads = [threading.Thread(target=one, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hangs in save"
    return results


def rechecksum(path: Path, name: str) -> None:
    """Make the manifest agree with ``name``'s current bytes (a deliberate replacement)."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["shards"][name] = hashlib.sha256((path / name).read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture
def two_saved(tmp_path) -> Path:
    for step in (1, 2):
        assert all(isinstance(r, Path) for r in save_on_all_ranks(tmp_path, step))
    return tmp_path


def test_a_save_loads_back_and_verifies(two_saved):
    path, warnings = checkpoint.newest_intact(two_saved)
    assert path.name == "step-00000002" and warnings == []
    manifest, model, _, groups = checkpoint.load_stages(path)
    assert manifest["step"] == 2 and torch.equal(model["1.weight"], torch.ones(4, 4)) and groups == [{"lr": 0.1}]


def flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x10
    file.write_bytes(bytes(data))


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:100])


def random_bytes(file: Path) -> None:
    file.write_bytes(os.urandom(3000))


def other_torch_file(file: Path) -> None:
    torch.save({"weights": torch.zeros(3)}, file)


def remove(file: Path) -> None:
    file.unlink()


@pytest.mark.parametrize("damage, name, problem", [
    (flip, "stage-1.pt", "shard stage-1.pt does not match its checksum"),
    (truncate, "stage-0.pt", "shard stage-0.pt does not match its checksum"),
    (random_bytes, "stage-1.pt", "shard stage-1.pt does not match its checksum"),
    (other_torch_file, "stage-0.pt", "shard stage-0.pt does not match its checksum"),
    (flip, "rng-rank-1.pt", "shard rng-rank-1.pt does not match its checksum"),
    (remove, "stage-1.pt", "shard stage-1.pt is missing"),
    (truncate, "manifest.json", "manifest.json is unreadable or incomplete"),
])
def test_a_damaged_checkpoint_is_named_and_the_previous_one_is_used(two_saved, damage, name, problem):
    newest = two_saved / "step-00000002"
    damage(newest / name)
    path, warnings = checkpoint.newest_intact(two_saved)
    assert path.name == "step-00000001"
    assert len(warnings) == 1 and str(newest) in warnings[0] and problem in warnings[0], warnings
    assert "previous complete checkpoint, step-00000001" in warnings[0]
    if name.startswith("stage"):
        with pytest.raises(GemsError, match=problem):
            checkpoint.load_stages(newest)


def test_when_every_checkpoint_is_damaged_resume_is_refused_naming_each(two_saved):
    flip(two_saved / "step-00000002" / "stage-0.pt")
    remove(two_saved / "step-00000001" / "rng-rank-0.pt")
    with pytest.raises(GemsError, match="no intact checkpoint") as caught:
        checkpoint.newest_intact(two_saved)
    assert "step-00000002: shard stage-0.pt" in str(caught.value)
    assert "step-00000001: shard rng-rank-0.pt is missing" in str(caught.value)


class Evil:
    """Unpickling it would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_loading_never_runs_code_even_with_a_matching_checksum(two_saved, tmp_path):
    newest, marker = two_saved / "step-00000002", tmp_path / "pwned"
    torch.save({"model": Evil(marker), "optimizer": {}, "param_groups": []}, newest / "stage-0.pt")
    rechecksum(newest, "stage-0.pt")
    with pytest.raises(GemsError, match="was refused: it holds Python objects other than tensors"):
        checkpoint.load_stages(newest)
    assert not marker.exists()


def test_a_foreign_torch_file_with_a_matching_checksum_is_refused_by_kind(two_saved):
    newest = two_saved / "step-00000002"
    other_torch_file(newest / "stage-1.pt")
    rechecksum(newest, "stage-1.pt")
    with pytest.raises(GemsError, match="stage-1.pt is not a gems stage shard"):
        checkpoint.load_stages(newest)


def no_space(path: Path, write) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path.name)


def fail_writing(monkeypatch, name: str, how=no_space) -> None:
    real = checkpoint._write_atomic
    monkeypatch.setattr(checkpoint, "_write_atomic",
                        lambda path, write: how(path, write) if path.name == name else real(path, write))


@pytest.mark.parametrize("name, where", [("stage-1.pt", "writing stage-1.pt on rank 1"),
                                         ("manifest.json", "writing manifest.json on rank 0")])
def test_a_full_disk_fails_the_save_on_every_rank_and_keeps_the_previous_one(two_saved, monkeypatch, name, where):
    fail_writing(monkeypatch, name)
    results = save_on_all_ranks(two_saved, 3, keep=1)
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert len({str(r) for r in results}) == 1
    assert str(results[0]) == (f"checkpoint step-00000003 not written: no space left on device (ENOSPC) {where} in "
                               f"{two_saved}; the previous checkpoint step-00000002 is kept: free space there or "
                               "choose another --checkpoint-dir, then --resume")
    assert not (two_saved / "step-00000003").exists()   # nothing half-written stays behind
    assert checkpoint.newest_intact(two_saved) == (two_saved / "step-00000002", [])
    assert (two_saved / "step-00000001").exists()        # keep=1 rotation did not run


def test_torch_save_reports_a_full_disk_as_a_runtime_error_and_it_is_still_recognised(two_saved, monkeypatch):
    def torch_save_on_a_full_disk(obj, f):
        f.write(b"PK\x03\x04 partial")
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:  # what torch does: the writer's RuntimeError has the OSError as context
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904
    monkeypatch.setattr(checkpoint.torch, "save", torch_save_on_a_full_disk)
    results = save_on_all_ranks(two_saved, 3)
    assert all(isinstance(r, CheckpointError) and "(ENOSPC) writing stage-" in str(r) for r in results), results
    assert not (two_saved / "step-00000003").exists()
    assert not list(two_saved.rglob("*.tmp"))


def test_a_bug_while_saving_is_not_mistaken_for_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint.torch, "save", lambda obj, f: (_ for _ in ()).throw(TypeError("a bug")))
    (result,) = save_on_all_ranks(tmp_path, 1, ranks=1)
    assert isinstance(result, TypeError)


def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    for step in (1, 2, 3):
        save_on_all_ranks(tmp_path, step, keep=2)
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step-00000002", "step-00000003"]
    save_on_all_ranks(tmp_path, 9, keep=1)            # a later step from an earlier run ...
    save_on_all_ranks(tmp_path, 4, keep=1)            # ... must not make rotation delete this one
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step-00000004"]
    (tmp_path / "step-00000005").mkdir()               # an interrupted save: not complete, never counted
    save_on_all_ranks(tmp_path, 6, keep=1)
    assert [p.name for p in checkpoint.complete(tmp_path)] == ["step-00000006"]


def single(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TRAIN), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 100 KiB tmpfs: room for one checkpoint of the tiny model, not two. Skipped where mounting
    is not permitted."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_real_full_disk_stops_training_with_one_line_and_the_previous_checkpoint_resumes(tiny_tmpfs):
    args = [*BASE, "--stages", "1", "--schedule", "mp", "--checkpoint-dir", str(tiny_tmpfs), "--checkpoint-every", "1"]
    full = single(*args, "--steps", "3")
    print(full.stderr)
    assert full.returncode == 1, full.stderr
    assert full.stderr.strip() == (
        f"gems-train: error: checkpoint step-00000002 not written: no space left on device (ENOSPC) writing "
        f"stage-0.pt on rank 0 in {tiny_tmpfs}; the previous checkpoint step-00000001 is kept: free space there "
        "or choose another --checkpoint-dir, then --resume")
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["config.toml", "step-00000001"]
    subprocess.run(["mount", "-o", "remount,size=1m", str(tiny_tmpfs)], check=True)
    resumed = single(*args, "--steps", "2", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 1" in resumed.stdout


def train_on_loopback_ranks(argv: list, ranks: int, monkeypatch) -> list:
    """gems-train's loop (trainer.prepare, trainer.run) on ``ranks`` loopback ranks, threads of this
    process: each rank's exit status. Signal handlers belong to the main thread, so none is installed;
    ``prepare`` (which never communicates) runs one rank at a time: its checks are made for ranks that
    are processes (a probe file named by the process id, the model's file loaded once)."""
    from gems.cli.train import parse  # noqa: PLC0415
    from gems.comm import loopback  # noqa: PLC0415
    from gems.train import trainer  # noqa: PLC0415

    monkeypatch.setattr(trainer, "_Signals", lambda: SimpleNamespace(caught=0))
    cfg, one_at_a_time = parse([str(a) for a in argv]), threading.Lock()

    def rank(comm) -> int:
        with one_at_a_time:
            job = trainer.prepare(cfg, comm)
        return trainer.run(job)
    return loopback.run(ranks, rank, timeout=60)


def test_two_ranks_resume_from_the_same_checkpoint_when_one_shard_is_damaged(tmp_path, monkeypatch):
    """Rank 0 never reads stage-1.pt, yet it must fall back with rank 1: every rank checks every file.
    The checkpoints are written in process (2 loopback ranks, the same run); the resume is 2 real ranks."""
    ck = tmp_path / "ck"
    args = [*BASE, "--batch-size", "4", "--stages", "2", "--checkpoint-dir", ck, "--checkpoint-every", "1"]
    monkeypatch.chdir(REPO)   # the model's path is relative to the repository
    assert train_on_loopback_ranks([*args, "--steps", "2"], 2, monkeypatch) == [0, 0]
    assert [p.name for p in checkpoint.complete(ck)] == ["step-00000001", "step-00000002"]
    flip(ck / "step-00000002" / "stage-1.pt")
    result = run_mpi(2, TRAIN, *args, "--steps", "3", "--resume", timeout=180)
    print(result.stderr)
    assert f"resumed from {ck / 'step-00000001'} at step 1" in result.stdout
    assert result.stderr.count("gems-train: warning: checkpoint") == 1
    assert "shard stage-1.pt does not match its checksum" in result.stderr
