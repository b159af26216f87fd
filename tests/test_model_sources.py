"""Model sources: torchvision:, timm: and smp: names build the library's own model, factories may
return any nn.Module, --model-arg reaches the builder, --init-from loads a state dict strictly
(with --init-exclude), and every bad input is one sentence naming the fix."""
from __future__ import annotations

import sys
import types

import pytest
import safetensors.torch
import segmentation_models_pytorch as smp
import timm
import torch
import torchvision
from torch import nn

from conftest import REPO
from gems.cli.bench import parse as parse_bench
from gems.cli.plan import main as plan_main
from gems.cli.train import parse as parse_train
from gems.errors import GemsError
from gems.models import build, load_initial_state
from gems.train import trainer
from gems.train.config import model_kwargs

TINY = "tests/assets/tiny_model.py:tiny"


# ---- the three prefixes ---------------------------------------------------------------

def test_torchvision_builds_its_own_class_with_random_weights():
    model = build("torchvision:resnet18", num_classes=3, zero_init_residual=True)
    assert type(model) is torchvision.models.ResNet and model.fc.out_features == 3
    assert torch.count_nonzero(model.layer1[0].bn2.weight) == 0      # the keyword argument arrived


def test_timm_builds_its_own_class():
    model = build("timm:resnet10t", num_classes=3, drop_rate=0.25)
    assert type(model) is timm.models.resnet.ResNet
    assert model.get_classifier().out_features == 3 and model.drop_rate == 0.25


def test_smp_builds_its_own_class():
    model = build("smp:Unet:resnet18", num_classes=3, decoder_channels=(32, 16, 8, 8, 8))
    assert type(model) is smp.Unet
    assert model.segmentation_head[0].out_channels == 3
    assert model.decoder.blocks[0].conv1[0].out_channels == 32


def test_a_factory_may_return_any_module(tmp_path):
    path = tmp_path / "nets.py"
    path.write_text("import torch.nn as nn\n"
                    "def linear(num_classes=1000):\n    return nn.Linear(4, num_classes)\n"
                    "def number(num_classes=1000):\n    return 3\n")
    model = build(f"{path}:linear", num_classes=5)
    assert type(model) is nn.Linear and model.out_features == 5
    with pytest.raises(GemsError, match="must return an nn.Module .*got int"):
        build(f"{path}:number")


@pytest.mark.parametrize("spec, kw, message", [
    ("torchvision:resnt18", {}, r"torchvision has no model 'resnt18' \(closest: resnet18, .*list_models\(\)"),
    ("timm:resnet10x", {}, r"timm has no model 'resnet10x' \(closest: resnet10t"),
    ("smp:Unit:resnet18", {}, r"no architecture 'Unit'; choose one of Unet"),
    ("smp:Unet:resnet19", {}, r"no encoder 'resnet19' \(closest: resnet18.*tu-NAME"),
    ("smp:Unet:tu-resnt10t", {}, r"timm has no model 'resnt10t' for the tu- encoder \(closest: tu-resnet10t"),
    ("smp:Unet", {}, r"smp:ARCH:ENCODER, e.g. smp:Unet:resnet34"),
    ("timm:", {}, r"names no model; write timm:NAME"),
    ("torchvision:", {}, r"names no model; write torchvision:NAME"),
    ("torchvision:resnet18", {"dropout": 0.1}, r"does not take the argument dropout; it takes progress, block, .*"
                                               r"zero_init_residual"),
    ("timm:resnet10t", {"dropout": 0.1}, r"timm:resnet10t does not take the argument dropout; it takes .*drop_rate"),
    ("smp:Unet:resnet18", {"dropout": 0.1}, r"does not take the argument dropout; it takes encoder_depth, "),
    ("smp:Unet:tu-resnet10t", {"dropout": 0.1}, r"does not take the argument dropout; .*passes others to the timm"),
    ("torchvision:resnet18", {"layers": [1, 1, 1, 1]}, r"refused the arguments \{'layers'.*multiple values"),
    ("torchvision:resnet18", {"weights": "DEFAULT"}, r"takes no weights argument: .* --init-from"),
    ("timm:resnet10t", {"pretrained": True}, r"takes no pretrained argument: .* --init-from"),
    ("smp:Unet:resnet18", {"classes": 2}, r"takes no classes argument: .*--num-classes"),
    ("smp:Unet:resnet18", {"encoder_weights": "imagenet"}, r"takes no encoder_weights argument"),
    ("no-such-net", {}, r"unknown model .*torchvision:NAME, timm:NAME, smp:ARCH:ENCODER, or your own"),
])
def test_bad_source_input_is_one_sentence(spec, kw, message):
    with pytest.raises(GemsError, match=message) as error:
        build(spec, num_classes=3, **kw)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("spec, package", [("timm:resnet10t", "timm"),
                                           ("smp:Unet:resnet18", "segmentation_models_pytorch")])
def test_an_optional_package_that_is_missing_names_the_extra(monkeypatch, spec, package):
    monkeypatch.setitem(sys.modules, package, None)     # what an environment without it imports
    with pytest.raises(GemsError, match=rf"{spec} needs {package}, .*pip install 'gems\[models\]'"):
        build(spec, num_classes=3)


# ---- --model-arg ----------------------------------------------------------------------

def test_model_args_are_literals_when_they_parse_else_text():
    assert model_kwargs(["depth=3", "rate=0.1", "flag=True", "none=None", "pair=(1, 2)", "neg=-2",
                         "act=gelu", "name='x'", "empty=", " spaced = 4 "]) == {
        "depth": 3, "rate": 0.1, "flag": True, "none": None, "pair": (1, 2), "neg": -2,
        "act": "gelu", "name": "x", "empty": "", "spaced": 4}


@pytest.mark.parametrize("pairs, message", [
    (["depth"], "'depth' must be KEY=VALUE"),
    (["=3"], "must be KEY=VALUE with a Python name as KEY"),
    (["drop-rate=3"], "must be KEY=VALUE with a Python name as KEY"),
    (["num_classes=3"], "with --num-classes"),
    (["a=1", "a=2"], "--model-arg a is given twice"),
])
def test_bad_model_args(pairs, message):
    with pytest.raises(GemsError, match=message):
        model_kwargs(pairs)


def test_model_arg_and_init_exclude_repeat_on_gems_train_and_gems_bench():
    cfg = parse_train(["--model-arg", "a=1", "--model-arg=b=x", "--init-from", "w.pt",
                       "--init-exclude", "fc.*", "--init-exclude", "head.*"])
    assert cfg.model_arg == ("a=1", "b=x") and cfg.init_exclude == ("fc.*", "head.*") and cfg.init_from == "w.pt"
    assert parse_train([]).model_arg == () and parse_train([]).init_exclude == ()
    assert parse_bench(["--model-arg", "a=1", "--model-arg", "b=2"]).model_arg == ("a=1", "b=2")


def run_plan(capsys, *extra: str) -> tuple[int, str, str]:
    args = ["--model", "resnet18", "--num-classes", "10", "--image-size", "64", "--batch-size", "2",
            "--stages", "2", *extra]
    try:
        status = plan_main(args)
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


def test_gems_plan_passes_model_args_to_the_builder(capsys):
    status, out, _ = run_plan(capsys, "--model-arg", "layers=(1, 1, 1, 1)")
    assert status == 0 and "position" in out


@pytest.mark.parametrize("extra, message", [
    (["--model-arg", "layers"], "--model-arg 'layers' must be KEY=VALUE"),
    (["--model-arg", "dropout=0.1"], "resnet18 has no option dropout"),
    (["--model", "torchvision:resnt18"], "closest: resnet18"),
])
def test_gems_plan_bad_model_input_is_one_line_and_exit_2(capsys, extra, message):
    status, _, err = run_plan(capsys, *extra)
    assert status == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("gems-plan: error: ")


# ---- --init-from ----------------------------------------------------------------------

def small(num_classes: int = 4, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, num_classes))


def equal(a: dict, b: dict, keys) -> bool:
    return all(torch.equal(a[k], b[k]) for k in keys)


def trained(seed: int = 1) -> nn.Sequential:
    """A model whose every entry, buffers included, differs from a fresh one."""
    model = small(seed=seed)
    model(torch.randn(2, 3, 8, 8))     # BatchNorm running statistics and counter move
    return model


@pytest.mark.parametrize("wrap", [lambda sd: sd, lambda sd: {"state_dict": sd, "epoch": 3},
                                  lambda sd: {"model": sd, "optimizer": {}}])
def test_a_pt_state_dict_round_trips(tmp_path, wrap):
    source = trained()
    torch.save(wrap(source.state_dict()), tmp_path / "w.pt")
    fresh = small()
    assert not equal(fresh.state_dict(), source.state_dict(), ["0.weight"])
    load_initial_state(fresh, tmp_path / "w.pt")
    assert equal(fresh.state_dict(), source.state_dict(), source.state_dict())


def test_a_safetensors_state_dict_round_trips(tmp_path):
    source = build("timm:resnet10t", num_classes=3)
    safetensors.torch.save_file(source.state_dict(), tmp_path / "w.safetensors")
    torch.manual_seed(7)
    fresh = build("timm:resnet10t", num_classes=3)
    load_initial_state(fresh, str(tmp_path / "w.safetensors"))
    assert equal(fresh.state_dict(), source.state_dict(), source.state_dict())


def test_excluded_keys_keep_their_initial_values(tmp_path):
    """A classifier head of another size: fine-tuning a 1000-class checkpoint on 5 classes."""
    source = build("torchvision:resnet18", num_classes=1000)
    torch.save(source.state_dict(), tmp_path / "w.pth")
    fresh = build("torchvision:resnet18", num_classes=5)
    head = {k: v.clone() for k, v in fresh.state_dict().items() if k.startswith("fc.")}
    load_initial_state(fresh, tmp_path / "w.pth", exclude=["fc.*"])
    state = fresh.state_dict()
    assert equal(state, head, head)
    assert equal(state, source.state_dict(), [k for k in state if not k.startswith("fc.")])


def mismatch(tmp_path, state: dict, model: nn.Module, exclude=()) -> str:
    torch.save(state, tmp_path / "w.pt")
    with pytest.raises(GemsError) as error:
        load_initial_state(model, tmp_path / "w.pt", exclude)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_missing_unexpected_and_reshaped_keys_are_listed_with_counts(tmp_path):
    state = small().state_dict()
    renamed = {("module." + k if k.startswith("1.") else k): v for k, v in state.items()}
    message = mismatch(tmp_path, renamed, small())
    assert "5 missing key(s) (1.bias, 1.num_batches_tracked, 1.running_mean, 1.running_var, 1.weight)" in message
    assert "5 unexpected key(s) (module.1.bias, module.1.num_batches_tracked," in message
    assert "--init-exclude GLOB" in message
    # a head for another number of classes: said so, with the flag that drops it
    message = mismatch(tmp_path, small(num_classes=7).state_dict(), small())
    assert "has a head (5) of 7 outputs but the model's has 4" in message
    assert "--init-exclude '5.*'" in message
    # other shape mismatches are listed
    other = small().state_dict()
    other["0.weight"] = torch.zeros(3, 3, 1, 1)
    message = mismatch(tmp_path, other, small())
    assert "1 shape mismatch(es) (0.weight (file 3x3x1x1, model " in message
    assert "key(s)" not in message


def test_more_than_five_keys_are_counted_and_cut_short(tmp_path):
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    message = mismatch(tmp_path, {"x": torch.zeros(1)}, model)
    assert "8 missing key(s) (0.bias, 0.weight, 1.bias, 1.weight, 2.bias, ...), 1 unexpected key(s) (x)" in message


def test_an_exclude_glob_that_matches_nothing_says_so(tmp_path):
    message = mismatch(tmp_path, small().state_dict(), small(), exclude=["head.*"])
    assert "--init-exclude 'head.*' matches no key" in message and "'5.*'" in message


@pytest.mark.parametrize("content, name, message", [
    ([1, 2], "w.pt", r"is not a state dict \(it holds a list\)"),
    ({"epoch": 3, "lr": 0.1}, "w.pt", r"is not a state dict \(it holds a dict with keys 'epoch', 'lr'\)"),
    ({}, "w.pt", r"is not a state dict \(it holds an empty dict\)"),
    (nn.Linear(2, 2), "w.pt", r"does not load with torch.load\(weights_only=True\) .*save model.state_dict\(\)"),
    (b"not a checkpoint", "w.pt", r"does not load with torch.load\(weights_only=True\)"),
    (b"not a checkpoint", "w.safetensors", r"is not a readable .safetensors file"),
    (None, "nowhere.pt", r"--init-from file .*nowhere.pt does not exist"),
])
def test_a_file_that_is_not_a_state_dict_says_so(tmp_path, content, name, message):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    with pytest.raises(GemsError, match=message):
        load_initial_state(small(), path)


def test_safetensors_missing_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    (tmp_path / "w.safetensors").write_bytes(b"")
    with pytest.raises(GemsError, match=r"needs safetensors, .*pip install 'gems\[models\]'"):
        load_initial_state(small(), tmp_path / "w.safetensors")


def test_gems_train_loads_the_initial_state_right_after_building(tmp_path, monkeypatch):
    """trainer.prepare on one rank: the model it hands on holds the file's weights, except the
    excluded head, which keeps the seed's initialisation."""
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO / "tests" / "assets"))
    from tiny_model import tiny  # noqa: PLC0415
    torch.manual_seed(123)
    source = tiny(num_classes=7)
    torch.save(source.state_dict(), tmp_path / "w.pt")
    argv = ["--model", TINY, "--image-size", "32", "--batch-size", "2", "--stages", "1", "--num-classes", "3",
            "--workers", "0", "--init-from", str(tmp_path / "w.pt"), "--init-exclude", "4.2.*"]
    comm = types.SimpleNamespace(size=1, rank=0, device=torch.device("cpu"))
    job = trainer.prepare(parse_train(argv), comm)
    torch.manual_seed(0)                    # the seed prepare builds with (--seed 0)
    initial = tiny(num_classes=3).state_dict()
    state = job.model.state_dict()
    assert equal(state, source.state_dict(), [k for k in state if not k.startswith("4.2.")])
    assert equal(state, initial, ["4.2.weight", "4.2.bias"])
