"""The speed recipe's switches (gems.train.config.Recipe): defaults by device, what they set
process-wide, and how the CLIs take them."""
from __future__ import annotations

import os

import pytest
import torch

from gems.train.config import CPU_FORMAT, Recipe, TrainConfig
from gems.train.planning import workspace_room


def test_channels_last_by_default_on_cuda_only():
    assert Recipe().memory_format("cuda") == "channels_last"
    assert Recipe().memory_format("cpu") == CPU_FORMAT == "contiguous"
    assert Recipe(channels_last=True).memory_format("cpu") == "channels_last"
    assert Recipe(channels_last=False).memory_format("cuda") == "contiguous"


def test_apply_sets_cudnn_autotuning_on_cuda_and_caps_its_workspace(monkeypatch):
    monkeypatch.delenv("CUDNN_CONV_WSCAP_DBG", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    Recipe().apply("cpu", 2**30)
    assert not torch.backends.cudnn.benchmark and "CUDNN_CONV_WSCAP_DBG" not in os.environ
    Recipe().apply("cuda", 3 * 2**20 + 5)
    assert torch.backends.cudnn.benchmark and os.environ["CUDNN_CONV_WSCAP_DBG"] == "3"
    Recipe(cudnn_benchmark=False).apply("cuda", -1)   # a plan over its budget leaves no room at all
    assert not torch.backends.cudnn.benchmark and os.environ["CUDNN_CONV_WSCAP_DBG"] == "0"
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert torch.backends.cudnn.allow_tf32   # torch's default, --tf32's
    Recipe(tf32=False).apply("cuda")
    assert not torch.backends.cudnn.allow_tf32


def test_the_room_a_budget_leaves_above_the_estimate():
    from gems import partition
    from gems.partition.accuracy import toy_model

    plan = partition.plan(toy_model(), (3, 32, 32), 2, 2, "mast", memory_budget="1GiB")
    assert workspace_room(plan, 1, 0) == 2**30 - plan.positions[1].peak_bytes
    assert workspace_room(partition.plan(toy_model(), (3, 32, 32), 2, 2, "mast"), 0, 0) is None


def test_the_cli_flags_reach_the_configuration(capsys):
    from gems.cli import train

    with pytest.raises(SystemExit) as stop:
        train.main(["--channels-last", "--no-cudnn-benchmark", "--no-tf32", "--amp", "bf16", "--print-config"])
    assert stop.value.code == 0
    printed = capsys.readouterr().out
    assert "channels_last = true" in printed and "cudnn_benchmark = false" in printed and 'amp = "bf16"' in printed
    assert "tf32 = false" in printed
    assert TrainConfig().channels_last is None   # unset: by device


def test_gems_plan_prices_and_names_channels_last(capsys):
    from gems.cli import plan

    plan.main(["--model", "resnet18", "--image-size", "64", "--batch-size", "2", "--stages", "2", "--device", "cpu",
               "--channels-last"])
    assert ", channels_last, sgd" in capsys.readouterr().out
