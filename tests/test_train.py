"""gems-train end to end: learning, data-parallel groups, folders with a corrupt file,
preemption signals, bad input. Kills -- of a rank mid-step or mid-checkpoint -- and the bit-exact
resume after them are tests/test_faults.py's."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from conftest import REPO, _descendants, _kill_tree, cli_cases, exit_status, mpiexec, run_mpi
from gems.cli import export, plan as gems_plan

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402

TRAIN = Path(sys.executable).parent / "gems-train"
TINY = "tests/assets/tiny_model.py:tiny"
BASE = ["--model", TINY, "--image-size", "32", "--workers", "0", "--no-progress", "--lr", "0.05"]


def losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def single(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """gems-train as one process (MPI singleton)."""
    return subprocess.run([sys.executable, str(TRAIN), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_two_ranks_mast_learns_and_exports(tmp_path):
    metrics = tmp_path / "m.jsonl"
    result = run_mpi(2, TRAIN, *BASE, "--batch-size", "8", "--stages", "2", "--steps", "30",
                     "--num-classes", "4", "--metrics", metrics, "--checkpoint-dir", tmp_path / "ck",
                     timeout=240)
    assert "gems-train: done" in result.stdout
    assert "per replica 1 micro-batch(es) x 4 images" in result.stdout
    summary = gpu_check.train_summary(result.stdout)   # what make gpu-check reports of such a run
    assert summary["images_per_s"] > 0 and [m["rank"] for m in summary["memory"]] == [0, 1]
    seen = losses(metrics)
    assert len(seen) == 30
    assert sum(seen[-5:]) / 5 < 0.6 * sum(seen[:5]) / 5, seen
    line = json.loads(metrics.read_text().splitlines()[-1])
    assert len(line["peak_memory"]) == 2 and line["skipped_images"] == 0
    out = tmp_path / "model.pt"
    assert exit_status(export.main, [tmp_path / "ck", out]) == 0   # gems-export, in this process
    sys.path.insert(0, str(REPO / "tests" / "assets"))
    from tiny_model import tiny  # noqa: PLC0415
    tiny(num_classes=4).load_state_dict(torch.load(out, weights_only=True))


def make_folder(root: Path) -> Path:
    from PIL import Image  # noqa: PLC0415
    for c, colour in enumerate(["red", "blue"]):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(4 - c):
            Image.new("RGB", (40, 36), colour).save(root / f"class{c}" / f"{i}.png")
    (root / "class1" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
    return root


def test_four_ranks_two_groups_on_a_folder_with_a_corrupt_file(tmp_path):
    metrics = tmp_path / "m.jsonl"
    result = run_mpi(4, TRAIN, *BASE, "--data", make_folder(tmp_path / "data"), "--batch-size", "4",
                     "--stages", "2", "--steps", "2", "--metrics", metrics, timeout=240)
    assert "gems-train: done" in result.stdout
    assert "4 = 2 group(s) x 2 images" in result.stdout
    assert "broken.png" in result.stderr
    assert json.loads(metrics.read_text().splitlines()[-1])["skipped_images"] == 1


def launch(args: list, ranks: int = 2) -> subprocess.Popen:
    return subprocess.Popen([mpiexec(), "-n", str(ranks), sys.executable, str(TRAIN), *map(str, args)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def ranks_of(proc: subprocess.Popen) -> list[int]:
    pids = []
    for pid in _descendants(proc.pid):
        try:
            if "gems-train" in Path(f"/proc/{pid}/cmdline").read_text():
                pids.append(pid)
        except OSError:
            pass
    return sorted(pids)


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        if proc.poll() is not None:
            pytest.fail(f"run ended early: {proc.communicate()}")
        time.sleep(0.1)
    _kill_tree(proc)
    pytest.fail("run made no progress")


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        pytest.fail("run did not end")
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def signalled(tmp_path_factory):
    """A 2-rank run (K = 2, mast) that SIGUSR1 reaches on every rank once it has logged two steps, as
    Slurm signals a job before its time limit: (exit status, stdout, checkpoint directory, saved step).
    The checkpoint it saves is resumed in ``one_process``, on another partition (a resume on the same
    2 ranks is tests/test_checkpoint_safety.py's and tests/test_faults.py's)."""
    root = tmp_path_factory.mktemp("signalled")
    proc = launch([*BASE, "--batch-size", "4", "--stages", "2", "--checkpoint-dir", root / "ck", "--steps", "400",
                   "--metrics", root / "m.jsonl"])
    wait_for_lines(root / "m.jsonl", 2, proc)
    for pid in ranks_of(proc):
        os.kill(pid, signal.SIGUSR1)
    code, out, _ = finish(proc)
    saved = sorted((root / "ck").glob("step-*/manifest.json"))
    return code, out, root / "ck", int(saved[-1].parent.name[5:]) if saved else None


def test_sigusr1_saves_and_exits_with_code_3(signalled, one_process):
    code, out, ck, step = signalled
    assert code == 3, out
    assert "stopped by signal" in out
    assert step is not None, out
    resumed = one_process["resume-partition"]   # the saved checkpoint resumes (on 1 rank: gpipe, a plan file)
    assert resumed["code"] == 0, resumed["stderr"]
    assert f"resumed from {ck / f'step-{step:08d}'} at step {step}" in resumed["stdout"]
    assert "gems-train: done" in resumed["stdout"]


BAD_INPUT = [
    (["--stages", "2"], "cannot form pipelines of 2 stages"),
    # one_process runs with CXX naming no compiler: inductor's C++ backend cannot work (gems.pipeline.compiled)
    (["--stages", "1", "--compile"], "--compile needs a C++ compiler for torch.compile's inductor backend on CPU"),
    (["--stages", "1", "--batch-size", "3"], "use a multiple of 2"),
    (["--stages", "1", "--model", "nosuchnet"], "nosuchnet"),
    (["--stages", "1", "--data", "/nonexistent/images"], "/nonexistent/images"),
    (["--stages", "1", "--steps", "2", "--epochs", "1"], "either --steps or --epochs"),
    (["--stages", "1", "--resume"], "--resume needs --checkpoint-dir"),
    (["--stages", "1", "--checkpoint-dir", "/proc/gems-checkpoints"], "choose a writable --checkpoint-dir"),
    (["--stages", "1", "--schedule", "zigzag"], "invalid choice"),
    (["--stages", "1", "--memory-budget", "40GB?"], "40GB?"),
    (["--stages", "1", "--memory-budget", "100KiB"], "no number of stages fits"),
    (["--stages", "1", "--memory-budget", "300KiB"], "does not fit --memory-budget 300.00 KiB: position 0"),
    (["--stages", "1", "--model-arg", "depth"], "--model-arg 'depth' must be KEY=VALUE"),
    (["--stages", "1", "--model-arg", "depth=3"], "does not accept depth"),
    (["--stages", "1", "--init-exclude", "fc.*"], "--init-exclude needs --init-from"),
    (["--stages", "1", "--init-from", "/nonexistent/w.pt"], "/nonexistent/w.pt does not exist"),
    (["--stages", "1", "--enforce-memory-budget"], "--enforce-memory-budget needs --memory-budget (or a --plan made "
                                                   "with one)"),
    (["--stages", "1", "--model", "unet", "--model-arg", "width=4", "--model-arg", "depth=2"],
     "scores per image (a class per pixel): pass --task segmentation"),
    (["--stages", "1", "--task", "segmentation"], "not a class per pixel: pass --task classification"),
]


def one_sentence(code, stderr: str, message: str) -> None:
    assert code == 2, stderr
    assert message in stderr
    assert "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, signalled):
    """This module's command lines for one process, by name, through gems-train's main in one process
    (conftest.cli_cases), in order: a checkpoint of one step, resumes it must refuse, a dry run, every
    BAD_INPUT, then ``signalled``'s checkpoint resumed on another partition (K = 1, gpipe) from a plan
    file gems-plan wrote, and that plan file under a schedule it was not made for. CXX names no compiler
    there, so --compile is bad input."""
    root = tmp_path_factory.mktemp("one-process")
    (root / "empty").mkdir()
    plan = root / "plan.json"
    with pytest.MonkeyPatch.context() as mp:   # gems-plan's main, in this process: the model's path is relative
        mp.chdir(REPO)
        assert exit_status(gems_plan.main, ["--model", TINY, "--image-size", "32", "--batch-size", "4", "--stages",
                                            "1", "--schedule", "gpipe", "--micro-batches", "2", "--json", plan]) == 0
    _, _, ck, step = signalled
    cases = {
        "checkpoint": [*BASE, "--batch-size", "2", "--stages", "1", "--schedule", "mp", "--steps", "1",
                       "--checkpoint-dir", root / "ck"],
        "resume-empty": [*BASE, "--batch-size", "2", "--stages", "1", "--resume", "--checkpoint-dir", root / "empty"],
        "resume-other": ["--model", "resnet18", "--image-size", "64", "--batch-size", "2", "--stages", "1",
                         "--workers", "0", "--resume", "--checkpoint-dir", root / "ck"],
        "dry-run": [*BASE, "--batch-size", "4", "--stages", "1", "--schedule", "gpipe", "--micro-batches", "2",
                    "--dry-run"],
        **{f"bad-{i}": [*BASE, "--batch-size", "2", *args] for i, (args, _) in enumerate(BAD_INPUT)},
        # the plan's layout (K = 1, gpipe, m = 2, batch 4) by --plan alone
        "resume-partition": [*BASE, "--plan", plan, "--steps", (step or 0) + 1, "--checkpoint-dir", ck, "--resume"],
        "plan-mismatch": [*BASE, "--schedule", "mast", "--plan", plan, "--steps", "1"],
    }
    return dict(zip(cases, cli_cases("gems.cli.train", list(cases.values()), env={"CXX": "/nonexistent/c++"})))


@pytest.mark.parametrize("index", range(len(BAD_INPUT)), ids=[m for _, m in BAD_INPUT])
def test_bad_input_is_one_sentence_and_exit_2(index, one_process):
    outcome = one_process[f"bad-{index}"]
    one_sentence(outcome["code"], outcome["stderr"], BAD_INPUT[index][1])


def test_bad_input_as_a_real_process():
    """The same promise through the installed command, once: the process's own exit status and
    stderr, from a check made after MPI started."""
    args, message = BAD_INPUT[0]
    result = single(*BASE, "--batch-size", "2", *args)
    one_sentence(result.returncode, result.stderr, message)


def test_resume_checks(one_process):
    assert one_process["checkpoint"]["code"] == 0, one_process["checkpoint"]["stderr"]
    empty, other = one_process["resume-empty"], one_process["resume-other"]
    assert empty["code"] == 2 and "no complete checkpoint" in empty["stderr"]
    assert other["code"] == 2 and "not resnet18" in other["stderr"], other["stderr"]
    assert "Traceback" not in empty["stderr"] + other["stderr"]


def test_dry_run_prints_plan_and_split(one_process):
    result = one_process["dry-run"]
    assert result["code"] == 0, result["stderr"]
    assert "per replica 2 micro-batch(es) x 2 images" in result["stdout"]


def test_a_checkpoint_resumes_on_another_partition_and_plan_files_are_used(signalled, one_process):
    """The checkpoint 2 ranks saved (K = 2, mast) resumes on 1 (K = 1, gpipe, from gems-plan's file, its
    layout given by the file alone); the plan file refuses a run under another schedule."""
    _, out, _, step = signalled
    assert step is not None, out
    result, mismatch = one_process["resume-partition"], one_process["plan-mismatch"]
    assert result["code"] == 0, result["stderr"]
    assert f"at step {step}" in result["stdout"] and "gems-train: done" in result["stdout"]
    assert mismatch["code"] == 2 and "pass --schedule gpipe" in mismatch["stderr"], mismatch["stderr"]


def test_a_non_finite_loss_is_never_applied():
    import gems  # noqa: PLC0415
    from gems import partition  # noqa: PLC0415
    from gems.comm import loopback  # noqa: PLC0415
    sys.path.insert(0, str(REPO / "tests" / "assets"))
    from tiny_model import tiny  # noqa: PLC0415

    def body(comm) -> None:
        model = tiny(num_classes=3)
        plan = partition.plan(model, input_shape=(3, 16, 16), batch_size=2, stages=1, schedule="mp")
        engine = gems.Engine(model, plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                             loss_fn=torch.nn.CrossEntropyLoss(), comm=comm)
        before = {k: v.clone() for k, v in engine.state_dict().items() if v.is_floating_point()}
        images, labels = torch.randn(2, 3, 16, 16), torch.tensor([0, 1])
        loss = engine.step(torch.full_like(images, float("nan")), labels)
        after = engine.state_dict()
        assert loss != loss and not engine.last_step_applied, loss
        assert all(torch.equal(before[k], after[k]) for k in before)  # BatchNorm statistics included
        engine.step(images, labels)
        assert engine.last_step_applied

    loopback.run(1, body)   # one rank, in this process


def test_a_plan_with_a_suffix_under_a_one_replica_pipeline_sets_the_world(tmp_path, monkeypatch):
    """A gems-plan plan tiling the U-Net's decoder under 1f1b, K = 2, P = 2: gems-train reads it
    before laying out the ranks, so position 1 is a tile group too (4 ranks, whose members hold the
    last stage); 3 ranks get the fix. Under mast the planner's own suffix leaves the ranks as they
    are, its members holding the last stage as well (what --resume loads for them)."""
    from gems.train import trainer  # noqa: PLC0415
    from gems.cli.train import parse as parse_train  # noqa: PLC0415
    import gems  # noqa: PLC0415
    unet = ["--model", "unet", "--model-arg", "width=4", "--model-arg", "depth=3", "--model-arg", "groups=2",
            "--num-classes", "3", "--image-size", "36", "--spatial", "2"]
    one = ["--batch-size", "4", "--stages", "2", "--schedule", "1f1b", "--micro-batches", "2"]
    plan = tmp_path / "plan.json"
    assert exit_status(gems_plan.main, [*unet, *one, "--spatial-start", "28", "--json", plan]) == 0

    def prepare(size: int, *args):
        comm = types.SimpleNamespace(size=size, rank=size - 1, device=torch.device("cpu"))
        return trainer.prepare(parse_train([*unet, "--task", "segmentation", "--workers", "0", *args]), comm)

    job = prepare(4, *one, "--plan", str(plan))
    assert job.topo.tiled == [0, 1] and job.topo.place(3) == (0, 1, 1) and job.topo.stages_of(3) == [1]
    with pytest.raises(gems.GemsError, match="3 ranks cannot form groups of 4 ranks"):
        prepare(3, *one, "--plan", str(plan))
    mast = prepare(4, "--batch-size", "2", "--stages", "2", "--schedule", "mast")
    assert mast.plan.spatial_start and mast.topo.stages_of(3) == [0, 1]


def test_spatial_auto_takes_the_fewest_tiles_the_launch_allows():
    """gems-train --spatial auto on 2 ranks (in process, no communication; gems-predict's takes the same
    layouts): one image per step tiles it on both ranks; two images go to two data-parallel groups, no
    tiles -- a tile of each image holds no less than one image per rank (the same pixels, halos more, and
    each weight's gradient whole on every tile) -- under a budget as without; a budget nothing meets is
    one sentence naming what each tile count lacked."""
    from gems.train import trainer  # noqa: PLC0415
    from gems.cli.train import parse as parse_train  # noqa: PLC0415
    import gems  # noqa: PLC0415

    def prepare(*args):
        comm = types.SimpleNamespace(size=2, rank=1, device=torch.device("cpu"))
        return trainer.prepare(parse_train(["--model", "resnet18", "--image-size", "64", "--workers", "0", "--stages",
                                            "1", "--schedule", "mp", "--spatial", "auto", *args]), comm)

    from gems.train.planning import layouts  # noqa: PLC0415
    # (P, D, batch parts): mast K = 2 on 4 ranks is 2 groups of 2, or one of 2 tile groups of 2
    assert list(layouts(4, 2, "mast", 1)) == [(1, 2, 4), (2, 1, 2)]
    one = prepare("--batch-size", "1")
    assert (one.plan.tiles, one.topo.groups, one.topo.place(1)) == (2, 1, (0, 0, 1))
    two = prepare("--batch-size", "2")
    assert (two.plan.tiles, two.topo.groups, two.cfg.spatial) == (1, 2, None)
    # 2 groups of 1 rank meet 148 MiB (~147.8 MiB); the plan for P = 1 has no tiles: the planner's own
    # auto would have tiled it on ranks that are not there
    tight = prepare("--batch-size", "2", "--memory-budget", "148MiB")
    assert (tight.plan.tiles, tight.topo.tiles, tight.topo.groups) == (1, 1, 2)
    with pytest.raises(gems.GemsError, match=r"P = 1: no number of stages fits .*; P = 2: a rank needs .*: launch"):
        prepare("--batch-size", "2", "--memory-budget", "20MiB")
