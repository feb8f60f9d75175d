"""Every --mode through the command line: same numbers as one device, resume, logs, bad input."""
import json
import re

import numpy as np
import pytest

from manual_dp import checkpoint
from manual_dp.train import main

TINY = ["--train-size", "100", "--test-size", "64", "--batch-size", "32", "--no-progress"]
MODES = {
    "sync": ["--cpus", "2"],
    "sync-accum": ["--cpus", "2", "--grad-accum", "2"],
    "async0": ["--cpus", "2", "--mode", "async", "--staleness", "0"],
    "async2": ["--cpus", "3", "--mode", "async", "--staleness", "2"],
    "model": ["--cpus", "2", "--mode", "model"],
    "pipeline": ["--cpus", "2", "--mode", "pipeline", "--micro-batches", "5"],
    "hybrid": ["--cpus", "4", "--mode", "hybrid", "--micro-batches", "2"],
    "hybrid-warmup": ["--cpus", "4", "--mode", "hybrid", "--warmup-epochs", "1", "--scale-lr", "linear"],
    "zero1": ["--cpus", "3", "--mode", "zero", "--zero-stage", "1"],
    "zero2-accum": ["--cpus", "2", "--mode", "zero", "--zero-stage", "2", "--grad-accum", "2"],
    "zero3": ["--cpus", "3", "--mode", "zero", "--zero-stage", "3", "--check-replicas", "1"],
    "local1": ["--cpus", "2", "--mode", "local", "--sync-every", "1"],   # momentum is linear: sync's step
    "local3-nesterov": ["--cpus", "3", "--mode", "local", "--sync-every", "3", "--outer-optimizer", "nesterov",
                        "--outer-lr", "0.7", "--outer-momentum", "0.8", "--grad-accum", "2"],
    "pipeline-s4-1f1b-recompute": ["--cpus", "4", "--mode", "pipeline", "--stages", "4", "--schedule", "1f1b",
                                   "--micro-batches", "3", "--recompute"],
    "hybrid-s3-1f1b": ["--cpus", "6", "--mode", "hybrid", "--stages", "3", "--schedule", "1f1b",
                       "--micro-batches", "2"],
    "tensor": ["--cpus", "4", "--mode", "tensor"],
    "tensor-2x2-accum": ["--cpus", "4", "--mode", "tensor", "--tensor-parallel", "2", "--grad-accum", "2",
                         "--check-replicas", "1"],
}


def train(capsys, tmp_path, data_dir, name, *argv):
    """Run the CLI in-process; returns (log records, final checkpointed params)."""
    out = tmp_path / name
    try:
        main(["--data-dir", str(data_dir), "--log-json", str(out) + ".jsonl",
              "--checkpoint-dir", str(out), *TINY, *argv])
    except SystemExit as e:
        pytest.fail(f"exit {e.code}: {capsys.readouterr().err}")
    capsys.readouterr()
    records = [json.loads(line) for line in open(str(out) + ".jsonl")]
    return records, checkpoint.load(out)[0]["params"]


def assert_same_run(a, b, rtol=1e-5, atol=1e-6):
    (rec_a, params_a), (rec_b, params_b) = a, b
    for key in ("train_loss", "train_acc", "test_acc"):
        assert [r[key] for r in rec_a] == pytest.approx([r[key] for r in rec_b], rel=rtol), key
    for got, want in zip(params_a, params_b):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("mode", ["model", "pipeline", "hybrid", "async0", "local1", "pipeline-s4-1f1b-recompute",
                                  "hybrid-s3-1f1b", "tensor"])
def test_mode_trains_like_one_device(capsys, tmp_path, data_dir, mode):
    one = train(capsys, tmp_path, data_dir, "one", "--cpus", "1", "--epochs", "2")
    assert_same_run(train(capsys, tmp_path, data_dir, mode, *MODES[mode], "--epochs", "2"), one)


def test_async_staleness_zero_is_exactly_the_sync_run(capsys, tmp_path, data_dir):
    sync_records, sync_params = train(capsys, tmp_path, data_dir, "sync", *MODES["sync"], "--epochs", "2")
    records, params = train(capsys, tmp_path, data_dir, "async", *MODES["async0"], "--epochs", "2")
    for key in ("train_loss", "train_acc", "test_acc"):
        assert [r[key] for r in records] == [r[key] for r in sync_records], key
    for got, want in zip(params, sync_params):
        np.testing.assert_array_equal(got, want)


def test_grad_accum_equals_the_doubled_batch(capsys, tmp_path, data_dir):
    """100 examples: batches 32+32, 32+4 accumulated are the batches 64, 36 of the big run."""
    big = train(capsys, tmp_path, data_dir, "big", "--cpus", "2", "--epochs", "2", "--batch-size", "64")
    acc = train(capsys, tmp_path, data_dir, "acc", *MODES["sync-accum"], "--epochs", "2")
    assert_same_run(acc, big)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_resume_continues_the_same_run(capsys, tmp_path, data_dir, mode):
    straight = train(capsys, tmp_path, data_dir, "straight", *MODES[mode], "--epochs", "2")
    train(capsys, tmp_path, data_dir, "resumed", *MODES[mode], "--epochs", "1")
    resumed = train(capsys, tmp_path, data_dir, "resumed", *MODES[mode], "--epochs", "2", "--resume")
    assert_same_run(resumed, straight, rtol=1e-6, atol=0)


def test_log_records_mode_memory_and_what_was_measured(capsys, tmp_path, data_dir):
    records, _ = train(capsys, tmp_path, data_dir, "a", *MODES["async2"], "--epochs", "1")
    r = records[0]
    assert r["mode"] == "async" and set(r["memory"]) == {"cpu(0)", "cpu(1)", "cpu(2)"}
    assert r["staleness_max"] == 2 and 0 < r["staleness_mean"] < 2
    assert r["memory"]["cpu(0)"]["param_bytes"] == 2 * r["memory"]["cpu(1)"]["param_bytes"]  # + master
    records, _ = train(capsys, tmp_path, data_dir, "p", *MODES["pipeline"], "--epochs", "1")
    # 32, 32, 32 cut in 5 micro-batches; the tail of 4 in 4
    assert records[0]["bubble_fraction"] == pytest.approx(np.mean([1 / 6] * 3 + [1 / 5]))
    mem = records[0]["memory"]
    assert {r["method"] for r in mem.values()} == {"profiler"}           # measured (manual_dp.memory)
    assert mem["cpu(0)"]["activation_bytes"] > mem["cpu(1)"]["activation_bytes"]   # the conv stage's
    assert mem["cpu(1)"]["param_bytes"] > 4 * mem["cpu(0)"]["param_bytes"]


BAD = [
    (["--cpus", "1", "--mode", "model"], "--mode model needs exactly 2 contexts .* got 1"),
    (["--cpus", "3", "--mode", "pipeline"], "--mode pipeline needs exactly 2 contexts .* got 3"),
    (["--cpus", "3", "--mode", "hybrid"], "--mode hybrid needs a multiple of 2 contexts .* got 3"),
    (["--cpus", "2", "--mode", "pipeline", "--micro-batches", "40"],
     "--micro-batches 40 is larger than the per-device batch of 32"),
    (["--cpus", "4", "--mode", "hybrid", "--micro-batches", "17"],
     "--micro-batches 17 is larger than the per-device batch of 16"),
    (["--cpus", "2", "--mode", "pipeline", "--micro-batches", "0"], "--micro-batches must be >= 1"),
    (["--cpus", "2", "--mode", "async", "--staleness", "-1"], "--staleness must be >= 0"),
    (["--cpus", "2", "--staleness", "2"], "--staleness applies only to --mode async"),
    (["--cpus", "2", "--mode", "model", "--micro-batches", "2"], "--micro-batches applies only to"),
    (["--cpus", "2", "--grad-accum", "0"], "--grad-accum must be >= 1"),
    (["--cpus", "2", "--warmup-epochs", "nan"], "--warmup-epochs must be >= 0"),
    (["--cpus", "2", "--mode", "ring"], "invalid choice: 'ring'"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_mode_input_is_one_line_and_exit_2(capsys, data_dir, argv, message):
    with pytest.raises(SystemExit) as e:
        main(["--data-dir", str(data_dir), *TINY, *argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("manual_dp.train: error:"), err
    assert re.search(message, lines[0]), lines[0]


def test_resume_refuses_a_mode_of_another_algorithm(capsys, tmp_path, data_dir):
    """A layout equal to one context continues any other (Mode.algorithm: tests/test_checkpoint_steps.py);
    async and local SGD compute other algorithms, so a model-parallel checkpoint does not go on as them."""
    train(capsys, tmp_path, data_dir, "run", *MODES["model"], "--epochs", "1")
    for other in ("async2", "local1"):
        with pytest.raises(SystemExit) as e:
            main(["--data-dir", str(data_dir), "--checkpoint-dir", str(tmp_path / "run"), *TINY,
                  *MODES[other], "--epochs", "2", "--resume"])
        assert e.value.code == 1 and "holds a run with other settings: mode 'model' there" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["zero1", "zero3"])
def test_zero_trains_like_one_device(capsys, tmp_path, data_dir, mode):
    one = train(capsys, tmp_path, data_dir, "one", "--cpus", "1", "--epochs", "2")
    assert_same_run(train(capsys, tmp_path, data_dir, mode, *MODES[mode], "--epochs", "2"), one)


def test_zero_with_grad_accum_equals_the_doubled_batch(capsys, tmp_path, data_dir):
    big = train(capsys, tmp_path, data_dir, "big", "--cpus", "1", "--epochs", "2", "--batch-size", "64")
    assert_same_run(train(capsys, tmp_path, data_dir, "acc", *MODES["zero2-accum"], "--epochs", "2"), big)
