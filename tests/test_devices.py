"""Devices (issue 15, item 5): which GPU a rank takes, what a rank holds on a GPU besides tensors,
bf16 activations under autocast, and ``gems-plan --calibrate``. All on CPU, in-process."""
from __future__ import annotations

import json
import re
import time
from collections import OrderedDict

import pytest
import torch
from torch import nn

from gems.cli.plan import main as gems_plan
from gems.comm.placement import local_device, placement
from gems.errors import GemsError
from gems.models import build
from gems.partition import plan, profile
from gems.partition.calibrate import Calibration, calibrate
from gems.partition.overhead import CUDA_CONTEXT_BYTES, NCCL_COMMUNICATOR_BYTES
from gems.units import format_size
from gems.plan import Plan

CUDA = torch.device("cuda")
BASE = ["--model", "resnet18", "--num-classes", "10", "--image-size", "64", "--batch-size", "2", "--stages", "2"]


def on_node(*ranks: tuple[int, dict[str, str]], allow: bool = False) -> list[torch.device]:
    """The device every local rank of one node gets, given (visible GPUs, environment) per rank."""
    return [local_device(CUDA, r, ranks, allow, "n1") for r in range(len(ranks))]


# -- which GPU a rank takes ----------------------------------------------------------------------

def test_ranks_that_see_every_gpu_take_them_in_local_rank_order():
    assert on_node(*[(4, {})] * 4) == [torch.device("cuda", i) for i in range(4)]
    assert on_node(*[(4, {})] * 2) == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_more_ranks_than_gpus_stops_unless_sharing_is_allowed():
    with pytest.raises(GemsError) as error:
        on_node(*[(2, {})] * 4)
    assert str(error.value) == ("4 ranks on n1 share 2 visible GPUs; launch at most 2 ranks per node, or pass "
                                "--allow-shared-gpu to place several ranks on one GPU")
    assert on_node(*[(2, {})] * 4, allow=True) == [torch.device("cuda", i) for i in (0, 1, 0, 1)]
    assert on_node(*[(1, {})] * 2, allow=True) == [torch.device("cuda", 0)] * 2


def test_cuda_visible_devices_is_not_remapped():
    # torch numbers the visible devices 0..n-1: ranks seeing "2,3" use cuda:0 and cuda:1.
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert on_node((2, env), (2, env)) == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_one_visible_device_per_task_is_device_0():
    ranks = [(1, {"CUDA_VISIBLE_DEVICES": str(i)}) for i in range(4)]
    assert on_node(*ranks) == [torch.device("cuda", 0)] * 4


def test_slurm_per_task_binding():
    # --gpus-per-task=1 with device cgroups: every task sees its GPU as "0"; Slurm's IDs tell them apart.
    ranks = [(1, {"CUDA_VISIBLE_DEVICES": "0", "SLURM_STEP_GPUS": str(i)}) for i in range(4)]
    assert on_node(*ranks) == [torch.device("cuda", 0)] * 4
    # --gpus-per-node=2 and 4 tasks: all see the same two GPUs.
    shared = [(2, {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_STEP_GPUS": "4,5"})] * 4
    with pytest.raises(GemsError, match="4 ranks on n1 share 2 visible GPUs"):
        on_node(*shared)
    # --gpus-per-node=4, one task per GPU.
    assert on_node(*[(4, {"SLURM_STEP_GPUS": "0,1,2,3"})] * 4) == [torch.device("cuda", i) for i in range(4)]


def test_no_visible_gpu_and_devices_left_alone():
    with pytest.raises(GemsError, match="local rank 0 on n1 sees no GPU .*CUDA_VISIBLE_DEVICES=''"):
        on_node((0, {"CUDA_VISIBLE_DEVICES": ""}))
    for device in (torch.device("cpu"), torch.device("cuda", 1)):
        assert local_device(device, 3, [(0, {})] * 4) == device


def test_placement_is_collective_and_raises_on_every_rank():
    from mpi4py import MPI

    assert placement(MPI.COMM_WORLD, torch.device("cpu")) == (0, 1, 0, 1, torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(GemsError, match="sees no GPU"):
            placement(MPI.COMM_WORLD, CUDA)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_placement_error_is_one_line_from_rank_0_and_exit_2(monkeypatch, capsys, rank):
    from gems import comm as comm_lib
    from gems.cli import communicator

    def create(*args, **kwargs):
        assert kwargs["allow_shared_gpu"] is False
        raise GemsError("4 ranks on n1 share 2 visible GPUs; launch at most 2 ranks per node, or pass "
                        "--allow-shared-gpu to place several ranks on one GPU")
    monkeypatch.setattr(comm_lib, "create", create)
    monkeypatch.setattr(comm_lib, "world_rank", lambda: rank)
    with pytest.raises(SystemExit) as exit_:
        communicator("gems-train", "mpi", 10.0, False)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == ("gems-train: error: 4 ranks on n1 share 2 visible GPUs; launch at most 2 ranks per node, or "
                   "pass --allow-shared-gpu to place several ranks on one GPU\n" if rank == 0 else "")


def test_allow_shared_gpu_flags():
    from gems.cli import bench, train

    assert train.parse([]).allow_shared_gpu is False and train.parse(["--allow-shared-gpu"]).allow_shared_gpu
    assert bench.parse([]).allow_shared_gpu is False and bench.parse(["--allow-shared-gpu"]).allow_shared_gpu


# -- memory besides tensors ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def resnet():
    return build("resnet18", num_classes=10)


def test_overhead_is_reported_apart_for_cuda_only(resnet):
    args = dict(input_shape=(3, 64, 64), batch_size=2, stages=2, schedule="mast")
    plain = plan(resnet, **args)
    torch_ = plan(resnet, **args, comm="torch")
    mpi = plan(resnet, **args, comm="mpi")
    cpu = plan(resnet, **args, comm="torch", device="cpu")
    # mast, K=2: one neighbour, the mirror group, the default group
    assert torch_.device_overhead == {"CUDA context": CUDA_CONTEXT_BYTES,
                                      "3 NCCL communicators": 3 * NCCL_COMMUNICATOR_BYTES}
    assert mpi.device_overhead == {"CUDA context": CUDA_CONTEXT_BYTES}
    assert plain.device_overhead == {} == cpu.device_overhead
    for p in (torch_, mpi, cpu):   # the tensor estimates do not move
        assert [q.peak_bytes for q in p.positions] == [q.peak_bytes for q in plain.positions]
    total = format_size(CUDA_CONTEXT_BYTES + 3 * NCCL_COMMUNICATOR_BYTES)
    assert (f"besides tensors, each rank holds {total} on its GPU: CUDA context {format_size(CUDA_CONTEXT_BYTES)}, "
            "3 NCCL communicators 2.02 GiB (measured constants: gems.partition.overhead)") in torch_.table()
    assert "besides tensors" not in plain.table() and "besides tensors" not in cpu.table()
    assert "device_overhead" not in plain.to_json() and "amp" not in json.loads(plain.to_json())
    assert Plan.from_json(torch_.to_json()).device_overhead == torch_.device_overhead


def test_overhead_counts_against_the_budget_on_cuda(resnet):
    args = dict(input_shape=(3, 64, 64), batch_size=2, stages=2, schedule="mast")
    peak = plan(resnet, **args).peak_bytes
    budget = peak + CUDA_CONTEXT_BYTES - 1
    assert plan(resnet, **args, memory_budget=budget).fits
    assert plan(resnet, **args, memory_budget=budget, comm="mpi", device="cpu").fits
    over = plan(resnet, **args, memory_budget=budget, comm="mpi")
    context = format_size(CUDA_CONTEXT_BYTES)
    assert over.fits is False and f"plus {context} besides tensors, over the budget" in over.table()
    fits = plan(resnet, **args, memory_budget=peak + CUDA_CONTEXT_BYTES, comm="mpi")
    assert fits.fits and f", plus {context} besides tensors, is within the budget" in fits.table()
    with pytest.raises(GemsError, match="leaves nothing for tensors .* raise --memory-budget"):
        plan(resnet, **args, memory_budget="1GiB", comm="torch")


# -- bf16 under autocast ---------------------------------------------------------------------------

def test_bf16_halves_the_saved_conv_output():
    model = nn.Sequential(OrderedDict(
        block=nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
        head=nn.Sequential(nn.Flatten(), nn.Linear(8 * 16 * 16, 4))))
    conv_output = 2 * 8 * 16 * 16 * 4   # float32 bytes of a micro-batch of 2

    def inside(prof) -> list[int]:   # what the block keeps that no other unit sees
        return sorted(s.nbytes for s in prof.storages if s.savers == (0,) and not s.boundaries)
    full = profile(model, (3, 16, 16), 2)
    low = profile(model, (3, 16, 16), 2, autocast=torch.bfloat16)
    assert max(inside(full)) == conv_output
    assert conv_output // 2 in inside(low) and conv_output not in inside(low)
    # boundaries keep their size (sent in the plan's dtypes); FLOPs do not change
    assert sorted(s.nbytes for s in full.storages if s.boundaries) == sorted(s.nbytes for s in low.storages
                                                                               if s.boundaries)
    assert [u.forward_flops for u in full.units] == [u.forward_flops for u in low.units]
    # the bf16 copies autocast keeps: the image and the conv weight, the linear weight
    assert 3 * 16 * 16 * 2 * 2 + 8 * 3 * 9 * 2 in inside(low)
    assert [s.nbytes for s in low.storages if s.savers == (1,) and not s.boundaries] == [4 * 8 * 16 * 16 * 2]


def test_bf16_plan(resnet):
    args = dict(input_shape=(3, 1024, 1024), batch_size=2, stages=2, schedule="mast")   # activations dominate
    full, low = plan(resnet, **args), plan(resnet, **args, amp="bf16")
    assert low.amp == "bf16" and "float32 (bf16 autocast), sgd" in low.table()
    assert sum(s.activation_bytes for s in low.stage_estimates) < 0.8 * sum(s.activation_bytes
                                                                           for s in full.stage_estimates)
    assert json.loads(low.to_json())["amp"] == "bf16"


# -- gems-plan --calibrate ---------------------------------------------------------------------------

def test_calibrate_this_cpu_quickly():
    start = time.monotonic()
    measured = calibrate("cpu")
    assert time.monotonic() - start < 3
    assert measured.flops_per_second > 1e8 and measured.host_bandwidth is None
    assert "no host link" in measured.line()


def test_calibrate_cli_on_cpu(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert gems_plan(BASE + ["--device", "cpu", "--calibrate", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    printed = float(re.search(r"calibrated cpu .*: ([\d.]+) TFLOP/s sustained", out).group(1))
    assert json.loads(path.read_text())["flops_per_second"] / 1e12 == pytest.approx(printed, abs=5e-4)


def test_calibrated_figures_reach_the_plan(tmp_path, capsys, monkeypatch):
    import gems.partition.calibrate as calibration

    figures = Calibration("cuda", "a GPU", "float32", 50e12, 25e9)
    monkeypatch.setattr(calibration, "calibrate", lambda device, dtype: figures)
    path = tmp_path / "plan.json"
    assert gems_plan(BASE + ["--calibrate", "--offload", "all", "--simulate", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("calibrated a GPU: 50.000 TFLOP/s sustained") and "host link 25.0 GB/s" in out
    assert "simulated at 50 TFLOP/s x 1," in out
    data = json.loads(path.read_text())
    assert (data["flops_per_second"], data["host_bandwidth"]) == (50e12, 25e9)
    # explicit figures win over measured ones; without --calibrate, the V100 / PCIe 3 defaults
    assert gems_plan(BASE + ["--calibrate", "--efficiency", "0.5", "--host-bandwidth", "12GB/s", "--json",
                             str(path)]) == 0
    data = json.loads(path.read_text())
    assert (data["flops_per_second"], data["host_bandwidth"]) == (25e12, 12e9)
    assert gems_plan(BASE + ["--json", str(path)]) == 0
    assert json.loads(path.read_text())["flops_per_second"] == pytest.approx(15.7e12 * 0.4)


@pytest.mark.parametrize("extra, message", [
    pytest.param(["--calibrate"], "no CUDA device is visible",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there to calibrate")),
    (["--comm", "nccl"], "invalid choice"),
    (["--amp", "fp8"], "invalid choice"),
    (["--comm", "torch", "--memory-budget", "1GiB"], "leaves nothing for tensors"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, extra, message):
    try:
        status = gems_plan(BASE + extra)
    except SystemExit as exit_:          # argparse
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("gems-plan: error: ")
