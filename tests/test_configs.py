"""Config files: ``--config FILE`` (TOML) for gems-train, gems-predict and gems-bench, flags over
the file, ``--print-config`` (byte-identical when fed back); every checkpoint's manifest holds the
resolved configuration and an environment record, ``config.toml`` lies beside the checkpoints, and
``--resume`` names every option that changed, refusing what it always refused (exit 2)."""
from __future__ import annotations

import json

import pytest

from conftest import cli_cases, exit_status
from gems.cli import bench as gems_bench, predict as gems_predict, train as gems_train
from gems.train import configfile
from gems.train.config import TrainConfig

RUN = """model = "resnet18"
batch_size = 4
lr = 0.1
model_arg = ["zero_init_residual=True"]
recompute = "auto"
"""


def printed(main, argv, capsys) -> str:
    assert exit_status(main, [*argv, "--print-config"]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


@pytest.mark.parametrize("main", [gems_train.main, gems_predict.main, gems_bench.main])
def test_print_config_fed_back_prints_the_same_bytes(main, tmp_path, capsys):
    first = tmp_path / "first.toml"
    first.write_text("batch_size = 6\ntimeout = 90\n")
    once = printed(main, ["--config", first], capsys)
    again = tmp_path / "again.toml"
    again.write_text(once)
    assert printed(main, ["--config", again], capsys) == once
    assert "batch_size = 6\n" in once and "timeout = 90.0\n" in once and "= None" not in once


def test_flags_override_the_file_and_unset_options_are_left_out(tmp_path, capsys):
    run = tmp_path / "run.toml"
    run.write_text(RUN)
    text = printed(gems_train.main, ["--config", run, "--lr", "0.05"], capsys)
    assert "lr = 0.05\n" in text and 'model = "resnet18"\n' in text and "batch_size = 4\n" in text
    assert 'model_arg = ["zero_init_residual=True"]\n' in text and 'recompute = "auto"\n' in text
    assert "num_classes" not in text and "plan =" not in text   # left at None
    assert configfile.read(tmp_path / "run.toml", TrainConfig)["model_arg"] == ("zero_init_residual=True",)


@pytest.mark.parametrize("text, message", [
    ("batchsize = 4\n", "unknown key 'batchsize' (did you mean 'batch_size'?)"),
    ("batch_size = \"two\"\n", "batch_size should be an integer, got 'two'"),
    ("lr = true\n", "lr should be a number, got True"),
    ("augment = 1\n", "augment should be true or false, got 1"),
    ("schedule = \"mest\"\n", "schedule = 'mest' is not one of mp, gpipe, 1f1b, mast"),
    ("model_arg = \"a=1\"\n", "model_arg should be a list of strings"),
    ("batch_size = 4\nlr = \n", "does not parse as TOML: Invalid value (at line 2, column 6)"),
])
def test_a_bad_config_file_is_one_sentence_and_exit_2(text, message, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    assert exit_status(gems_train.main, ["--config", bad]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("gems-train: error: ") and message in err, err
    assert str(bad) in err


def test_a_missing_config_file_is_one_sentence_and_exit_2(tmp_path, capsys):
    assert exit_status(gems_bench.main, ["--config", tmp_path / "none.toml"]) == 2
    assert "cannot read the config file" in capsys.readouterr().err


def test_manifests_hold_the_configuration_and_resume_names_what_changed(tmp_path):
    ck = tmp_path / "ck"
    base = ["--model", "tests/assets/tiny_model.py:tiny", "--image-size", "16", "--batch-size", "2", "--stages", "1",
            "--schedule", "mp", "--workers", "0", "--no-progress", "--checkpoint-dir", ck, "--lr", "0.1"]
    first, lr, model = cli_cases("gems.cli.train", [
        [*base, "--steps", "2"],
        ["--config", ck / "config.toml", "--steps", "3", "--lr", "0.05", "--resume"],
        ["--config", ck / "config.toml", "--steps", "4", "--model", "resnet18", "--resume"]])
    assert first["code"] == 0, first["stderr"]
    manifest = json.loads((ck / "step-00000002" / "manifest.json").read_text())
    assert manifest["config"]["lr"] == 0.1 and manifest["config"]["steps"] == 2
    environment = manifest["environment"]
    assert environment["torch"] and environment["python"] and environment["world"] == 1
    assert environment["hosts"] and environment["devices"] == ["cpu"] and environment["backend"] == "mpi"
    assert lr["code"] == 0, lr["stderr"]
    assert "with a changed configuration: lr 0.1 -> 0.05, steps 2 -> 3" in lr["stdout"], lr["stdout"]
    assert "resumed from" in lr["stdout"]
    assert json.loads((ck / "step-00000003" / "manifest.json").read_text())["config"]["lr"] == 0.05
    assert model["code"] == 2, model["stdout"] + model["stderr"]
    assert 'changed: model "tests/assets/tiny_model.py:tiny" -> "resnet18"' in model["stderr"], model["stderr"]
    assert model["stderr"].count("error") == 1


def test_a_plan_file_gives_its_layout_beneath_the_config_file_and_the_flags(tmp_path, capsys):
    """``gems-train --plan FILE`` takes stages, schedule, micro-batches, batch, image size and
    spatial part from the plan; a config file's values and flags stand above it (a disagreement
    is then make_plan's one-sentence error, tested with the sweep)."""
    from gems import models, partition   # noqa: PLC0415

    path = tmp_path / "plan.json"
    partition.plan(models.build("resnet18", num_classes=4), (3, 48, 48), batch_size=4, stages=2, schedule="gpipe",
                   micro_batches=2).to_json(path)
    alone = printed(gems_train.main, ["--model", "resnet18", "--plan", path], capsys)
    assert all(line in alone for line in ("stages = 2\n", 'schedule = "gpipe"\n', "micro_batches = 2\n",
                                          "batch_size = 4\n", "image_size = 48\n")), alone
    config = tmp_path / "run.toml"
    config.write_text(f'plan = "{path}"\nbatch_size = 8\n')
    layered = printed(gems_train.main, ["--config", config, "--micro-batches", "4"], capsys)
    assert all(line in layered for line in ("stages = 2\n", "batch_size = 8\n", "micro_batches = 4\n")), layered
    assert exit_status(gems_train.main, ["--plan", tmp_path / "missing.json", "--print-config"]) == 2
    assert "cannot read plan file" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--plan", "--config"])
def test_a_file_flag_without_its_file_is_one_line_and_exit_2(flag, capsys):
    assert exit_status(gems_train.main, ["--model", "resnet18", flag]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {flag}: expected one argument" in err, err
