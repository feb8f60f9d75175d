"""Issue 41, item 4, the checkpoint's part: a checkpoint is input from outside. Files whose checksum
is valid but whose contents lie (a huge array shape, huge or deeply nested metadata, another
generator's random state, junk in the history, impossible counts) and checkpoint paths that are no
regular file are refused with one line (exit 1 from the command line), before any of it is used."""
import io
import json
import os
import zipfile

import numpy as np
import pytest

from manual_dp import checkpoint
from manual_dp.errors import CheckpointError
from manual_dp.lesson import LENET_SHAPES
from conftest import run_main

TINY = ["--train-size", "100", "--test-size", "64", "--batch-size", "32", "--no-progress", "--epochs", "1"]


def lenet(epoch=1, t=3):
    """(meta without its checksum, arrays) of a small valid LeNet checkpoint."""
    rng = np.random.RandomState(0)
    params = [rng.randn(*shape).astype(np.float32) for _, shape in LENET_SHAPES]
    arrays = {f"param_{i}": p for i, p in enumerate(params)}
    arrays.update({f"opt_{i}_0": p * 0.5 for i, p in enumerate(params)})
    history = [{"epoch": e, "test_acc": 0.5, "epoch_sec": 1.0, "images_per_sec": 9.0} for e in range(1, epoch + 1)]
    meta = {"epoch": epoch, "history": history, "config": {"lr": 0.05},
            "rng_state": np.random.default_rng(0).bit_generator.state, "t": t, "n_params": 8, "n_opt": [1] * 8,
            "n_extra": {}}
    return meta, arrays


def write(directory, meta, arrays, raw=None):
    """checkpoint.npz in `directory` holding `arrays` and `meta` with a valid checksum (or the
    metadata bytes `raw` as they are)."""
    directory.mkdir(parents=True, exist_ok=True)
    meta = dict(meta, sha256=checkpoint.digest(meta, arrays)) if raw is None else meta
    raw = json.dumps(meta).encode() if raw is None else raw
    with open(directory / checkpoint.NAME, "wb") as f:
        np.savez(f, meta=np.frombuffer(raw, dtype=np.uint8), **arrays)
    return directory


def refused(directory, words):
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(directory)
    assert words in str(e.value) and "\n" not in str(e.value), e.value


def test_a_member_claiming_a_huge_shape_is_refused_before_it_is_read(tmp_path):
    write(tmp_path, *lenet())
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": (2 ** 40,)})
    with zipfile.ZipFile(tmp_path / checkpoint.NAME, "a") as z:
        z.writestr("extra_x_0.npy", buf.getvalue() + b"\0" * 64)
    refused(tmp_path, "claims (1099511627776,) float32, more than the file holds")


def test_metadata_larger_than_its_bound_is_refused(tmp_path):
    meta, arrays = lenet()
    write(tmp_path, dict(meta, config={"lr": 0.05, "junk": "x" * (65 << 20)}), arrays)
    refused(tmp_path, "its metadata is")


def test_deeply_nested_metadata_is_refused(tmp_path):
    meta, arrays = lenet()
    deep = []
    for _ in range(30):
        deep = [deep]
    write(tmp_path, dict(meta, config={"lr": 0.05, "deep": deep}), arrays)
    refused(tmp_path, "its metadata nests more than")


def test_metadata_too_deep_to_parse_is_refused(tmp_path):
    meta, arrays = lenet()
    raw = json.dumps(meta)[:-1] + ', "model": ' + "[" * 100000 + "]" * 100000 + ', "sha256": "0"}'
    write(tmp_path, meta, arrays, raw=raw.encode())
    refused(tmp_path, "unreadable checkpoint (RecursionError")


@pytest.mark.parametrize("state", [
    {"bit_generator": "MT19937", "state": {"key": [0] * 624, "pos": 624}},
    {"bit_generator": "PCG64", "state": "x", "has_uint32": 0, "uinteger": 0},
    {"bit_generator": "PCG64", "state": {"state": 2 ** 200, "inc": 3}, "has_uint32": 5, "uinteger": -3},
], ids=["mt19937", "a-string", "out-of-range"])
def test_a_random_state_of_another_generator_or_a_broken_one_is_refused(tmp_path, state):
    meta, arrays = lenet()
    write(tmp_path, dict(meta, rng_state=state), arrays)
    refused(tmp_path, "random-number state is not a PCG64 generator's")


@pytest.mark.parametrize("history, words", [
    ([1], "record 1 is not the record of epoch 1"),
    ([{"epoch": 1, "test_acc": "x"}], "test_acc is 'x', not a finite number"),
    ([{"epoch": 1, "test_acc": float("nan")}], "not a finite number"),
    ([{"epoch": 1}, {"epoch": 2}], "holds 2 epoch record(s) after epoch 1"),
])
def test_junk_in_the_history_is_refused(tmp_path, history, words):
    meta, arrays = lenet()
    write(tmp_path, dict(meta, history=history), arrays)
    refused(tmp_path, words)


@pytest.mark.parametrize("field, value, words", [
    ("epoch", -5, "epoch -5 is negative"), ("t", -1, "update count -1"), ("t", 10 ** 40, "update count"),
    ("n_opt", ["a"] * 8, "array counts"), ("n_extra", {"x": "abc"}, "extra arrays"),
    ("n_extra", {"x": 2}, "its x state (extra_x_0) is missing"),
])
def test_impossible_counts_are_refused(tmp_path, field, value, words):
    meta, arrays = lenet()
    write(tmp_path, dict(meta, **{field: value}), arrays)
    refused(tmp_path, words)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir):
    """A real checkpoint of a one-epoch run: (its directory, the flags that resume it)."""
    from manual_dp.train import main
    ck = tmp_path_factory.mktemp("trained") / "ck"
    argv = ["--data-dir", str(data_dir), *TINY, "--cpus", "1", "--checkpoint-dir", str(ck)]
    main(argv)
    return ck, argv + ["--resume"]


def rewritten(trained, tmp_path, **fields):
    """A copy of the trained checkpoint with `fields` of its metadata replaced, its checksum valid."""
    ck, argv = trained
    with np.load(ck / checkpoint.NAME) as z:
        meta = json.loads(z["meta"].tobytes().decode())
        arrays = {k: z[k] for k in z.files if k != "meta"}
    meta.pop("sha256")
    write(tmp_path / "ck", dict(meta, **fields), arrays)
    return [a if a != str(ck) else str(tmp_path / "ck") for a in argv]


@pytest.mark.parametrize("fields, words", [
    ({"history": [{"epoch": 1, "test_acc": "x", "epoch_sec": 1.0, "images_per_sec": 1.0}]}, "test_acc is 'x'"),
    ({"rng_state": {"bit_generator": "MT19937", "state": {"key": [0] * 624, "pos": 624}}}, "not a PCG64"),
    ({"t": 10 ** 6}, "counts 1000000 updates after 1 epoch(s) of 100 examples"),
    ({"history": [{"epoch": 1}]}, "its history lacks test_acc"),
], ids=["history", "rng", "updates", "record"])
def test_resuming_from_a_lying_checkpoint_ends_with_one_line(capsys, trained, tmp_path, fields, words):
    code, out, err = run_main(capsys, rewritten(trained, tmp_path, **fields))
    assert code == 1 and len(err) == 1 and words in err[0], err
    assert "resumed" not in out


@pytest.mark.parametrize("kind", ["dangling", "loop", "fifo"])
def test_resuming_from_a_checkpoint_that_is_no_regular_file_is_refused(capsys, trained, tmp_path, kind):
    argv = rewritten(trained, tmp_path)
    path = tmp_path / "ck" / checkpoint.NAME
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(tmp_path / "gone.npz" if kind == "dangling" else path)
    code, out, err = run_main(capsys, argv)
    assert code == 1 and len(err) == 1 and str(path) in err[0], err
    assert "epoch 1" not in out and os.path.lexists(path) and not path.is_file()
