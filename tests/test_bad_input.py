"""Every bad input the command line can meet, as a table: each case ends with its exit status, ONE
line on stderr (no traceback), and the checkpoint directory as it should be afterwards.

Exit statuses: 2 bad flags or outputs found before training, 1 data, checkpoints, outputs that
fail while training, 3 divergence, 130 Ctrl-C. The launcher's own table is tests/test_launch_faults.py.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import mxnet as mx
import numpy as np
import pytest

from conftest import run_main, write_dataset
from manual_dp import checkpoint
from manual_dp.train import main

TINY = ["--train-size", "100", "--test-size", "64", "--batch-size", "32", "--no-progress"]


def run(capsys, argv):
    """(exit status, stderr lines) of the CLI run in this process."""
    code, _, lines = run_main(capsys, argv)
    return code, lines


def good_checkpoint(tmp, data):
    """A checkpoint directory holding epoch 1 of a real run (and its bytes, to compare later)."""
    ck = tmp / "ck"
    assert main_ok(["--cpus", "2", "--data-dir", str(data), "--epochs", "1", "--checkpoint-dir", str(ck), *TINY])
    return ck


def main_ok(argv):
    try:
        main(argv)
    except SystemExit as e:
        return e.code == 0
    return True


def rewrite(ck, change, resign=True):
    """Rewrite ck's checkpoint with change(meta, arrays) applied; resign: with a fresh checksum, so
    that the check behind the checksum is the one that speaks."""
    path = ck / checkpoint.NAME
    with np.load(path) as z:
        meta = json.loads(z["meta"].tobytes().decode())
        arrays = {k: z[k] for k in z.files if k != "meta"}
    change(meta, arrays)
    if resign:
        meta["sha256"] = checkpoint.digest(meta, arrays)
    with open(path, "wb") as f:
        np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)


def flip_bytes(ck):
    """8 bytes flipped in the middle of the largest array's data (the file's middle could land in a
    zip header field that nothing reads, depending on how long the metadata is)."""
    raw = bytearray((ck / checkpoint.NAME).read_bytes())
    with zipfile.ZipFile(ck / checkpoint.NAME) as z:
        big = max(z.infolist(), key=lambda i: i.file_size)
    name_len, extra_len = int.from_bytes(raw[big.header_offset + 26:big.header_offset + 28], "little"), \
        int.from_bytes(raw[big.header_offset + 28:big.header_offset + 30], "little")
    middle = big.header_offset + 30 + name_len + extra_len + big.file_size // 2
    raw[middle:middle + 8] = b"\xff" * 8
    (ck / checkpoint.NAME).write_bytes(bytes(raw))


# (id, extra argv, exit status, what the one line says)
FLAGS = [
    ("lr inf", ["--lr", "inf"], 2, "--lr must be positive and finite, got inf"),
    ("lr nan", ["--lr", "nan"], 2, "--lr must be positive and finite"),
    ("lr negative", ["--lr", "-0.1"], 2, "--lr must be positive"),
    ("init-scale inf", ["--init-scale", "inf"], 2, "--init-scale must be positive and finite"),
    ("init-scale 0", ["--init-scale", "0"], 2, "--init-scale must be positive"),
    ("warmup inf", ["--warmup-epochs", "inf"], 2, "--warmup-epochs must be >= 0 and finite"),
    ("warmup nan", ["--warmup-epochs", "nan"], 2, "--warmup-epochs must be >= 0"),
    ("seed -1", ["--seed", "-1"], 2, r"--seed must be in 0..2\*\*32-1, got -1"),
    ("seed 2**32", ["--seed", str(2 ** 32)], 2, "--seed must be in"),
    ("timeout inf", ["--timeout", "inf"], 2, "--timeout must be positive and finite"),
    ("timeout 0", ["--timeout", "0"], 2, "--timeout must be positive"),
    ("epochs -1", ["--epochs", "-1"], 2, "--epochs must be >= 0"),
    ("epochs two", ["--epochs", "two"], 2, "invalid int value"),
    ("batch 0", ["--batch-size", "0"], 2, "--batch-size must be >= 1"),
    ("cpus 0", ["--cpus", "0"], 2, "--cpus must be >= 1"),
    ("gpus absent", ["--gpus", str(mx.context.num_gpus() + 2)], 2, "found .* --cpus"),
    ("cpus and gpus", ["--cpus", "2", "--gpus", "1"], 2, "not allowed with"),
    ("batch below devices", ["--cpus", "3", "--batch-size", "2"], 2, "--batch-size 2 is smaller than the 3 devices"),
    ("train-size below devices", ["--cpus", "2", "--train-size", "1"], 2,
     "1 training example.* cannot be split over the 2 devices"),
    ("model on 3", ["--cpus", "3", "--mode", "model"], 2, "--mode model needs exactly 2 contexts"),
    ("staleness in sync", ["--staleness", "2"], 2, "--staleness applies only to --mode async"),
    ("allreduce in async", ["--mode", "async", "--allreduce", "ring"], 2, "--allreduce applies only to --mode sync or hybrid"),
    ("allreduce unknown", ["--allreduce", "bogus"], 2, "--allreduce bogus: choose from lesson, reduce_bcast"),
    ("fuse-grads in model", ["--cpus", "2", "--mode", "model", "--fuse-grads"], 2, "--fuse-grads applies only to --mode sync"),
    ("micro-batches 0", ["--cpus", "2", "--mode", "pipeline", "--micro-batches", "0"], 2, "--micro-batches must be >= 1"),
    ("horovod async", ["--backend", "horovod", "--mode", "async"], 2, "runs every mode but async"),
    ("dist_async pipeline", ["--backend", "dist_async", "--mode", "pipeline"], 2, "--backend dist_async runs its own"),
    ("dist_sync alone", ["--backend", "dist_sync"], 2, "runs as a worker under the launcher"),
    ("resume without dir", ["--resume"], 2, "--resume needs --checkpoint-dir"),
    ("check-replicas 0", ["--check-replicas", "0"], 2, "--check-replicas must be >= 1"),
    ("width 0", ["--width", "0"], 2, "--width must be >= 1"),
    ("deterministic ring", ["--deterministic", "--allreduce", "ring"], 2, "--deterministic adds the gradients in its own"),
    ("check-replicas in async", ["--mode", "async", "--check-replicas", "5"], 2, "--check-replicas applies only to"),
    ("unknown flag", ["--no-such-flag"], 2, "unrecognized arguments"),
    ("memory-per-device 12X", ["--memory-per-device", "12X"], 2,
     r"--memory-per-device must be a byte count such as 300MiB, 2G or 1048576 .*got '12X'"),
    ("memory-per-device too small", ["--cpus", "1", "--memory-per-device", "100KiB"], 2,
     r"--memory-per-device 100KiB: --mode sync needs .*iB on cpu\(0\) \(measured\), .*iB more than 100.0 KiB; "
     "no mode fits"),
    ("zero-stage in sync", ["--zero-stage", "2"], 2, "--zero-stage applies only to --mode zero or tensor or context or mesh, not --mode sync"),
    ("zero-stage in pipeline", ["--cpus", "2", "--mode", "pipeline", "--zero-stage", "3"], 2, "--zero-stage applies only to --mode zero"),
    ("zero-stage 4", ["--mode", "zero", "--zero-stage", "4"], 2, r"--zero-stage: invalid choice: 4 \(choose from 1, 2, 3\)"),
    ("zero-stage 0", ["--mode", "zero", "--zero-stage", "0"], 2, "--zero-stage: invalid choice: 0"),
    ("zero on dist_async", ["--backend", "dist_async", "--mode", "zero"], 2, "--backend dist_async runs its own"),
    ("zero batch below devices", ["--cpus", "3", "--mode", "zero", "--batch-size", "2"], 2, "--batch-size 2 is smaller than the 3 devices"),
    ("sync-every 0", ["--mode", "local", "--sync-every", "0"], 2, "--sync-every must be >= 1, got 0"),
    ("outer-lr 0", ["--mode", "local", "--outer-lr", "0"], 2, "--outer-lr must be positive and finite, got 0"),
    ("outer-lr inf", ["--mode", "local", "--outer-lr", "inf"], 2, "--outer-lr must be positive and finite"),
    ("outer-momentum 1", ["--mode", "local", "--outer-optimizer", "nesterov", "--outer-momentum", "1"], 2,
     r"--outer-momentum must be in \[0, 1\), got 1"),
    ("outer-momentum with sgd", ["--mode", "local", "--outer-momentum", "0.5"], 2,
     "--outer-momentum applies only to --outer-optimizer nesterov"),
    ("outer-optimizer unknown", ["--mode", "local", "--outer-optimizer", "adam"], 2, "invalid choice: 'adam'"),
    ("sync-every in sync", ["--sync-every", "4"], 2, "--sync-every applies only to --mode local, not --mode sync"),
    ("outer-lr in async", ["--mode", "async", "--outer-lr", "0.7"], 2, "--outer-lr applies only to --mode local"),
    ("outer-optimizer in hybrid", ["--cpus", "2", "--mode", "hybrid", "--outer-optimizer", "nesterov"], 2,
     "--outer-optimizer applies only to --mode local"),
    ("outer-momentum in sync", ["--outer-momentum", "0.9"], 2, "--outer-momentum applies only to --mode local"),
    ("local on dist_async", ["--backend", "dist_async", "--mode", "local"], 2, "--backend dist_async runs its own"),
    ("stages 5", ["--cpus", "5", "--mode", "pipeline", "--stages", "5"], 2, "--stages must be 1 to 4 .*got 5"),
    ("stages 0", ["--cpus", "2", "--mode", "model", "--stages", "0"], 2, "--stages must be 1 to 4"),
    ("stages in sync", ["--cpus", "2", "--stages", "2"], 2, "--stages applies only to --mode model or pipeline or hybrid"),
    ("stages in async", ["--cpus", "2", "--mode", "async", "--stages", "3"], 2, "--stages applies only to"),
    ("schedule in model", ["--cpus", "2", "--mode", "model", "--schedule", "1f1b"], 2,
     "--schedule applies only to --mode pipeline or hybrid or mesh, not --mode model"),
    ("schedule in sync", ["--cpus", "2", "--schedule", "gpipe"], 2, "--schedule applies only to"),
    ("schedule unknown", ["--cpus", "2", "--mode", "pipeline", "--schedule", "zigzag"], 2, "invalid choice"),
    ("recompute in sync", ["--cpus", "2", "--recompute"], 2, "--recompute applies only to --mode model or pipeline"),
    ("recompute in async", ["--cpus", "2", "--mode", "async", "--recompute"], 2, "--recompute applies only to"),
    ("pipeline S=3 on 2", ["--cpus", "2", "--mode", "pipeline", "--stages", "3"], 2,
     "--mode pipeline needs exactly 3 contexts .*got 2"),
    ("model S=4 on 3", ["--cpus", "3", "--mode", "model", "--stages", "4"], 2, "--mode model needs exactly 4 contexts"),
    ("hybrid 4 over S=3", ["--cpus", "4", "--mode", "hybrid", "--stages", "3"], 2,
     "--mode hybrid needs a multiple of 3 contexts .*got 4"),
    ("bucket-mb -1", ["--bucket-mb", "-1"], 2, "--bucket-mb must be >= 0 and finite, got -1"),
    ("bucket-mb nan", ["--bucket-mb", "nan"], 2, "--bucket-mb must be >= 0 and finite"),
    ("bucket-mb in hybrid", ["--cpus", "2", "--mode", "hybrid", "--bucket-mb", "1"], 2,
     "--bucket-mb applies only to --mode sync, not --mode hybrid"),
    ("bucket-mb in async", ["--mode", "async", "--bucket-mb", "0"], 2, "--bucket-mb applies only to --mode sync"),
    ("bucket-mb unfused", ["--bucket-mb", "1", "--no-fuse-grads"], 2, "not with --no-fuse-grads"),
    ("trace unfused", ["--trace", "t.json", "--no-fuse-grads"], 2, "not with --no-fuse-grads"),
    ("trace in pipeline", ["--cpus", "2", "--mode", "pipeline", "--trace", "t.json"], 2, "--trace applies only to --mode sync"),
    ("trace across processes", ["--backend", "dist_sync", "--trace", "t.json"], 2, "--trace records the steps of one process"),
    ("tensor T=3 at width 1", ["--cpus", "3", "--mode", "tensor"], 2,
     "--tensor-parallel 3 does not divide conv1's output channels \\(20 at --width 1\\)"),
    ("tensor T=3 of 4 contexts", ["--cpus", "4", "--mode", "tensor", "--tensor-parallel", "3"], 2,
     "--tensor-parallel 3 does not divide the 4 contexts"),
    ("tensor-parallel in sync", ["--cpus", "4", "--tensor-parallel", "2"], 2,
     "--tensor-parallel applies only to --mode tensor or context or mesh, not --mode sync"),
    ("tensor-parallel 0", ["--mode", "tensor", "--tensor-parallel", "0"], 2, "--tensor-parallel must be >= 1"),
    ("compress topk:0", ["--compress", "topk:0"], 2, "--compress topk:0: the argument must be positive"),
    ("compress powersgd:0", ["--compress", "powersgd:0"], 2, "--compress powersgd:0: the argument must be positive"),
    ("compress topk alone", ["--compress", "topk"], 2, "--compress topk needs its argument: topk:K"),
    ("compress topk:x", ["--compress", "topk:1.5"], 2, "'1.5' is not an integer"),
    ("compress 2bit:-1", ["--compress", "2bit:-1"], 2, "the argument must be positive"),
    ("compress fp16:3", ["--compress", "fp16:3"], 2, "--compress fp16 takes no argument"),
    ("compress unknown", ["--compress", "3bit"], 2, "--compress 3bit: choose from none, fp16"),
    ("compress in pipeline", ["--cpus", "2", "--mode", "pipeline", "--compress", "2bit"], 2,
     "--compress applies only to --mode sync"),
    ("compress without fusion", ["--compress", "1bit", "--no-fuse-grads"], 2, "drop --no-fuse-grads"),
    ("compress dist_async", ["--backend", "dist_async", "--compress", "fp16"], 2, "not to --backend dist_async"),
    ("compress gathered with allreduce", ["--compress", "2bit", "--allreduce", "ring"], 2,
     "--allreduce does not apply"),
    ("deterministic local", ["--deterministic", "--mode", "local"], 2,
     "--deterministic --mode local: local SGD averages the replicas' parameters"),
    ("deterministic async", ["--deterministic", "--mode", "async"], 2, "--deterministic --mode async: stale replicas"),
    ("deterministic zero dist_async", ["--mode", "zero", "--deterministic", "--backend", "dist_async"], 2,
     "--deterministic needs synchronous updates"),
    ("no-autotune zero", ["--mode", "zero", "--no-autotune"], 2,
     "--no-autotune applies only to --mode sync, not --mode zero"),
    ("no-autotune deterministic", ["--deterministic", "--no-autotune"], 2,
     "--deterministic runs the convolutions unpadded already"),
    ("deterministic zero allreduce", ["--mode", "zero", "--deterministic", "--allreduce", "ring"], 2,
     "--deterministic adds the gradients in its own fixed order"),
    ("deterministic tensor T=3 at width 3", ["--cpus", "3", "--width", "3", "--mode", "tensor", "--deterministic"], 2,
     "cuts every split layer into 4 pieces \\(--tensor-pieces\\): --tensor-parallel 3 does not divide them \\(use 1 or 2 or 4"),
    ("tensor pieces without deterministic", ["--tensor-pieces", "4"], 2, "--tensor-pieces fixes the order of --deterministic"),
    ("tensor pieces not dividing lenet", ["--deterministic", "--tensor-pieces", "3"], 2,
     "--tensor-pieces 3 does not divide conv1's output channels \\(20"),
    ("tensor pieces in a lenet pipeline", ["--deterministic", "--tensor-pieces", "4", "--mode", "model", "--cpus", "2"], 2,
     "--tensor-pieces 4 in a pipeline needs a model whose layers split one by one"),
    ("deterministic tensor T=8 at width 2", ["--cpus", "8", "--width", "2", "--mode", "tensor", "--deterministic"], 2,
     "--tensor-parallel 8 does not divide them"),
    ("deterministic tensor with allreduce", ["--cpus", "2", "--mode", "tensor", "--deterministic", "--allreduce",
                                             "ring"], 2, "--deterministic adds the gradients in its own fixed order"),
]


@pytest.mark.parametrize("argv,code,message", [c[1:] for c in FLAGS], ids=[c[0] for c in FLAGS])
def test_bad_flag(capsys, monkeypatch, data_dir, tmp_path, argv, code, message):
    for name in [k for k in os.environ if k.startswith("DMLC_")]:
        monkeypatch.delenv(name)
    ck = tmp_path / "ck"
    outputs = [] if "--resume" in argv else ["--checkpoint-dir", str(ck)]
    got, lines = run(capsys, ["--data-dir", str(data_dir), *TINY, *outputs, *argv])
    assert got == code and len(lines) == 1 and lines[0].startswith("manual_dp.train: error:"), lines
    assert re.search(message, lines[0]), lines[0]
    assert not (ck / checkpoint.NAME).exists()


# Outputs, data and checkpoints: (id, setup(tmp, data) -> extra argv, exit status, message,
# afterwards(tmp) -> None: asserts the state of the checkpoint directory).
def absent(tmp):
    assert not (tmp / "ck" / checkpoint.NAME).exists()


def epoch_one_kept(tmp):
    state, meta = checkpoint.load(tmp / "ck")
    assert meta["epoch"] == 1 and not list((tmp / "ck").glob("*.tmp"))


def damaged_kept(tmp):
    assert (tmp / "ck" / checkpoint.NAME).exists() and not list((tmp / "ck").glob("*.tmp"))


def resume(ck, *more):
    return ["--cpus", "2", "--epochs", "2", "--checkpoint-dir", str(ck), "--resume", *more]


CASES = [
    ("checkpoint-dir is a file", lambda t, d: (t.joinpath("ck").write_text("x"), ["--checkpoint-dir", str(t / "ck")])[1],
     2, "--checkpoint-dir .* is a file", lambda t: None),
    ("log-json is a directory", lambda t, d: ["--log-json", str(t)], 2, "--log-json .* is a directory", absent),
    ("log-json parent missing", lambda t, d: ["--log-json", str(t / "no" / "log.jsonl")], 2, "does not exist", absent),
    ("log-json onto the checkpoint", lambda t, d: ["--checkpoint-dir", str(t / "ck"), "--log-json", str(t / "ck" / checkpoint.NAME)],
     2, "would overwrite the checkpoint", absent),
    ("trace is a directory", lambda t, d: ["--trace", str(t)], 2, "--trace .* is a directory", absent),
    ("trace parent missing", lambda t, d: ["--trace", str(t / "no" / "t.json")], 2, "--trace .* does not exist", absent),
    ("trace of too short a run", lambda t, d: ["--trace", str(t / "t.json"), "--train-size", "64", "--epochs", "1"], 2,
     "--trace records updates 3 to 5, but this run takes 2", absent),
    ("data dir missing", lambda t, d: ["--data-dir", str(t / "nowhere")], 1, "does not exist", absent),
    ("data corrupt", lambda t, d: (write_dataset(t / "bad", 40, 20), (t / "bad" / "train-labels-idx1-ubyte.gz").write_bytes(b"junk"),
                                   ["--data-dir", str(t / "bad")])[-1], 1, "not a readable gzip", absent),
    ("checkpoint garbage", lambda t, d: (t.joinpath("ck").mkdir(), (t / "ck" / checkpoint.NAME).write_bytes(b"PK\x03\x04 broken"),
                                         resume(t / "ck"))[-1], 1, "unreadable checkpoint", damaged_kept),
    ("checkpoint bytes flipped", lambda t, d: (flip_bytes(good_checkpoint(t, d)), resume(t / "ck"))[-1],
     1, "unreadable checkpoint|checksum mismatch", damaged_kept),
    ("checkpoint param of wrong shape", lambda t, d: (rewrite(good_checkpoint(t, d), lambda m, a: a.update(param_2=np.zeros((3, 3), np.float32))),
                                                      resume(t / "ck"))[-1], 1, r"W2 \(param_2\) is float32 \(3, 3\), expected float32 \(50, 20, 5, 5\)", damaged_kept),
    ("checkpoint without config", lambda t, d: (rewrite(good_checkpoint(t, d), lambda m, a: m.pop("config")), resume(t / "ck"))[-1],
     1, "'config' is missing", damaged_kept),
    ("checkpoint epoch a string", lambda t, d: (rewrite(good_checkpoint(t, d), lambda m, a: m.update(epoch="1")), resume(t / "ck"))[-1],
     1, "'epoch' is missing or not of type int", damaged_kept),
    ("checkpoint rng state changed", lambda t, d: (rewrite(good_checkpoint(t, d), lambda m, a: m["rng_state"]["state"].update(state=12345), resign=False),
                                                   resume(t / "ck"))[-1], 1, "checksum mismatch", damaged_kept),
    ("checkpoint with NaN", lambda t, d: (rewrite(good_checkpoint(t, d), lambda m, a: a["param_4"].__setitem__((0, 0), np.nan)),
                                          resume(t / "ck"))[-1], 1, "W3 .* not finite", damaged_kept),
    ("checkpoint of an older version", lambda t, d: (rewrite(good_checkpoint(t, d), lambda m, a: m.pop("sha256"), resign=False),
                                                     resume(t / "ck"))[-1], 1, "older manual_dp", damaged_kept),
    ("checkpoint of other settings", lambda t, d: (good_checkpoint(t, d), resume(t / "ck", "--lr", "0.5"))[-1],
     1, "holds a run with other settings: lr 0.05 there, 0.5 here$", epoch_one_kept),
    ("diverges at once", lambda t, d: ["--cpus", "2", "--lr", "1e30", "--epochs", "3", "--checkpoint-dir", str(t / "ck"),
                                       "--log-json", str(t / "log.jsonl")],
     # which check meets the NaN first (the running loss or the parameters after the epoch) depends
     # on the CPU's arithmetic: either is the right behaviour, one line, exit 3, nothing written
     3, r"diverged at epoch 1(, step \d+: the training loss is (nan|-?inf)|: parameter \w+ holds (NaN|infinite) "
        r"values); try a lower --lr than 1e\+30", absent),
]


@pytest.mark.parametrize("setup,code,message,afterwards", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_output_data_or_checkpoint(capsys, data_dir, tmp_path, setup, code, message, afterwards):
    argv = setup(tmp_path, data_dir)
    capsys.readouterr()
    got, lines = run(capsys, ["--data-dir", str(data_dir), *TINY, *argv])
    assert got == code and len(lines) == 1 and lines[0].startswith("manual_dp.train: error:"), lines
    assert re.search(message, lines[0]), lines[0]
    afterwards(tmp_path)


def test_missing_manual_dp_data_is_refused_not_replaced(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MANUAL_DP_DATA", str(tmp_path / "nowhere"))
    got, lines = run(capsys, ["--cpus", "1", *TINY])
    assert got == 1 and len(lines) == 1 and "$MANUAL_DP_DATA" in lines[0], lines


def test_divergence_in_epoch_2_keeps_epoch_1(capsys, monkeypatch, data_dir, tmp_path):
    """A planted fault: the 6th update (epoch 2 of 4 updates an epoch) writes NaN into W3."""
    from manual_dp.strategies.data import data_parallel
    real, calls = data_parallel.apply_update_and_clear, []

    def faulty(params, *args):
        real(params, *args)
        calls.append(1)
        if len(calls) == 6 * 2:                 # two replicas update per step
            params[0][:] = float("nan")
    monkeypatch.setattr(data_parallel, "apply_update_and_clear", faulty)
    from manual_dp.cli import memcheck                    # the memory measurement's updates do not count
    measure = memcheck.measure_run
    monkeypatch.setattr(memcheck, "measure_run", lambda *a: (measure(*a), calls.clear())[0])
    log = tmp_path / "log.jsonl"
    got, lines = run(capsys, ["--data-dir", str(data_dir), *TINY, "--cpus", "2", "--epochs", "3",
                              "--checkpoint-dir", str(tmp_path / "ck"), "--log-json", str(log)])
    assert got == 3 and len(lines) == 1, lines
    assert re.search(r"diverged at epoch 2.*\(the checkpoint of the last good epoch is kept\)", lines[0]), lines[0]
    epoch_one_kept(tmp_path)
    assert [json.loads(r)["epoch"] for r in log.read_text().splitlines()] == [1]


@pytest.fixture
def small_mount(tmp_path):
    """A 1.5 MB tmpfs at tmp_path/mnt (room for one checkpoint of ~1 MB, not for two), or skip."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_keeps_the_previous_checkpoint_and_no_temporary_file(capsys, data_dir, small_mount):
    ck = small_mount / "ck"
    got, lines = run(capsys, ["--data-dir", str(data_dir), *TINY, "--cpus", "2", "--epochs", "3",
                              "--checkpoint-dir", str(ck)])
    assert got == 1 and len(lines) == 1, lines
    assert re.search(r"could not write a checkpoint in .* \(No space left on device\); the previous one is kept", lines[0])
    state, meta = checkpoint.load(ck)
    assert meta["epoch"] == 1 and not list(ck.glob("*.tmp"))


def test_read_only_file_system_is_refused_before_training(capsys, data_dir, small_mount):
    subprocess.run(["mount", "-o", "remount,ro", str(small_mount)], check=True)
    got, lines = run(capsys, ["--data-dir", str(data_dir), *TINY, "--cpus", "1",
                              "--checkpoint-dir", str(small_mount / "ck")])
    assert got == 2 and len(lines) == 1 and "Read-only file system" in lines[0], lines


def cli(*argv):
    return [sys.executable, "-m", "manual_dp.train", *map(str, argv)]


def test_two_runs_cannot_share_a_checkpoint_dir(tmp_path, data_dir):
    ck = tmp_path / "ck"
    first = subprocess.Popen(cli("--cpus", "1", "--data-dir", data_dir, *TINY, "--epochs", "200",
                                 "--checkpoint-dir", ck), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not (ck / checkpoint.NAME).exists() and time.time() < deadline:
            time.sleep(0.05)
        second = subprocess.run(cli("--cpus", "1", "--data-dir", data_dir, *TINY, "--epochs", "1",
                                    "--seed", "1", "--checkpoint-dir", ck), capture_output=True, text=True, timeout=120)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 1 and len(lines) == 1, second.stderr
        assert f"is in use by another run (pid {first.pid})" in lines[0]
        assert first.poll() is None                          # the first run goes on, untouched
    finally:
        first.kill()
        first.wait(timeout=30)
    state, meta = checkpoint.load(ck)                         # and its checkpoint is whole
    assert meta["config"]["seed"] == 0


def test_ctrl_c_while_mxnet_loads_is_one_line(tmp_path, data_dir):
    proc = subprocess.Popen(cli("--cpus", "1", "--data-dir", data_dir, *TINY), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    maps, deadline = f"/proc/{proc.pid}/maps", time.monotonic() + 60
    while time.monotonic() < deadline and "libmxnet" not in open(maps).read():
        time.sleep(0.01)                                      # until MXNet's library is being loaded
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and lines == ["manual_dp.train: error: interrupted"], err


def test_ctrl_c_while_training_is_one_line_and_exit_130(tmp_path, data_dir):
    proc = subprocess.Popen(cli("--cpus", "2", "--data-dir", data_dir, *TINY, "--epochs", "100000"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while "epoch 1/" not in proc.stdout.readline():          # training has begun
        assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip().splitlines() == ["manual_dp.train: error: interrupted"], err


# The table of modes (manual_dp/modes/): every mode the command line accepts is one entry, and every
# refusal an entry states is what the command line says, in one line, before any training.

BAD_LAYOUT = {     # a mode whose layout can refuse: flags on --cpus 3 that its `fits` refuses, and the words
    "model": (["--stages", "2"], "--mode model needs exactly 2 contexts"),
    "pipeline": (["--stages", "2"], "--mode pipeline needs exactly 2 contexts"),
    "hybrid": (["--stages", "2"], "--mode hybrid needs a multiple of 2 contexts"),
    "tensor": (["--tensor-parallel", "2"], "--tensor-parallel 2 does not divide the 3 contexts"),
    "context": (["--context-parallel", "2", "--model", "transformer"], "--context-parallel 2 does not divide the 3"),
    "mesh": (["--model", "transformer"], "--mode mesh needs a multiple of --stages 2 x --tensor-parallel 2"),
    "expert": (["--expert-parallel", "2"], "--expert-parallel 2 does not divide the 3 contexts"),
}
MODEL_OF = {"expert": ["--model", "gpt", "--data", "fortunes", "--experts", "4"]}   # a mode for some models only


def test_the_command_line_accepts_exactly_the_tables_modes():
    from manual_dp.cli.options import build_parser
    from manual_dp.modes import MODES, TABLE
    mode = next(a for a in build_parser()._actions if a.dest == "mode")
    assert tuple(mode.choices) == MODES == tuple(TABLE)
    laid_out = {name for name, entry in TABLE.items() if entry.fits.__name__ != "fits_anywhere"}
    assert laid_out == set(BAD_LAYOUT)


def refusing_modes():
    """The table's modes that refuse something: --deterministic, BatchNorm's statistics or a layout."""
    from manual_dp.modes import TABLE
    return [name for name, entry in TABLE.items() if entry.deterministic or entry.running or name in BAD_LAYOUT]


@pytest.mark.parametrize("name", refusing_modes())
def test_every_entrys_refusals_are_the_command_lines(capsys, data_dir, name):
    from manual_dp.modes import TABLE
    data = MODEL_OF.get(name, ["--data-dir", str(data_dir)])
    entry, base = TABLE[name], [*data, *TINY, "--mode", name, "--dry-run"]
    if entry.deterministic:
        code, lines = run(capsys, [*base, "--cpus", "2", "--deterministic"])
        assert code == 2 and lines == [f"manual_dp.train: error: --deterministic --mode {name}: {entry.deterministic}"]
    if entry.running:
        code, lines = run(capsys, [*base, "--cpus", "4", "--model", "resnet"])
        assert code == 2 and len(lines) == 1 and lines[0].endswith(entry.running), lines
    if name in BAD_LAYOUT:
        flags, words = BAD_LAYOUT[name]
        code, lines = run(capsys, [*base, "--cpus", "3", *flags])
        assert code == 2 and len(lines) == 1 and words in lines[0], lines
