"""--compress from the command line: none is today's step, the bytes go to --log-json, a resumed
run continues with its residuals, and 2 dist_sync workers compute what one process with 2
contexts computes (the same payloads, decoded and added in the same order: bit for bit)."""
import importlib.util

import pytest

from conftest import write_dataset
from jobs import assert_same_run, horovod_cmd, launch_cmd, read_log, run_job, train_cmd
from manual_dp import checkpoint

SMALL = ["--train-size", "537", "--batch-size", "67", "--optimizer", "sgd", "--lr", "0.01",
         "--epochs", "2", "--test-size", "199"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("compress_data"))


def run(tmp_path, name, *argv, cmd=None):
    """(log, checkpoint dir) of one run of train_cmd(argv) (or `cmd` built from the outputs)."""
    log, ck = tmp_path / f"{name}.jsonl", tmp_path / f"{name}_ck"
    outputs = ["--log-json", log, "--checkpoint-dir", ck]
    code, out = run_job(cmd(*argv, *outputs) if cmd else train_cmd(*argv, *outputs), tmp_path / f"{name}.txt")
    assert code == 0, out
    return log, ck


def test_compress_none_is_todays_sync_step(data, tmp_path):
    today = run(tmp_path, "today", "--cpus", 2, "--data-dir", data, *SMALL)
    none = run(tmp_path, "none", "--cpus", 2, "--data-dir", data, *SMALL, "--compress", "none")
    assert_same_run(*today, *none, exact=True)
    assert "compress" not in read_log(none[0])[0]


@pytest.mark.parametrize("spec,most", [("2bit", 1 / 16), ("1bit", 1 / 32), ("fp16", 1 / 2), ("powersgd:2", 1 / 16)])
def test_bytes_per_step_are_logged(data, tmp_path, spec, most):
    log, _ = run(tmp_path, "c", "--cpus", 2, "--data-dir", data, *SMALL, "--epochs", 1, "--compress", spec)
    record, = read_log(log)
    assert record["compress"] == spec and record["fp32_bytes_per_step"] == 4 * 129068
    # + headers: 1bit's scale per parameter (8 float32), 2bit's last 4-byte block
    assert record["compress_bytes_per_step"] <= most * record["fp32_bytes_per_step"] + 4 * 8 + 4


def test_resume_continues_with_the_residuals(data, tmp_path):
    whole = run(tmp_path, "whole", "--cpus", 2, "--data-dir", data, *SMALL, "--compress", "2bit:0.05")
    log, ck = run(tmp_path, "part", "--cpus", 2, "--data-dir", data, *SMALL, "--compress", "2bit:0.05",
                  "--epochs", 1)
    state, _ = checkpoint.load(ck)
    assert len(state["extra"]["residual"]) == 2 and state["extra"]["residual"][0].any()
    resumed = run(tmp_path, "part", "--cpus", 2, "--data-dir", data, *SMALL, "--compress", "2bit:0.05",
                  "--resume")
    assert_same_run(*whole, *resumed, exact=True)


@pytest.mark.parametrize("spec", ["2bit:0.05", "powersgd:2"])
def test_dist_sync_workers_equal_one_process_with_two_contexts(data, tmp_path, spec):
    ref = run(tmp_path, "local", "--cpus", 2, "--data-dir", data, *SMALL, "--compress", spec)
    got = run(tmp_path, "kv", "--cpus", 1, "--data-dir", data, *SMALL, "--compress", spec,
              "--check-replicas", 1, cmd=lambda *argv: launch_cmd(2, "dist_sync", *argv))
    assert_same_run(*ref, *got, exact=True)
    (a, _), (b, _) = checkpoint.load(ref[1]), checkpoint.load(got[1])
    assert len(b["extra"]["residual"]) == 2                       # both workers' residuals, gathered
    for x, y in zip(a["extra"]["residual"], b["extra"]["residual"]):
        assert (x == y).all()


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="horovod is not installed")
def test_horovod_processes_equal_one_process_with_two_contexts(data, tmp_path):
    ref = run(tmp_path, "local", "--cpus", 2, "--data-dir", data, *SMALL, "--compress", "1bit")
    got = run(tmp_path, "hvd", "--cpus", 1, "--data-dir", data, *SMALL, "--compress", "1bit",
              cmd=lambda *argv: horovod_cmd(2, *argv))
    assert_same_run(*ref, *got, exact=True)
