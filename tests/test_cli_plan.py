"""gems-plan: the real-size plan of a big model in seconds, and one clean line for bad input."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from gems.cli import run
from gems.cli.plan import main
from gems.errors import GemsError

BASE = ["--model", "resnet18", "--num-classes", "10", "--image-size", "64", "--batch-size", "2", "--stages", "2"]


def gems_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from gems.cli.plan import main; sys.exit(main())",
                           *args], capture_output=True, text=True, timeout=120)


def test_resnet101_at_2048_in_seconds_without_allocating_it(tmp_path):
    start = time.monotonic()
    # The child reports its own peak resident memory since exec (VmHWM): ru_maxrss, of the child or of
    # all children, would also count the pages of this (possibly large) test process it forked from.
    report = ("import sys\nfrom gems.cli.plan import main\ntry:\n    main()\nfinally:\n"
              "    hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
              "    print('maxrss', hwm.split()[1], file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", report, "--model", "resnet101", "--image-size", "2048",
                             "--batch-size", "2", "--stages", "4", "--schedule", "mast", "--memory-budget", "40GiB",
                             "--json", str(tmp_path / "p.json")], capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    print(result.stdout)
    assert elapsed < 60
    # ~10 GiB of activations per image at this size; the planner itself stays near torch's import size.
    assert int(result.stderr.split("maxrss")[-1]) < 2_500_000   # KiB
    for word in ("position", "est. peak", "imbalance", "fits"):
        assert word in result.stdout
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["stages"] == 4 and data["input_shape"] == [3, 2048, 2048] and len(data["cuts"]) == 5


def test_bad_input_in_a_subprocess():
    """Once through a real process (a GemsError, found after the model is built): its exit status and
    stderr. Every message, argparse's included, is checked in this process below."""
    result = gems_plan("--model", "resnet18", "--image-size", "8", "--batch-size", "2", "--stages", "2")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("gems-plan: error: ")


def test_a_reader_that_leaves_ends_the_command_quietly():
    """`gems-plan ... | head`: stdout's pipe closed before the table is written -> status 141 (a writer
    killed by SIGPIPE), no traceback."""
    body = "import sys; from gems.cli import run; sys.exit(run('gems-plan', lambda: print('plan ' * 100_000)))"
    child = subprocess.Popen([sys.executable, "-c", body], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()
    assert child.wait(timeout=60) == 141
    assert child.stderr.read() == b""


@pytest.mark.parametrize("extra, message", [
    (["--image-size", "4"], "use a larger image size"),
    (["--batch-size", "3"], "use a multiple of 2"),
    (["--stages", "99"], "use at most 10 stages"),
    (["--balance", "3,4"], "sum to 10"),
    (["--balance", "3,3,4"], "3 entries but there are 2 stages"),
    (["--model", "no-such-net"], "unknown model"),
    (["--model", "missing.py:make"], "does not exist"),
    (["--memory-budget", "1KiB"], "no number of stages fits"),
    (["--schedule", "mp", "--micro-batches", "2"], "micro-batches 1"),
    (["--json", "/no/such/dir/plan.json"], "choose a writable path"),
    (["--memory-budget", "40GB?"], "40GiB"),
    (["--image-size", "0"], "image size"),
    (["--image-size", "32x"], "image size"),
    (["--image-size", "2048x"], "image size"),
    (["--balance", "a,b"], "unit counts"),
    (["--stages", "0"], "positive integer"),
    (["--schedule", "zigzag"], "invalid choice"),
    (["--balance-by", "luck"], "invalid choice"),
    (["--recompute", "some"], "invalid choice"),
    (["--offload", "yes"], "invalid choice"),
    (["--device", "tpu"], "invalid choice"),
    (["--host-bandwidth", "fast"], "host bandwidth must be a positive rate"),
    (["--host-bandwidth", "0GB/s"], "host bandwidth must be a positive rate"),
    (["--device-tflops", "-1"], "device rate must be positive"),
    (["--state-placement", "ram"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, extra, message):
    args = BASE.copy()
    for i in range(0, len(extra), 2):   # replace a flag's value, or add the flag
        flag = extra[i]
        if flag in args:
            args[args.index(flag) + 1] = extra[i + 1]
        else:
            args += extra[i:i + 2]
    try:
        status = main(args)
    except SystemExit as exit_:          # argparse
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2
    assert message in err
    assert err.strip().splitlines()[-1].startswith("gems-plan: error: ")
    assert "Traceback" not in err


def test_plan_output_and_hxw(capsys):
    assert main(BASE + ["--image-size", "64x48", "--memory-budget", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "input 3x64x48" in out and "fits" in out


def test_measured_time_balance(capsys):
    assert main(BASE + ["--schedule", "1f1b", "--balance-by", "time", "--measure-time"]) == 0
    assert "imbalance (max/mean time" in capsys.readouterr().out


def test_run_helper(capsys):
    def fail():
        raise GemsError("do this instead")
    assert run("gems-x", fail) == 2
    assert capsys.readouterr().err == "gems-x: error: do this instead\n"
    assert run("gems-x", lambda: None) == 0
    assert run("gems-x", lambda: 3) == 3


def test_simulate_predicts_every_schedule(capsys):
    assert main(["--model", "resnet18", "--image-size", "256", "--batch-size", "4", "--stages", "2",
                 "--micro-batches", "2", "--simulate"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines()[-4:]]
    assert rows == ["mp", "gpipe", "1f1b", "mast"]
    assert "<- this plan" in out.splitlines()[-1]


def test_policy_flags(capsys, tmp_path):
    path = tmp_path / "p.json"
    assert main(BASE + ["--recompute", "all", "--offload", "all", "--host-bandwidth", "25GB/s",
                        "--state-placement", "host-optimizer", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "recompute x" in out and "+offload" in out and "predicted step" in out and "w/o policy" in out
    data = json.loads(path.read_text())
    assert data["host_bandwidth"] == 25e9 and data["device"] == "cuda"
    assert all(p["recompute"] and p["offload"] and p["state_placement"] == "host-optimizer" for p in data["policies"])


def test_host_placement_shows_the_weight_groups_and_their_transfers(capsys, tmp_path):
    path = tmp_path / "p.json"
    assert main(BASE + ["--state-placement", "host", "--optimizer", "adam", "--simulate", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "host (1 group)" in out and "swap up/down per step" in out and "--state-placement host:" in out
    assert "weight transfers and host updates included" in out and "host x2  <- this plan" in out
    data = json.loads(path.read_text())
    assert all(p["state_placement"] == "host" and p["weight_groups"] for p in data["policies"])
    assert len(data["swap_bytes"]) == 2 and all(up > 0 and down > 0 for up, down in data["swap_bytes"])


def test_auto_policies_fit_a_budget_the_plain_plan_misses(capsys):
    from gems.models import build
    from gems.partition import plan

    model = build("resnet18", num_classes=10)
    plain, lean = (plan(model, (3, 64, 64), 2, 2, recompute=mode, offload=mode) for mode in ("none", "all"))
    budget = (plain.peak_bytes + lean.peak_bytes) // 2
    assert main(BASE + ["--memory-budget", str(budget), "--recompute", "auto", "--offload", "auto"]) == 0
    out = capsys.readouterr().out
    assert "fits: the largest peak" in out and ("recompute x" in out or "offload" in out)
    assert main(BASE + ["--memory-budget", str(budget), "--device", "cpu", "--recompute", "auto"]) == 0
    assert "offload" not in capsys.readouterr().out


def test_sweep_recommends_the_fastest_configuration_that_fits(capsys):
    base = ["--model", "resnet18", "--num-classes", "10", "--image-size", "64", "--batch-size", "8"]
    assert main(base + ["--sweep", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    # schedule K m P D ranks step images/s peak unit policies
    rows = [line.split() for line in out[3:] if line.split()[0] in ("mp", "gpipe", "1f1b", "mast")]
    rates = [float(r[7]) for r in rows]
    assert rows and rates == sorted(rates, reverse=True)
    assert {int(r[1]) for r in rows} <= {1, 2, 4}
    # plain layouts use K ranks per group, and the batch splits over their groups
    assert all(r[5] == f"{int(r[1]) * int(r[4])}/4" and 8 % int(r[4]) == 0 for r in rows if r[3] == "1")
    assert out[-2].startswith(f"recommended: --stages {rows[0][1]} --schedule {rows[0][0]}")
    assert out[-1].startswith(f"launch: mpiexec -n {rows[0][5].split('/')[0]} gems-train --model resnet18")
    # A budget below the data-parallel peak pushes the recommendation to more stages or recomputation.
    data_parallel = next(r for r in rows if r[1] == "1" and r[3] == "1")
    tight = float(data_parallel[8]) * 0.6
    assert main(base + ["--sweep", "2", "--memory-budget", f"{tight}{data_parallel[9]}", "--recompute", "auto"]) == 0
    out = capsys.readouterr().out
    assert "over the budget" in out and ("recompute" in out or "nothing fits" in out)
    assert main(base) == 2
    assert "--stages" in capsys.readouterr().err
