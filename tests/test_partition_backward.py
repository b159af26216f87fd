"""gems.partition.backward: ``plan(split_backward=None)`` (``--split-backward auto``) keeps the split
plan where the simulator predicts a shorter step and it fits the budget, the plain one otherwise;
the three commands take ``--split-backward [auto|on|off]``. That an auto plan trains like one
process: tests/test_split_backward.py."""
from __future__ import annotations

import pytest
from torch import nn

from conftest import cli_cases
from gems.cli import bench as gems_bench, plan as gems_plan, train as gems_train
from gems.errors import GemsError
from gems.partition import Plan, plan
from gems.partition.backward import TIE, predicted_step, split_mode
from gems.partition.profile import profile
from gems.train.config import TrainConfig

SHAPE = (8, 16, 16)


def convs(n: int) -> nn.Sequential:
    """``n`` equal units: with equal balances, stages of equal cost (what the schedules were tuned for)."""
    return nn.Sequential(*[nn.Conv2d(8, 8, 3, padding=1) for _ in range(n)])


def three_ways(model: nn.Module, stages: int, m: int, schedule: str = "mast", **kw):
    """The plans without the split, with it, and with auto, for equal stages."""
    n = len(model)
    balance = [n // stages] * stages
    batch = 2 * m if schedule == "mast" else m
    profiles: dict = {}
    return [plan(model, SHAPE, batch, stages, schedule, m, balance=balance, split_backward=split, profiles=profiles,
                 **kw) for split in (False, True, None)]


def test_auto_splits_where_the_simulator_predicts_a_shorter_step():
    plain, split, auto = three_ways(convs(8), stages=4, m=4)
    assert predicted_step(split) < 0.95 * predicted_step(plain)
    assert auto.split_backward and auto.cuts == split.cuts and auto.order == split.order
    assert predicted_step(auto) == predicted_step(split)
    note = auto.notes[-1]
    assert note.startswith("backward split (--split-backward auto): predicted step ")
    assert f"{predicted_step(split) * 1e3:.4g} ms split, {predicted_step(plain) * 1e3:.4g} ms not split" in note
    assert "; split backward" in auto.table() and note in auto.table()
    assert not plain.notes and not split.notes   # forced either way: nothing chosen, nothing said


@pytest.mark.parametrize("stages, m", [(2, 1), (2, 2)])
def test_auto_keeps_the_plain_plan_where_splitting_is_no_faster(stages, m):
    """mast K = 2, m = 1 and m = 2: the same step either way (a tie: the simpler plan; at m = 2 the
    split plan's own order, ``Plan.order``, catches up with the unsplit one)."""
    plain, split, auto = three_ways(convs(8), stages, m)
    assert predicted_step(split) >= predicted_step(plain) * (1 - TIE)
    assert not auto.split_backward and auto.cuts == plain.cuts
    assert auto.notes[-1].startswith("backward not split (--split-backward auto): splitting is no faster; "
                                     "predicted step ")
    assert "; split backward" not in auto.table()


def test_auto_keeps_the_plain_plan_where_only_it_fits_the_budget():
    """mast K = 3, m = 2: the split is faster but holds more (its micro-batches stay alive until
    their weight-gradients)."""
    plain, split = three_ways(convs(12), stages=3, m=2)[:2]
    assert predicted_step(split) < predicted_step(plain) and split.peak_bytes > plain.peak_bytes
    tight = three_ways(convs(12), stages=3, m=2, memory_budget=plain.peak_bytes)[2]
    assert not tight.split_backward and tight.fits
    assert tight.notes[-1].startswith("backward not split (--split-backward auto): the split plan does not fit: "
                                      "position ")
    roomy = three_ways(convs(12), stages=3, m=2, memory_budget=split.peak_bytes)[2]
    assert roomy.split_backward and roomy.fits


def test_neither_fitting_keeps_the_plain_plan_and_names_the_smallest_fitting_stage_count():
    model = convs(12)
    plain = three_ways(model, stages=3, m=2)[0]
    auto = plan(model, SHAPE, 4, 3, "mast", 2, balance=[4, 4, 4], memory_budget=plain.peak_bytes - 1,
                split_backward="auto")
    assert not auto.split_backward and auto.fits is False and auto.smallest_fitting_stages
    assert "neither plan fits the budget" in auto.notes[-1]


@pytest.mark.parametrize("value, expected", [(None, None), ("auto", None), (True, True), ("on", True),
                                             (False, False), ("off", False), (" Auto ", None)])
def test_split_mode(value, expected):
    assert split_mode(value) is expected


@pytest.mark.parametrize("value", ["sometimes", "", 1, 0.5, "true"])
def test_a_bad_split_backward_names_the_choices(value):
    with pytest.raises(GemsError, match="split backward must be one of auto, on, off"):
        plan(convs(2), SHAPE, 2, 2, split_backward=value)
    with pytest.raises(GemsError, match="split backward must be one of auto, on, off"):
        TrainConfig(split_backward=value, stages=1).validate()


FORMS = [([], "off"), (["--split-backward"], "on"), (["--split-backward", "auto"], "auto"),
         (["--split-backward", "on"], "on"), (["--split-backward=off"], "off"),
         (["--split-backward", "--stages", "3"], "on")]   # the flag alone, before another: on, as it always was


@pytest.mark.parametrize("argv, value", FORMS)
def test_flag_forms(argv, value):
    plan_args = gems_plan.build_parser().parse_args(["--model", "x", "--image-size", "8", "--batch-size", "2", *argv])
    assert plan_args.split_backward == value
    assert gems_train.parse(argv).split_backward == value and gems_bench.parse(argv).split_backward == value


def test_no_split_backward_stays_valid_where_it_was():
    """gems-train and gems-bench made a --no- flag of every boolean."""
    assert gems_train.parse(["--split-backward", "--no-split-backward"]).split_backward == "off"
    assert gems_bench.parse(["--no-split-backward"]).split_backward == "off"


@pytest.mark.parametrize("main", [gems_plan.main, gems_train.parse, gems_bench.parse])
def test_a_bad_flag_value_is_one_line_and_exit_2(main, capsys):
    argv = ["--model", "resnet18", "--image-size", "64", "--batch-size", "2", "--stages", "2"] * (
        main is gems_plan.main)
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--split-backward", "maybe"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "argument --split-backward: invalid choice: 'maybe' (choose from 'auto', 'on', 'off')" in err


def test_gems_plan_says_what_auto_chose(capsys):
    base = ["--model", "resnet18", "--num-classes", "10", "--image-size", "64", "--batch-size", "8", "--stages", "4"]
    assert gems_plan.main([*base, "--split-backward", "auto"]) == 0
    out = capsys.readouterr().out
    assert "; split backward" in out and "backward split (--split-backward auto): predicted step " in out
    assert gems_plan.main([*base, "--schedule", "mast", "--stages", "2", "--split-backward", "auto"]) == 0
    out = capsys.readouterr().out
    assert "; split backward" not in out and "backward not split (--split-backward auto)" in out


def test_gems_train_plans_with_auto():
    """Through gems-train's main (a dry run: the plan it would train) and its bad-value message."""
    base = ["--model", "tests/assets/tiny_model.py:tiny", "--image-size", "32", "--workers", "0", "--batch-size",
            "2", "--stages", "1", "--dry-run"]
    auto, bad = cli_cases("gems.cli.train", [[*base, "--split-backward", "auto"],
                                             [*base, "--split-backward", "sometimes"]])
    assert auto["code"] == 0, auto["stderr"]
    assert "(--split-backward auto)" in auto["stdout"]
    assert bad["code"] == 2 and "invalid choice: 'sometimes'" in bad["stderr"] and "Traceback" not in bad["stderr"]


def test_a_split_plan_that_needs_tile_groups_to_fit_is_no_rival():
    """With --spatial auto the split plan fits only on more ranks (stage 0 tiled): however fast, the
    plan without the split that fits on K ranks is kept. Stage 0 the largest, so that tiling it is
    what the split needs: the gradients a split keeps between its halves sit in the other stages."""
    model, profiles = convs(12), {}

    def make(split, **kw):
        return plan(model, SHAPE, 4, 3, "mast", 2, balance=[8, 2, 2], split_backward=split, profiles=profiles, **kw)
    plain = make(False)
    forced, auto = (make(split, memory_budget=plain.peak_bytes, spatial="auto") for split in (True, None))
    assert forced.spatial_grid and forced.fits   # what splitting would take
    assert not auto.split_backward and not auto.spatial_grid and auto.fits
    assert "the split plan fits only on 5 ranks per group (tile groups of 2), the other on 3" in auto.notes[-1]


def test_a_split_plan_keeps_the_captured_gradients_of_a_micro_batch_between_its_halves():
    """1f1b K=2 m=1 split: position 1's micro-batch is alive and, from its input half to its weight
    half, keeps the gradients the weight half starts from: the estimate adds the profile's
    ``captured_bytes`` of stage 1's units. Stage 0's input (the image) takes no gradient, so its
    backward is the weight half alone and keeps none."""
    model = convs(4)
    plain, split = (plan(model, SHAPE, 1, 2, "1f1b", 1, balance=[2, 2], split_backward=s) for s in (False, True))
    captured = sum(u.captured_bytes for u in profile(model, SHAPE, 1).units[2:])
    assert captured > 0
    assert split.positions[1].activation_bytes == plain.positions[1].activation_bytes + captured
    assert split.positions[0].activation_bytes == plain.positions[0].activation_bytes
    assert [e.split_bytes for e in Plan.from_json(split.to_json()).stage_estimates] == [0, captured]
    assert "between halves/mb" in split.table() and "between halves/mb" not in plain.table()
