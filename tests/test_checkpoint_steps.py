"""Issue 39, item 2 and 3: checkpoints mid-epoch (--checkpoint-every, --max-steps), resumed in
another layout with the bits of the uninterrupted one-context run, and written by a thread of their
own (--async-checkpoint) with the same bytes; their flags refused in one line."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import run_main, write_dataset
from manual_dp import checkpoint

SMALL = ["--train-size", "320", "--test-size", "64", "--batch-size", "32", "--epochs", "2", "--no-progress",
         "--deterministic"]


def arrays(directory):
    """{name: array} of the checkpoint in `directory`, its metadata apart."""
    state, meta = checkpoint.load(directory)
    return {f"param_{i}": p for i, p in enumerate(state["params"])} | {
        f"opt_{i}_{j}": s for i, st in enumerate(state["opt_state"]) for j, s in enumerate(st)}, meta


def same_bits(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_stopped_mid_epoch_and_resumed_in_other_layouts_ends_with_one_contexts_bits(capsys, data_dir, tmp_path):
    """3 contexts stop at update 13 (epoch 2, batch 3 of 10); ZeRO-3 on 2 contexts and a 1F1B pipeline
    go on from there: both end with the bits of one context's uninterrupted run, and its epoch record."""
    data = ["--data-dir", str(data_dir), *SMALL]
    code, _, err = run_main(capsys, ["--cpus", "1", *data, "--checkpoint-dir", str(tmp_path / "one")])
    assert code == 0, err
    want, want_meta = arrays(tmp_path / "one")
    for layout in (["--mode", "zero", "--zero-stage", "3"], ["--mode", "pipeline", "--schedule", "1f1b"]):
        ck = tmp_path / layout[1]
        code, out, err = run_main(capsys, ["--cpus", "3", *data, "--checkpoint-dir", str(ck), "--max-steps", "13"])
        assert code == 0 and "stopped after update 13 (--max-steps 13) in epoch 2" in out, err
        saved, meta = arrays(ck)
        assert meta["t"] == 13 and meta["epoch"] == 1 and meta["cursor"]["batches"] == 3 and meta["cursor"]["seen"] == 96
        assert not same_bits(saved, want)
        code, out, err = run_main(capsys, ["--cpus", "2", *layout, *data, "--checkpoint-dir", str(ck), "--resume"])
        assert code == 0 and "after epoch 1 and 3 batch(es) of epoch 2 (update 13)" in out, err
        got, meta = arrays(ck)
        assert same_bits(got, want), layout
        assert meta["t"] == want_meta["t"] and "cursor" not in meta
        assert abs(meta["history"][1]["train_loss"] - want_meta["history"][1]["train_loss"]) < 1e-6


def test_checkpoint_every_saves_mid_epoch_and_the_tool_reads_it(capsys, data_dir, tmp_path):
    ck = tmp_path / "ck"
    code, out, err = run_main(capsys, ["--cpus", "2", "--data-dir", str(data_dir), *SMALL, "--epochs", "1",
                                       "--checkpoint-dir", str(ck), "--checkpoint-every", "4", "--max-steps", "8"])
    assert code == 0 and "stopped after update 8" in out, err
    _, meta = arrays(ck)
    assert meta["epoch"] == 0 and meta["history"] == [] and meta["cursor"]["batches"] == 8
    assert 0 < meta["cursor"]["loss"] and 0 <= meta["cursor"]["correct"] <= 256
    from manual_dp.checkpoint import main as tool
    tool([str(ck)])
    assert "epoch 0 and 8 batch(es) of epoch 1 (saved mid-epoch), update 8" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint-every", "-1", "--checkpoint-dir", "X"], "--checkpoint-every must be 0 to"),
    (["--max-steps", "-3"], "--max-steps must be 0 to"),
    (["--checkpoint-every", "2"], "--checkpoint-every and --async-checkpoint need --checkpoint-dir"),
    (["--async-checkpoint"], "--checkpoint-every and --async-checkpoint need --checkpoint-dir"),
])
def test_bad_flags_are_one_line(capsys, argv, message):
    code, _, err = run_main(capsys, argv)
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_a_cursor_that_lies_is_refused(tmp_path):
    from test_faults_four_checkpoints import lenet, refused, write
    meta, arrs = lenet()
    write(tmp_path, dict(meta, cursor={"batches": 2, "loss": float("inf"), "correct": 1, "seen": 64, "sec": 1.0}), arrs)
    refused(tmp_path, "its place in the epoch (cursor)")


def cli(*argv):
    return [sys.executable, "-m", "manual_dp.train", *argv]


def test_async_checkpoint_killed_mid_run_resumes_to_the_uninterrupted_bits(tmp_path):
    """--async-checkpoint --checkpoint-every 1: kill -9 lands while the writer thread may be
    writing; what is left loads and resumes to the bits of the run never stopped."""
    data = write_dataset(tmp_path / "data", n_train=1200, n_test=100)
    common = ["--cpus", "2", "--data-dir", str(data), "--epochs", "2", "--batch-size", "32", "--deterministic",
              "--no-progress"]
    subprocess.run(cli(*common, "--checkpoint-dir", str(tmp_path / "straight")), check=True, timeout=300,
                   capture_output=True)
    ck = tmp_path / "ck"
    args = cli(*common, "--checkpoint-dir", str(ck), "--resume", "--async-checkpoint", "--checkpoint-every", "1")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (ck / checkpoint.NAME).exists() and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    checkpoint.load(ck)                                   # whole and valid, whenever the kill came
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "resumed from" in done.stdout, done.stderr
    assert same_bits(arrays(ck)[0], arrays(tmp_path / "straight")[0])


def test_the_bench_times_three_ways_side_by_side(capsys):
    from manual_dp.bench import checkpoints
    checkpoints.main(["--repeats", "1", "--every", "2", "--train-size", "96", "--seq-len", "16", "--layers", "1",
                      "--d-model", "16", "--heads", "2", "--batch-size", "16"])
    out = capsys.readouterr().out
    assert all(f"{way:12} epoch" in out for way in ("none", "in the step", "async")), out
    assert "1.000x no checkpoint" in out


def test_the_resume_matrix_bench_prints_its_cells(capsys):
    from manual_dp.bench import resume
    resume.main(["--layouts", "1 context", "--stop", "3"])
    assert "1 context      same bits" in capsys.readouterr().out
