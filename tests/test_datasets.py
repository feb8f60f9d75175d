"""The data contract (manual_dp/datasets/): every kind of --data held to its Spec, and every bad
input refused in one line before any training."""
import os

import numpy as np
import pytest

from conftest import run_main
from manual_dp import datasets
from manual_dp.config import RunConfig
from manual_dp.datasets import fortunes
from manual_dp.datasets.contract import Dataset, Spec, check
from manual_dp.errors import DataError
from test_lstm import fortunes_dir


def test_fortunes_are_split_by_percent_lines_and_held_out_by_position(tmp_path):
    data = fortunes_dir(tmp_path / "f", sizes=(23, 15, 8))
    (data / "cat0.dat").write_bytes(b"\0\1index")                       # strfile's index: not a category
    os.symlink(data / "cat1", data / "cat1.u8")                          # the package's .u8 links: skipped
    got = fortunes.load(str(data), seq_len=10)
    assert got.spec == Spec((10,), 3, 256, names=("cat0", "cat1", "cat2"))
    (X, y), (Xt, yt) = got.train, got.test
    assert np.bincount(y).tolist() == [21, 14, 8] and np.bincount(yt, minlength=3).tolist() == [2, 1, 0]
    first = b"fortune 0 of a"[:10]
    assert X[0].tolist() == list(first) and X.dtype == np.float32
    short = fortunes.encode(b"hi", 5)
    assert short.tolist() == [0, 0, 0, ord("h"), ord("i")]               # left-padded: the last step reads "i"


def test_only_the_largest_categories_are_kept(tmp_path, monkeypatch):
    monkeypatch.setitem(fortunes.FORTUNES, "categories", 2)
    got = fortunes.load(str(fortunes_dir(tmp_path / "f", sizes=(3, 9, 5))), seq_len=4)
    assert got.spec.names == ("cat1", "cat2") and got.spec.classes == 2


def test_debian_fortunes_package_is_read_when_installed():
    if not os.path.isdir(fortunes.FORTUNES["directory"]):
        pytest.skip("Debian's fortunes package is not installed (setup.sh installs it)")
    got = datasets.load(RunConfig(data="fortunes"))
    assert got.spec.classes == 10 and got.spec.shape == (128,) and len(got.train[0]) > 5000


def arrays(path, **named):
    np.savez(path, **named)
    return f"npz:{path}"


def test_npz_values_tokens_and_held_out_rows(tmp_path):
    rng = np.random.RandomState(0)
    values = datasets.read(arrays(tmp_path / "v.npz", X=rng.rand(20, 3, 4), y=np.arange(20) % 4), None, 8)
    assert values.spec == Spec((3, 4), 4) and len(values.train[0]) == 18 and len(values.test[0]) == 2
    given = datasets.read(arrays(tmp_path / "t.npz", X=rng.randint(0, 7, (9, 5)), y=np.arange(9) % 2,
                                 X_test=rng.randint(0, 9, (3, 5)), y_test=np.array([0, 1, 2])), None, 8)
    assert given.spec == Spec((5,), 3, 9) and len(given.test[0]) == 3       # vocab and classes from both splits


@pytest.mark.parametrize("named, message", [
    (dict(X=np.zeros((4, 2))), "needs arrays X and y"),
    (dict(X=np.zeros((4, 2)), y=np.zeros(4), X_test=np.zeros((1, 2))), "and X_test with y_test"),
    (dict(X=np.zeros((4, 2)), y=np.array([0.5, 1, 0, 1])), "whole class numbers"),
    (dict(X=np.zeros((4, 2)), y=np.zeros(3)), "one label per input"),
    (dict(X=np.zeros(4), y=np.zeros(4)), "one example per row"),
    (dict(X=np.array([[1.0, np.nan]] * 4), y=np.zeros(4)), "not a finite number"),
    (dict(X=np.array([["a"]] * 4), y=np.zeros(4)), "must be (N, ...) numbers"),
    (dict(X=np.zeros((4, 2), int), y=np.zeros(4), X_test=np.zeros((1, 2)), y_test=np.zeros(1)), "X_test does not"),
])
def test_bad_arrays_are_refused_in_one_line(tmp_path, named, message):
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        datasets.read(arrays(tmp_path / "bad.npz", **named), None, 8)


def test_a_pickled_or_broken_file_is_refused(tmp_path):
    np.savez(tmp_path / "p.npz", X=np.array([{"a": 1}] * 2, dtype=object), y=np.zeros(2))
    with pytest.raises(DataError, match="without pickles"):
        datasets.read(f"npz:{tmp_path / 'p.npz'}", None, 8)
    (tmp_path / "broken.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="not a readable .npz"):
        datasets.read(f"npz:{tmp_path / 'broken.npz'}", None, 8)


def test_the_contract_refuses_tokens_outside_the_vocabulary():
    bad = Dataset(Spec((2,), 2, 4), (np.array([[1, 4]], np.float32), np.zeros(1, np.int32)),
                  (np.zeros((0, 2), np.float32), np.zeros(0, np.int32)), "made")
    with pytest.raises(DataError, match="token id that is not a whole number in 0..3"):
        check(bad)


def test_cli_trains_an_mlp_on_the_users_arrays(capsys, tmp_path):
    rng = np.random.RandomState(0)
    X = rng.rand(200, 6).astype(np.float32)
    data = arrays(tmp_path / "mine.npz", X=X, y=(X[:, 0] > 0.5).astype(np.int64))
    code, out, err = run_main(capsys, ["--model", "mlp", "--data", data, "--cpus", "2", "--epochs", "3",
                                       "--batch-size", "20", "--lr", "0.1"])
    assert code == 0, err
    assert "180 train / 20 test examples" in out and float(out.split("test acc ")[-1].split()[0]) > 0.8


@pytest.mark.parametrize("argv, code, message", [
    (["--data", "imagenet"], 2, "--data imagenet: choose fashion-mnist, fortunes, text, npz"),
    (["--data", "npz"], 2, "--data npz needs the file"),
    (["--seq-len", "8"], 2, "--seq-len applies only to --data fortunes"),
    (["--data", "fortunes:FOLDER", "--data-dir", "x"], 2, "--data-dir is Fashion-MNIST's folder"),
    (["--data", "fortunes:FOLDER", "--seq-len", "0"], 2, "--seq-len must be >= 1"),
    (["--data", "fortunes:FOLDER"], 2, "--model lenet: reads 28x28 images of 10 classes"),
    (["--data", "fortunes:FOLDER/missing", "--model", "lstm"], 1, "does not exist"),
    (["--data", "npz:FOLDER/none.npz", "--model", "mlp"], 1, "no such file"),
])
def test_cli_data_refusals_are_one_line(capsys, tmp_path, argv, code, message):
    folder = fortunes_dir(tmp_path / "f")
    argv = [a.replace("FOLDER", str(folder)) for a in argv]
    got, _, err = run_main(capsys, ["--cpus", "1", *argv])
    assert got == code and len(err) == 1 and message in err[0], err
