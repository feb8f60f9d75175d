"""Issue 41, item 8: how far apart is rounding? --perturb nudges a run by one ulp (or reshuffles its
batches' rows); the yardstick's spread of nudged runs judges a gap between two runs: a layout's
rounding falls within it, a changed learning rate outside."""
import numpy as np
import pytest

from conftest import run_main
from manual_dp import perturb, yardstick
from manual_dp.cli.options import parse

TINY = ["--epochs", "2", "--train-size", "512", "--test-size", "64", "--batch-size", "64", "--no-progress"]


def test_one_ulp_moves_every_value_by_exactly_one_ulp():
    a = np.array([1.0, -2.5, 3e-8, 0.0], dtype=np.float32)
    b = perturb.one_ulp(a, 0)
    assert b.dtype == np.float32 and not np.array_equal(a, b)
    assert np.array_equal(np.abs(b - a), np.abs(np.spacing(a)))


def test_order_reshuffles_rows_within_batches_only():
    base, nudged = np.random.default_rng(5), perturb.WithinBatches(np.random.default_rng(5), 4, 1)
    want, got = base.permutation(10), nudged.permutation(10)
    assert not np.array_equal(want, got)
    assert all(sorted(want[i:i + 4]) == sorted(got[i:i + 4]) for i in range(0, 10, 4))
    assert nudged.bit_generator.state == base.bit_generator.state     # a checkpoint's state is the run's


def test_a_layouts_gap_is_within_rounding_and_another_lr_is_outside(data_dir):
    data = ["--data-dir", str(data_dir), *TINY]
    by_kind, base = yardstick.spreads(parse(["--cpus", "1", *data]), 2, ["weights"], yardstick.train_quietly)
    assert len(base) == 2 and all(s > 0 for s in by_kind["weights"])       # one ulp moves the loss
    widest = by_kind["weights"]
    one = dict(enumerate(base, start=1))
    losses = lambda argv: {r["epoch"]: r["train_loss"] for r in yardstick.train_quietly(parse([*argv, *data]))}
    lines, within = yardstick.verdicts(losses(["--cpus", "2"]), one, widest)
    assert within, lines
    lines, within = yardstick.verdicts(losses(["--cpus", "1", "--lr", "0.08"]), one, widest)
    assert not within and "OUTSIDE" in lines[0], lines


@pytest.mark.parametrize("argv, message", [
    (["--runs", "0", "--", "--cpus", "1"], "--runs must be 1 to 100"),
    (["--runs", "2"], "give the run to measure after --"),
    (["--kinds", "weights,bits", "--", "--cpus", "1"], "--kinds weights, inputs and/or order"),
    (["--", "--cpus", "1", "--perturb", "order:1"], "take no --perturb"),
    (["--compare", "/nonexistent/a", "/nonexistent/b", "--", "--cpus", "1"], "--compare /nonexistent/a: not a --log-json"),
])
def test_bad_input_is_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        yardstick.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0], err


def test_perturb_flag_refused_in_one_line(capsys):
    code, _, err = run_main(capsys, ["--perturb", "weights:x"])
    assert code == 2 and len(err) == 1 and "--perturb takes KIND:SEED" in err[0], err
