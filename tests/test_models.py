"""gems.models: every model runs as one nn.Sequential, units follow the boundary
convention, ResNets equal torchvision's, user factories load, bad input names its fix."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from gems.errors import GemsError
from gems.models import build, names, torchvision_state_dict
from gems.pipeline.stage import as_tuple
from gems.models.amoebanet import Cell

# Small options per registered name, so forward + backward stays fast on 2 CPU cores.
SMALL = {
    "resnet34": {"layers": [1, 1, 1, 1]},
    "resnet50": {"layers": [1, 1, 1, 1]},
    "resnet101": {"layers": [1, 1, 1, 1]},
    "resnet152": {"layers": [1, 1, 1, 1]},
    "wide-resnet50-2": {"layers": [1, 1, 1, 1]},
    "wide-resnet101-2": {"layers": [1, 1, 1, 1]},
    "preact-resnet": {"depth": 11},
    "amoebanet-d": {"num_layers": 3, "num_filters": 8},
}
# preact-resnet1001 is covered by construction only (a forward pass takes ~10 s here).
FORWARD_NAMES = [n for n in names() if n not in ("preact-resnet1001", "unet")]   # the Sequential zoo


def test_names_cover_the_zoo():
    assert {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "preact-resnet",
            "preact-resnet110", "preact-resnet1001", "amoebanet-d"} <= set(names())


@pytest.mark.parametrize("name", FORWARD_NAMES)
def test_forward_backward(name):
    torch.manual_seed(0)
    model = build(name, num_classes=10, **SMALL.get(name, {}))
    assert isinstance(model, nn.Sequential)
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    out.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name, kw, units", [
    ("resnet18", {}, 10), ("resnet34", {}, 18), ("resnet50", {}, 18), ("resnet101", {}, 35),
    ("resnet152", {}, 52), ("preact-resnet", {"depth": 11}, 5), ("preact-resnet110", {}, 38),
    ("preact-resnet1001", {}, 335), ("amoebanet-d", {}, 24), ("amoebanet-d", {"num_layers": 36}, 42),
])
def test_unit_counts(name, kw, units):
    with torch.device("meta"):  # structure only: no memory, no weight init
        model = build(name, **kw)
    assert len(model) == units
    assert list(dict(model.named_children()))[0] == "stem" and list(dict(model.named_children()))[-1] == "head"


def test_units_chain_like_the_whole_model():
    """unit_i(out_{i-1}) unit by unit equals model(x): the convention the runtime relies on."""
    torch.manual_seed(0)
    for name in ("resnet18", "amoebanet-d"):
        model = build(name, num_classes=5, **SMALL.get(name, {})).eval()
        x = torch.randn(2, 3, 32, 32)
        y = x
        for unit in model:
            y = unit(y)
            assert all(t.shape[0] == 2 for t in as_tuple(y))
        torch.testing.assert_close(y, model(x))


@pytest.mark.parametrize("name, reference", [("resnet18", torchvision.models.resnet18),
                                             ("resnet50", torchvision.models.resnet50)])
def test_resnet_equals_torchvision(name, reference):
    torch.manual_seed(0)
    ref = reference(num_classes=10)
    # Non-trivial BN statistics, so eval mode really compares the normalisation too.
    for m in ref.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    model = build(name, num_classes=10)
    model.load_state_dict(torchvision_state_dict(ref.state_dict()))
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), ref.eval()(x), rtol=0, atol=0)


def test_wide_resnet_matches_torchvision_shapes():
    with torch.device("meta"):
        ref = torchvision.models.wide_resnet50_2()
        model = build("wide-resnet50-2")
    expected = {k: v.shape for k, v in torchvision_state_dict(ref.state_dict()).items()}
    assert {k: v.shape for k, v in model.state_dict().items()} == expected


def test_amoebanet_cells_pass_pairs():
    torch.manual_seed(0)
    model = build("amoebanet-d", num_classes=3, num_layers=3, num_filters=8)
    y = model[0](torch.randn(2, 3, 33, 33))  # odd size: every stride-2 path rounds alike
    assert isinstance(y, torch.Tensor)
    cells = [u for u in model if isinstance(u, Cell)]
    assert len(cells) == len(model) - 2
    for cell in cells:
        out = cell(y)
        assert isinstance(out, tuple) and len(out) == 2
        assert out[0] is as_tuple(y)[-1]  # (prev, cur) -> (cur, new)
        y = out
    assert model[-1](y).shape == (2, 3)


def test_preact_width_and_channels():
    model = build("preact-resnet", depth=20, width=2, in_channels=1, num_classes=4)
    assert len(model) == 2 * 3 + 2
    assert model.head.fc.in_features == 64 * 2 * 4
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 4)


def test_as_tuple():
    t = torch.zeros(2)
    assert as_tuple(t) == (t,)
    assert as_tuple((t, t)) == (t, t)
    with pytest.raises(GemsError, match="tensor or a tuple of tensors"):
        as_tuple({"x": t})


# ---- user factories -------------------------------------------------------------------

FACTORIES = """
import torch.nn as nn

def with_classes(num_classes=1000, hidden=4):
    return nn.Sequential(nn.Flatten(1), nn.Linear(12, hidden), nn.Linear(hidden, num_classes))

def without_classes(hidden=4):
    return nn.Sequential(nn.Flatten(1), nn.Linear(12, hidden))

NOT_CALLABLE = 3
"""


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "my_models.py"
    path.write_text(FACTORIES)
    return path


def test_user_factory_from_file(model_file):
    model = build(f"{model_file}:with_classes", num_classes=7, hidden=5)
    assert model(torch.randn(2, 3, 2, 2)).shape == (2, 7)
    assert build(f"{model_file}:without_classes", hidden=6)[1].out_features == 6


def test_user_factory_from_module(tmp_path, monkeypatch):
    package = tmp_path / "zoo_pkg_for_gems_test"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build("zoo_pkg_for_gems_test.nets:with_classes", num_classes=2)
    assert model(torch.randn(2, 12)).shape == (2, 2)


@pytest.mark.parametrize("spec, kw, message", [
    ("{file}:missing", {}, "has no 'missing'; define def missing"),
    ("{file}:NOT_CALLABLE", {}, "not a function"),
    ("{file}:with_classes", {"depth": 3}, "does not accept depth"),
    ("{file}", {}, "does not name a factory"),
    ("{dir}/nowhere.py:make", {}, "does not exist"),
    ("no_such_module_for_gems_test.sub:make", {}, "cannot import module .*PYTHONPATH"),
])
def test_user_factory_errors(model_file, spec, kw, message):
    spec = spec.format(file=model_file, dir=model_file.parent)
    with pytest.raises(GemsError, match=message):
        build(spec, **kw)


def test_user_module_with_broken_import_shows_the_real_error(tmp_path, monkeypatch):
    (tmp_path / "broken_for_gems_test.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="not_installed_dependency_xyz"):
        build("broken_for_gems_test:make")


# ---- bad input ------------------------------------------------------------------------

@pytest.mark.parametrize("name, kw, message", [
    ("resnet51", {}, r"unknown model 'resnet51'; choose one of resnet18.*file\.py:factory"),
    ("resnet18", {"depth": 3}, "resnet18 fixes depth"),
    ("resnet18", {"dropout": 0.1}, "has no option dropout; its options are: layers"),
    ("resnet18", {"width_per_group": 128}, "basic blocks"),
    ("resnet50", {"layers": [3, 4, 6]}, "four positive block counts"),
    ("resnet50", {"num_classes": 0}, "num_classes must be a positive integer"),
    ("preact-resnet", {"depth": 100}, r"9n \+ 2.*got 100"),
    ("preact-resnet", {"width": 0}, "width must be a positive integer"),
    ("preact-resnet1001", {"depth": 110}, "fixes depth.*'preact-resnet' with depth"),
    ("amoebanet-d", {"num_layers": 4}, "multiple of 3"),
    ("amoebanet-d", {"num_filters": 6}, "multiple of 4"),
])
def test_bad_input_names_the_fix(name, kw, message):
    with pytest.raises(GemsError, match=message):
        with torch.device("meta"):
            build(name, **kw)


def test_models_do_not_import_the_gems_runtime():
    """Models know nothing of stages, ranks or devices: only gems.errors may be imported."""
    for path in (Path(__file__).parents[1] / "models").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            for module in modules:
                assert not module.startswith("gems") or module == "gems.errors", f"{path.name} imports {module}"


def test_unet_keeps_any_input_size_and_is_traced_into_units():
    from gems.graph import graph_units  # noqa: PLC0415
    model = build("unet", num_classes=3, width=4, depth=3, groups=2).eval()
    x = torch.randn(2, 3, 18, 22)
    assert model(x).shape == (2, 3, 18, 22)
    units = graph_units(model, (3, 16, 16), batch=2)
    assert "down.0.0" in units.unit_names and any(n.startswith("up.1") for n in units.unit_names)
    y = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(units(y), model(y))
