"""Bad input, generated: every command line, plan file and size string a user could type ends in a
result or in one clear line with exit status 2 -- never a traceback.

Property-based (hypothesis): random flags and values from a grammar of valid and invalid ones,
random mutations of a valid plan's JSON, random size strings. The CLIs run in this process (an MPI
singleton; gems-train always with --dry-run, so no case trains). GEMS_FUZZ_SCALE=10 explores ten
times as many cases as the default, which keeps this file under a minute.
"""
from __future__ import annotations

import io
import json
import os
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO
from gems.errors import GemsError
from gems.units import _FACTORS, format_size, parse_size

SCALE = float(os.environ.get("GEMS_FUZZ_SCALE", "1"))
TINY = f"{REPO}/tests/assets/tiny_model.py:tiny"


def fuzz(examples: int):
    """hypothesis settings: ``examples`` cases (times GEMS_FUZZ_SCALE), no deadline (the machine is
    shared), no example database left in the repository."""
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


def invoke(main, argv: list[str]) -> tuple[int, str, str]:
    """Run a CLI ``main`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = exit_.code
    return (0 if status is None else status), out.getvalue(), err.getvalue()


def assert_clean(prog: str, argv: list[str], status: int, err: str) -> None:
    """Exit 0, or exit 2 with exactly one line ``prog: error...`` on stderr; never a traceback."""
    assert status in (0, 2), f"{argv}: exit {status!r}\n{err}"
    assert "Traceback" not in err, f"{argv}\n{err}"
    if status == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{prog}: error"), f"{argv}\n{err}"


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    """Files the grammars refer to: plan files (valid, garbage), an image folder, a plain file."""
    from PIL import Image  # noqa: PLC0415

    from gems.cli.plan import main as gems_plan  # noqa: PLC0415

    root = tmp_path_factory.mktemp("fuzz")
    plan = root / "plan.json"
    status, _, err = invoke(gems_plan, ["--model", TINY, "--image-size", "32", "--batch-size", "2", "--stages", "1",
                                        "--schedule", "mp", "--num-classes", "10", "--json", str(plan)])
    assert status == 0, err
    for c in range(2):
        (root / "images" / f"c{c}").mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (24, 20), "red").save(root / "images" / f"c{c}" / f"{i}.png")
    (root / "garbage.json").write_text('{"cuts": [0, ')
    (root / "empty").mkdir()
    return {"plan": str(plan), "garbage": str(root / "garbage.json"), "images": str(root / "images"),
            "empty": str(root / "empty"), "file": str(plan), "dir": str(root / "out")}


# -- 1. command lines -------------------------------------------------------------------------------

# Each flag: (values argparse takes, good or bad for gems; values argparse refuses). None: the flag alone.
INTS = (["-1", "0", "1", "2", "3", "4", "8", "64", "99999999999999999999"], ["x", "", "1.5"])
FLOATS = (["0.1", "0", "-1", "nan", "inf", "-inf", "1e-3", "1e309"], ["x", ""])
SIZES = (["40GiB", "1KiB", "512MiB", "0", "12"], ["40GB?", "", "-1", "1e999G", "nan", "inf"])
Grammar = dict[str, tuple[list[str | None], list[str | None]]]


def train_grammar(assets: dict[str, str]) -> Grammar:
    """gems-train's flags and values to try."""
    return {
        "--model": ([TINY, TINY, "nosuchnet", f"{REPO}/tests/assets/tiny_model.py:nothere", "missing.py:make", "",
                     ":", "resnet18"], []),
        "--num-classes": INTS,
        "--image-size": (["16", "32", "32", "64", "0", "-5", "7", "2048", "99999", "4294967296",
                          "99999999999999999999"], ["x", "32x32"]),
        "--batch-size": INTS, "--stages": (["1", "1", "1", "2", "0", "-1"], ["x"]),
        "--schedule": (["mp", "gpipe", "1f1b", "mast"], ["zigzag", ""]), "--micro-batches": INTS,
        "--plan": ([assets["plan"], assets["plan"], "/nonexistent/plan.json", assets["garbage"], assets["empty"],
                    "{", '{"cuts": 3}'], []),
        "--balance-by": (["memory", "time", "flops"], ["luck"]),
        "--balance": (["5", "2,3", "a,b", "0,5", "-1,6", ",", ""], []),
        "--memory-budget": (SIZES[0] + SIZES[1], []),   # parsed by gems, not argparse
        "--recompute": (["none", "auto", "all"], ["some"]), "--offload": (["none", "auto", "all"], ["x"]),
        "--data": (["synthetic", "synthetic", "/nonexistent/images", assets["file"], assets["empty"],
                    assets["images"]], []),
        "--workers": (["-1", "0", "2"], ["x"]), "--seed": (["0", "-5", str(2**63 - 1), str(2**70)], ["x"]),
        "--enforce-memory-budget": ([None], []),
        "--optimizer": (["sgd", "adam"], ["rmsprop"]), "--lr": FLOATS, "--momentum": FLOATS,
        "--weight-decay": FLOATS, "--warmup-steps": INTS, "--lr-schedule": (["cosine", "constant"], ["step"]),
        "--steps": INTS, "--epochs": INTS, "--clip-grad-norm": FLOATS, "--amp": (["none", "bf16"], ["fp8"]),
        "--skip-nonfinite": ([None], []), "--comm": (["mpi"], ["carrier-pigeon"]), "--timeout": FLOATS,
        "--metrics": ([assets["dir"] + "/m.jsonl", "/proc/m.jsonl"], []),
        "--checkpoint-dir": ([assets["dir"], "/proc/gems-ck"], []), "--checkpoint-every": INTS,
        "--keep-checkpoints": INTS, "--resume": ([None], []), "--no-resume": ([None], []),
        "--trace": ([assets["dir"] + "/t.json"], []), "--trace-png": ([assets["dir"] + "/t.png"], []),
        "--progress": ([None], []), "--no-progress": ([None], []),
    }


@st.composite
def command_lines(draw, grammar: Grammar) -> list[str]:
    """Up to 8 flags in random order, each with a value argparse takes (valid for gems or not);
    now and then one argparse refuses, a flag missing its value, an unknown flag or a stray word."""
    flags = draw(st.lists(st.sampled_from(sorted(grammar)), max_size=8, unique=True))
    argv: list[str] = []
    for flag in flags:
        parsed, refused = grammar[flag]
        value = draw(st.sampled_from(refused if refused and draw(st.integers(0, 15)) == 0 else parsed))
        argv += [flag] if value is None else [flag, value]
    mistake = draw(st.integers(0, 19))
    if mistake == 0:
        argv.append(draw(st.sampled_from(sorted(f for f in grammar if None not in grammar[f][0]))))
    elif mistake == 1:
        argv.insert(draw(st.integers(0, len(argv))), draw(st.sampled_from(["--bogus", "extra", "-x"])))
    return argv


@given(data=st.data())
@fuzz(60)
def test_gems_train_command_lines(assets, data):
    from gems.cli.train import main  # noqa: PLC0415

    argv = ["--model", TINY, "--image-size", "32", "--stages", "1", "--no-progress", "--workers", "0",
            *data.draw(command_lines(train_grammar(assets))), "--dry-run"]
    status, _, err = invoke(main, argv)
    assert_clean("gems-train", argv, status, err)


def plan_grammar(assets: dict[str, str]) -> Grammar:
    """gems-plan's flags and values to try."""
    return {
        "--model": (["resnet18", "resnet18", TINY, "no-such-net", "missing.py:make", ""], []),
        "--image-size": (["64", "64", "32x48", "2048", "8", "99999999999", "4294967296x1"],
                         ["0", "32x", "x", "-5", "64x0"]),
        "--channels": (["1", "3", "99999999999999999999", str(2**62)], ["0", "x"]), "--batch-size": INTS,
        "--stages": (["1", "2", "3", "99"], ["0", "x"]),
        "--schedule": (["mp", "gpipe", "1f1b", "mast"], ["zigzag"]), "--micro-batches": INTS,
        "--groups": (["1", "2"], ["0", "x"]), "--balance-by": (["memory", "time", "flops"], ["luck"]),
        "--balance": (["5", "2,3", "3,3,4", "8,2"], ["a,b", "0,5", ""]), "--memory-budget": SIZES,
        "--recompute": (["none", "auto", "all"], ["x"]), "--offload": (["none", "auto", "all"], ["x"]),
        "--device": (["cuda", "cpu"], ["tpu"]), "--host-bandwidth": (["12GB/s", "25e9"], ["0", "-1", "x", "nan"]),
        "--optimizer": (["sgd", "adam"], ["lamb"]), "--dtype": (["float32", "bfloat16"], ["float64"]),
        "--num-classes": INTS,
        "--json": ([assets["dir"] + "/p.json", "/no/such/dir/p.json", assets["empty"]], []),
        "--simulate": ([None], []), "--device-tflops": FLOATS, "--efficiency": FLOATS,
    }


@given(data=st.data())
@fuzz(40)
def test_gems_plan_command_lines(assets, data):
    from gems.cli.plan import main  # noqa: PLC0415

    os.makedirs(assets["dir"], exist_ok=True)
    argv = ["--model", "resnet18", "--image-size", "64", "--batch-size", "2", "--stages", "2", "--num-classes", "10",
            *data.draw(command_lines(plan_grammar(assets)))]
    status, _, err = invoke(main, argv)
    assert_clean("gems-plan", argv, status, err)


# -- 2. plan files ----------------------------------------------------------------------------------

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10, 10**12) | st.floats(allow_nan=False)
                           | st.text(max_size=6),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                         max_size=3),
                           max_leaves=5)


@st.composite
def mutated_plans(draw, text: str) -> str:
    """A valid plan's JSON, damaged: cut short, or one value somewhere replaced, removed or nudged."""
    how = draw(st.sampled_from(["truncate", "replace", "delete", "nudge", "nudge", "add"]))
    if how == "truncate":
        return text[:draw(st.integers(0, len(text) - 1))]
    data = json.loads(text)
    parent, key = None, None
    node = data
    while isinstance(node, (dict, list)) and node and (parent is None or draw(st.booleans())):
        keys = sorted(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, draw(st.sampled_from(keys))
        node = node[key]
    if parent is None:
        return json.dumps(draw(JSON_VALUES))
    if how == "delete":
        del parent[key]
    elif how == "add" and isinstance(parent, dict):
        parent[draw(st.text(max_size=8))] = draw(JSON_VALUES)
    elif how == "nudge" and isinstance(node, int) and not isinstance(node, bool):
        parent[key] = node + draw(st.sampled_from([-1, 1, -node - 1, 10**9]))
    else:
        parent[key] = draw(JSON_VALUES)
    return json.dumps(data)


@given(data=st.data())
@fuzz(200)
def test_damaged_plan_json_is_read_or_refused_in_one_sentence(assets, data):
    from gems.partition import Plan  # noqa: PLC0415

    text = data.draw(mutated_plans(Path(assets["plan"]).read_text()))
    try:
        plan = Plan.from_json(text)
    except GemsError as error:
        assert len(str(error).splitlines()) == 1, repr(str(error))
        return
    plan.table()   # a plan that loads can be shown (gems-train --dry-run prints it)


@given(data=st.data())
@fuzz(40)
def test_damaged_plan_files_given_to_gems_train(assets, data, tmp_path_factory):
    from gems.cli.train import main  # noqa: PLC0415

    path = tmp_path_factory.mktemp("plans") / "plan.json"
    path.write_text(data.draw(mutated_plans(Path(assets["plan"]).read_text())))
    argv = ["--model", TINY, "--image-size", "32", "--batch-size", "2", "--stages", "1", "--schedule", "mp",
            "--no-progress", "--workers", "0", "--plan", str(path), "--dry-run"]
    status, _, err = invoke(main, argv)
    assert_clean("gems-train", argv, status, err)


@pytest.mark.parametrize("edit, message", [
    ({"input_shape": []}, "input shape [] is not a sample's shape"),
    ({"fits": False, "memory_budget": None}, "says whether it fits (fits: false) but has no memory budget"),
])
def test_plans_hypothesis_found_are_refused_in_one_sentence(assets, tmp_path, edit, message):
    """Two damaged plans the fuzzing above once turned into tracebacks."""
    from gems.cli.train import main  # noqa: PLC0415

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(json.loads(Path(assets["plan"]).read_text()) | edit))
    argv = ["--model", TINY, "--image-size", "32", "--batch-size", "2", "--stages", "1", "--schedule", "mp",
            "--no-progress", "--workers", "0", "--plan", str(path), "--dry-run"]
    status, _, err = invoke(main, argv)
    assert status == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("change, message", [
    (["--image-size", "64"], "was made for inputs of 3x32x32, not 3x64x64"),
    (["--model", "resnet18"], "was made for a model of 5 units (0..4), but resnet18 has 10 units (stem..head)"),
])
def test_a_plan_for_another_model_or_image_size_is_refused(assets, change, message):
    from gems.cli.train import main  # noqa: PLC0415

    argv = ["--model", TINY, "--image-size", "32", "--batch-size", "2", "--stages", "1", "--schedule", "mp",
            "--no-progress", "--workers", "0", "--plan", assets["plan"], "--dry-run", *change]
    status, _, err = invoke(main, argv)
    assert status == 2 and message in err, err


# -- 3. sizes ---------------------------------------------------------------------------------------

@given(number=st.integers(0, 10**6), unit=st.sampled_from(sorted(_FACTORS)), space=st.sampled_from(["", " "]),
       upper=st.booleans())
@fuzz(300)
def test_sizes_with_every_unit_parse_exactly(number, unit, space, upper):
    text = f"{number}{space}{unit.upper() if upper else unit}"
    assert parse_size(text) == number * _FACTORS[unit]


@given(nbytes=st.integers(0, 2**60))
@fuzz(300)
def test_formatted_sizes_parse_back_within_rounding(nbytes):
    again = parse_size(format_size(nbytes).replace(" ", ""))
    # two decimals of the unit (at most nbytes), then whole bytes
    assert abs(again - nbytes) <= 0.005 * nbytes + 1, (nbytes, format_size(nbytes), again)


@given(text=st.one_of(st.text(max_size=12),
                      st.text(alphabet="0123456789.eE+- kKmMgGtTiIbB", max_size=12)))
@fuzz(500)
def test_any_text_is_a_size_or_a_gems_error(text):
    try:
        value = parse_size(text)
    except GemsError as error:
        assert len(str(error).splitlines()) == 1, repr(str(error))
        return
    assert isinstance(value, int) and value >= 0
