import json
import os
import signal
import subprocess
import sys
import time

import mxnet as mx
import numpy as np
import pytest

from conftest import write_dataset
from manual_dp import checkpoint
from manual_dp.train import main

TINY = ["--train-size", "96", "--test-size", "64", "--batch-size", "32"]


def run_main(capsys, *argv):
    """Run the CLI in-process; returns (exit code, stdout, stderr)."""
    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def read_log(path):
    return [json.loads(line) for line in open(path)]


def test_trains_and_logs_every_epoch(capsys, data_dir, tmp_path):
    log = tmp_path / "log.jsonl"
    code, out, err = run_main(capsys, "--cpus", "2", "--epochs", "2", "--data-dir", str(data_dir),
                              "--log-json", str(log), *TINY)
    assert code == 0, err
    records = read_log(log)
    assert [r["epoch"] for r in records] == [1, 2]
    for r in records:
        assert {"epoch", "train_loss", "train_acc", "test_acc", "epoch_sec", "images_per_sec",
                "devices"} <= set(r)
        assert r["devices"] == ["cpu(0)", "cpu(1)"]
    assert records[1]["train_loss"] < records[0]["train_loss"]
    assert "epoch 2/2" in out and "done: test acc" in out


BAD = [
    (["--gpus", str(mx.context.num_gpus() + 2)], "found .* --cpus"),
    (["--cpus", "0"], "--cpus must be >= 1"),
    (["--cpus", "3", "--batch-size", "2"], "--batch-size 2 is smaller than the 3 devices"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--lr", "-0.1"], "--lr must be positive"),
    (["--lr", "nan"], "--lr must be positive"),
    (["--epochs", "-1"], "--epochs must be >= 0"),
    (["--epochs", "two"], "invalid int value"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--cpus", "2", "--gpus", "1"], "not allowed with"),
    (["--resume"], "--resume needs --checkpoint-dir"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(capsys, data_dir, argv, message):
    code, out, err = run_main(capsys, "--data-dir", str(data_dir), *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("manual_dp.train: error:"), err
    assert __import__("re").search(message, lines[0]), lines[0]


@pytest.mark.parametrize("setup,message", [
    (lambda d: None, "does not exist"),
    (lambda d: d.mkdir(), "lacks train-images"),
    (lambda d: (write_dataset(d, 40, 20), (d / "train-labels-idx1-ubyte.gz").write_bytes(b"junk")),
     "train-labels-idx1-ubyte.gz: not a readable gzip"),
])
def test_missing_or_corrupt_data_is_one_line_and_exit_1(capsys, tmp_path, setup, message):
    d = tmp_path / "data"
    setup(d)
    code, _, err = run_main(capsys, "--cpus", "1", "--data-dir", str(d))
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_resume_continues_to_the_same_losses(capsys, data_dir, tmp_path):
    common = ["--cpus", "2", "--data-dir", str(data_dir), *TINY]
    run_main(capsys, *common, "--epochs", "3", "--log-json", str(tmp_path / "straight.jsonl"))
    ck = tmp_path / "ck"
    run_main(capsys, *common, "--epochs", "2", "--checkpoint-dir", str(ck))
    state, meta = checkpoint.load(ck)
    assert meta["epoch"] == 2 and len(state["params"]) == 8 and len(state["opt_state"]) == 8
    code, out, err = run_main(capsys, *common, "--epochs", "3", "--checkpoint-dir", str(ck),
                              "--resume", "--log-json", str(tmp_path / "resumed.jsonl"))
    assert code == 0 and "resumed from" in out, err
    straight, resumed = read_log(tmp_path / "straight.jsonl"), read_log(tmp_path / "resumed.jsonl")
    assert [r["train_loss"] for r in resumed] == [r["train_loss"] for r in straight]
    assert [r["test_acc"] for r in resumed] == [r["test_acc"] for r in straight]


def test_resume_refuses_a_checkpoint_of_another_run(capsys, data_dir, tmp_path):
    common = ["--cpus", "1", "--data-dir", str(data_dir), "--checkpoint-dir", str(tmp_path), *TINY]
    run_main(capsys, *common, "--epochs", "1")
    code, _, err = run_main(capsys, *common, "--epochs", "2", "--resume", "--lr", "0.5")
    assert code == 1 and "holds a run with" in err


def test_width_trains_wider_and_a_checkpoint_of_another_width_is_refused(capsys, data_dir, tmp_path):
    common = ["--cpus", "2", "--data-dir", str(data_dir), "--checkpoint-dir", str(tmp_path), *TINY]
    code, out, _ = run_main(capsys, *common, "--epochs", "1", "--width", "2")
    assert code == 0 and "LeNet x2 wide" in out
    state, _ = checkpoint.load(tmp_path)
    assert state["params"][2].shape == (100, 40, 5, 5) and state["params"][4].shape == (1600, 256)
    code, _, err = run_main(capsys, *common, "--epochs", "2", "--resume")
    assert code == 1 and "width 2 there, 1 here" in err and len(err.strip().splitlines()) == 1
    code, out, _ = run_main(capsys, *common, "--epochs", "2", "--resume", "--width", "2")
    assert code == 0 and "resumed from" in out


def test_corrupt_checkpoint_is_a_clear_error(capsys, data_dir, tmp_path):
    (tmp_path / checkpoint.NAME).write_bytes(b"PK\x03\x04 broken")
    code, _, err = run_main(capsys, "--cpus", "1", "--data-dir", str(data_dir), "--epochs", "1",
                            "--checkpoint-dir", str(tmp_path), "--resume", *TINY)
    assert code == 1 and "unreadable checkpoint" in err


def cli(*argv):
    return [sys.executable, "-m", "manual_dp.train", *argv]


def test_kill_9_then_resume_matches_an_uninterrupted_run(tmp_path):
    data = write_dataset(tmp_path / "data", n_train=1200, n_test=100)
    common = ["--cpus", "2", "--data-dir", str(data), "--epochs", "4", "--batch-size", "32"]
    straight = tmp_path / "straight.jsonl"
    subprocess.run(cli(*common, "--log-json", str(straight)), check=True, timeout=300,
                   capture_output=True)
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    args = cli(*common, "--checkpoint-dir", str(ck), "--log-json", str(log), "--resume")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (ck / checkpoint.NAME).exists() and time.time() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # land somewhere inside a later epoch, or mid-save
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not list(ck.glob("*.tmp")) or (ck / checkpoint.NAME).exists()
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stdout
    assert [r["train_loss"] for r in read_log(log)] == [r["train_loss"] for r in read_log(straight)]


def test_module_runs_as_a_script_without_warnings(tmp_path):
    out = subprocess.run(cli("--help"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--batch-size" in out.stdout
    assert "RuntimeWarning" not in out.stderr


@pytest.mark.parametrize("model,scratch", [("lenet", 64), ("transformer", 1024)])
def test_console_script_entry_sets_thread_settings_before_mxnet_loads(data_dir, model, scratch):
    """manual-dp-train runs manual_dp.train:main, which parses the flags, sets the thread settings
    for the contexts and the model they name (scratch buffers: fewer for convolutions' large
    scratch, fast/runtime.py), and only then loads MXNet."""
    script = ("import os, sys, builtins\n"
              "seen = {}\n"
              "real_import = builtins.__import__\n"
              "def spy(name, *a, **k):\n"
              "    if name.startswith('mxnet') and not seen:\n"
              "        seen.update(copy=os.environ.get('MXNET_CPU_TEMP_COPY'), omp=os.environ.get('OMP_NUM_THREADS'))\n"
              "    return real_import(name, *a, **k)\n"
              "builtins.__import__ = spy\n"
              "from manual_dp.train import main\n"
              f"main(['--cpus', '2', '--model', {model!r}, '--epochs', '0', '--data-dir', {str(data_dir)!r}])\n"
              "print('AT_LOAD', seen['copy'], seen['omp'])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MXNET_CPU_TEMP_COPY", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    cores = len(os.sched_getaffinity(0))
    assert out.stdout.strip().splitlines()[-1] == f"AT_LOAD {scratch} {max(1, cores // 2)}"


def test_resume_rewrites_a_log_left_behind_the_checkpoint(capsys, data_dir, tmp_path):
    """A kill between the checkpoint's rename and the log's leaves the log one epoch behind:
    --resume rewrites it from the checkpoint before training on."""
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    common = ["--cpus", "2", "--data-dir", str(data_dir), *TINY, "--checkpoint-dir", str(ck), "--log-json", str(log)]
    assert run_main(capsys, *common, "--epochs", "2")[0] == 0
    records = read_log(log)
    log.write_text(json.dumps(records[0]) + "\n")             # as if killed before the second write
    code, out, err = run_main(capsys, *common, "--epochs", "2", "--resume")
    assert code == 0 and "resumed from" in out, err
    assert read_log(log) == records


def test_thread_settings_replace_only_this_processs_own():
    """configure may replace what manual_dp put in the environment, in this process; not a value
    the user set, and not one a parent process handed down (its marker names another pid)."""
    from manual_dp.fast.runtime import configure, thread_env
    env = {}
    configure(1, env)
    assert env["OMP_NUM_THREADS"] == thread_env(1)["OMP_NUM_THREADS"]
    configure(2, env)                                          # ours: replaced
    assert env["OMP_NUM_THREADS"] == thread_env(2)["OMP_NUM_THREADS"]
    user = {"OMP_NUM_THREADS": "7"}
    configure(2, user)
    assert user["OMP_NUM_THREADS"] == "7"
    child = dict(env, MANUAL_DP_SETTINGS=env["MANUAL_DP_SETTINGS"].replace(f"{os.getpid()}:", "1:"), OMP_NUM_THREADS="5")
    configure(1, child)
    assert child["OMP_NUM_THREADS"] == "5"
