"""Several processes on loopback compute what one process with all their contexts computes.

Every job is bounded in time and killed with its whole process group when a test ends.
"""
import importlib.util
import os
import signal
import subprocess
import time

import mxnet as mx
import numpy as np
import pytest
from mxnet import nd

from conftest import write_dataset
from jobs import (Job, assert_same_run, horovod_cmd, launch_cmd, read_log, run_job, train_cmd,
                  trainer_pids, wait_for)
from manual_dp import checkpoint
from manual_dp.multiprocess.distributed import flatten, unflatten
from manual_dp.strategies.base import rank_rows
from manual_dp.lesson import shard_sizes
from manual_dp.train import main

HAVE_HOROVOD = importlib.util.find_spec("horovod") is not None and \
    importlib.util.find_spec("horovod.mxnet") is not None
needs_horovod = pytest.mark.skipif(not HAVE_HOROVOD, reason="horovod.mxnet is not importable "
                                   "(bash setup.sh --test installs it)")

# Uneven shards (67 = 34 + 33), a last batch of 66 and, with 537 images, a tail of 1 that every
# layout drops; plain SGD with a small lr, so that the test accuracy is still moving.
SMALL = ["--train-size", "537", "--batch-size", "67", "--optimizer", "sgd", "--lr", "0.01",
         "--epochs", "2", "--test-size", "199"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("dist_data"))


@pytest.fixture(scope="module")
def bigger_data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("dist_data_big"), n_train=1200, n_test=100)


def local_run(tmp_path, name, cpus, *argv):
    """The reference: one process with `cpus` contexts; returns (log, checkpoint dir)."""
    log, ck = tmp_path / f"{name}.jsonl", tmp_path / f"{name}_ck"
    code, out = run_job(train_cmd("--cpus", cpus, "--log-json", log, "--checkpoint-dir", ck, *argv),
                        tmp_path / f"{name}.txt")
    assert code == 0, out
    return log, ck


# Pure pieces ---------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 7, 12, 67, 100])
@pytest.mark.parametrize("size,k", [(1, 1), (2, 1), (2, 2), (3, 2), (2, 3)])
def test_rank_rows_are_the_global_shards_of_each_rank(n, size, k):
    if n < size * k:
        with pytest.raises(ValueError):
            rank_rows(n, 0, size, k)
        return
    sizes = shard_sizes(n, size * k)
    rows = [rank_rows(n, r, size, k) for r in range(size)]
    assert rows[0][0] == 0 and rows[-1][1] == n
    for r, (start, stop) in enumerate(rows):
        assert stop - start == sum(sizes[r * k:(r + 1) * k])
        # split_and_load over the rank's k contexts yields exactly the global shards
        assert shard_sizes(stop - start, k) == sizes[r * k:(r + 1) * k]
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))


def test_flatten_unflatten_round_trip_across_contexts():
    rng = np.random.RandomState(0)
    arrays = [nd.array(rng.randn(*s), ctx=mx.cpu(1)) for s in [(2, 3), (4,), (1,)]]
    extra = [nd.array([7.0], ctx=mx.cpu(0))]
    flat = flatten(arrays, extra)
    assert flat.shape == (12,) and flat.context == mx.cpu(1) and flat[11].asscalar() == 7
    targets = [nd.zeros(a.shape, ctx=mx.cpu(2)) for a in arrays]
    unflatten(flat, targets)
    for a, t in zip(arrays, targets):
        assert t.context == mx.cpu(2)
        np.testing.assert_array_equal(a.asnumpy(), t.asnumpy())


# Bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--backend", "dist_sync"], "runs as a worker under the launcher"),
    (["--backend", "dist_async"], "python -m manual_dp.launch"),
    (["--backend", "mpi"], "invalid choice"),
    (["--timeout", "0"], "--timeout must be positive"),
])
def test_bad_backend_input_is_one_line_and_exit_2(data, argv, message, capsys, monkeypatch):
    for name in [k for k in os.environ if k.startswith("DMLC_")]:
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit) as exit:
        main(["--data-dir", str(data), "--cpus", "1", *argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("manual_dp.train: error:") and message in lines[0]


@needs_horovod
def test_horovod_refuses_modes_it_does_not_run(data):
    done = subprocess.run(train_cmd("--backend", "horovod", "--data-dir", data, "--cpus", "2",
                                    "--mode", "async"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "runs every mode but async" in done.stderr.strip().splitlines()[-1]


# N processes x k contexts == 1 process x N*k contexts ------------------------------------------

@needs_horovod
@pytest.mark.parametrize("per_process,exact", [(1, True), (2, False)], ids=["2x1_vs_1x2", "2x2_vs_1x4"])
def test_two_horovod_processes_equal_one_process_with_all_their_contexts(data, tmp_path, per_process, exact):
    """2 processes x k contexts against 1 process x 2k. With k = 1 the sums are added in the same
    order, so bit for bit; with k = 2, (g0 + g1) + (g2 + g3) against ((g0 + g1) + g2) + g3: equal
    up to float rounding."""
    ref_log, ref_ck = local_run(tmp_path, "local", 2 * per_process, "--data-dir", data, *SMALL)
    log, ck = tmp_path / "hvd.jsonl", tmp_path / "hvd_ck"
    code, out = run_job(horovod_cmd(2, "--cpus", per_process, "--data-dir", data, *SMALL, "--log-json", log,
                                    "--checkpoint-dir", ck), tmp_path / "out.txt")
    assert code == 0, out
    assert_same_run(ref_log, ref_ck, log, ck, exact=exact)
    assert read_log(log)[0]["test_acc"] < 1  # the evaluation is compared, not saturated
    # rank 0 alone prints the epochs
    assert out.count("epoch 2/2") == 1 and "[0]<stdout>:epoch 2/2" in out


@pytest.mark.parametrize("fast", [[], ["--fuse-grads", "--graph", "--optimizer", "momentum"]],
                         ids=["lesson_step", "fused_graph_momentum"])
def test_dist_sync_workers_equal_one_process_with_two_contexts(data, tmp_path, fast):
    ref_log, ref_ck = local_run(tmp_path, "local", 2, "--data-dir", data, *SMALL, *fast)
    log, ck = tmp_path / "kv.jsonl", tmp_path / "kv_ck"
    code, out = run_job(launch_cmd(2, "dist_sync", "--cpus", 1, "--data-dir", data, *SMALL, *fast,
                                   "--log-json", log, "--checkpoint-dir", ck), tmp_path / "out.txt")
    assert code == 0, out
    assert_same_run(ref_log, ref_ck, log, ck, exact=True)
    assert out.count("epoch 2/2") == 1


@pytest.mark.parametrize("mode", [["--mode", "pipeline", "--micro-batches", "2"], ["--grad-accum", "2"],
                                  ["--mode", "pipeline", "--micro-batches", "2", "--stages", "3", "--schedule",
                                   "1f1b", "--recompute"]],
                         ids=["pipeline_vs_hybrid", "grad_accum", "pipeline_s3_1f1b_recompute_vs_hybrid"])
def test_any_mode_runs_across_dist_sync_workers(data, tmp_path, mode):
    """The cross-process sum is composed into the strategy: 2 workers x (one 2-context pipeline)
    compute what one process's 2 x 2 hybrid computes; grad-accum across workers what it computes
    in one process. Each global gradient is the same two float32 sums, so bit for bit."""
    local = ["--mode", "hybrid", *mode[2:]] if "pipeline" in mode else mode
    per_worker = (int(mode[mode.index("--stages") + 1]) if "--stages" in mode else 2) if "pipeline" in mode else 1
    ref_log, ref_ck = local_run(tmp_path, "local", 2 * per_worker, "--data-dir", data, *SMALL, *local)
    log, ck = tmp_path / "kv.jsonl", tmp_path / "kv_ck"
    code, out = run_job(launch_cmd(2, "dist_sync", "--cpus", per_worker, "--data-dir", data, *SMALL, *mode,
                                   "--check-replicas", 1, "--log-json", log, "--checkpoint-dir", ck),
                        tmp_path / "out.txt")   # every rank's copies compared after every update
    assert code == 0, out
    assert_same_run(ref_log, ref_ck, log, ck, exact=True)


def test_dist_async_runs_and_learns(data, tmp_path):
    log = tmp_path / "async.jsonl"
    code, out = run_job(launch_cmd(2, "dist_async", "--cpus", 1, "--data-dir", data, "--epochs", 3,
                                   "--batch-size", 32, "--optimizer", "sgd", "--lr", 0.02,
                                   "--log-json", log, servers=2), tmp_path / "out.txt")
    assert code == 0, out
    records = read_log(log)
    assert [r["epoch"] for r in records] == [1, 2, 3]
    assert records[-1]["train_loss"] < 0.5 * records[0]["train_loss"]
    assert records[-1]["test_acc"] > 0.6  # ten classes: chance is 0.1


# A process dies: the job ends, non-zero, in bounded time; its checkpoint resumes -------------

def kill_one_worker_then_resume(tmp_path, start, resume, pick, sig=signal.SIGKILL, bound=30):
    """Start the job, wait for rank 0's first checkpoint, send `sig` to the worker `pick`
    finds, and check that the job ends non-zero within `bound` s; then resume to the end
    (unless `resume` is None). Returns (seconds from the signal to the end of the job, the job's output)."""
    ck = tmp_path / "ck"
    job = Job(start(ck), tmp_path / "killed.txt")
    try:
        wait_for(lambda: (ck / checkpoint.NAME).exists(), 120, "the first checkpoint")
        victim, = wait_for(lambda: pick(str(ck)), 30, "the worker to stop")
        os.kill(victim, sig)
        t0 = time.monotonic()
        code = job.wait(bound)
        took = time.monotonic() - t0
        out = job.output()
    finally:
        job.close()
    assert code != 0, out
    state, meta = checkpoint.load(ck)  # intact: it loads
    assert 1 <= meta["epoch"] < 3
    if resume is None:
        return took, out
    code, out2 = run_job(resume(ck), tmp_path / "resumed.txt")
    assert code == 0, out2
    assert f"resumed from {ck} after epoch {meta['epoch']}" in out2
    return took, out


COMMON = ["--epochs", "3", "--batch-size", "32"]


@needs_horovod
def test_horovod_worker_killed_ends_the_job_and_resume_continues(bigger_data, tmp_path):
    ref_log, ref_ck = local_run(tmp_path, "local", 2, "--data-dir", bigger_data, *COMMON)
    log = tmp_path / "log.jsonl"
    args = ["--cpus", 1, "--data-dir", bigger_data, *COMMON, "--log-json", log, "--resume"]
    took, out = kill_one_worker_then_resume(
        tmp_path,
        start=lambda ck: horovod_cmd(2, *args, "--checkpoint-dir", ck),
        resume=lambda ck: horovod_cmd(2, *args, "--checkpoint-dir", ck),
        pick=lambda marker: trainer_pids(marker, HOROVOD_RANK="1"))
    assert "manual_dp.train: error: rank 0 of 2 (horovod): a collective failed" in out or \
        "Terminating remaining workers" in out, out
    print(f"horovod: job ended {took:.2f} s after kill -9 of rank 1")
    assert_same_run(ref_log, ref_ck, log, tmp_path / "ck", exact=True)


def test_dist_sync_worker_killed_ends_the_job_and_resume_continues(bigger_data, tmp_path):
    ref_log, ref_ck = local_run(tmp_path, "local", 2, "--data-dir", bigger_data, *COMMON)
    log = tmp_path / "log.jsonl"
    args = ["--cpus", 1, "--data-dir", bigger_data, *COMMON, "--log-json", log, "--resume"]
    took, out = kill_one_worker_then_resume(
        tmp_path,
        start=lambda ck: launch_cmd(2, "dist_sync", *args, "--checkpoint-dir", ck),
        resume=lambda ck: launch_cmd(2, "dist_sync", *args, "--checkpoint-dir", ck),
        pick=lambda marker: trainer_pids(marker, DMLC_ROLE="worker", MANUAL_DP_LOCAL_RANK="1"))
    assert "manual_dp.launch: error: worker 1 was killed by SIGKILL; stopping the job" in out, out
    print(f"dist_sync: job ended {took:.2f} s after kill -9 of a worker")
    assert_same_run(ref_log, ref_ck, log, tmp_path / "ck", exact=True)


def test_a_hung_worker_ends_the_job_through_the_watchdog(bigger_data, tmp_path):
    """SIGSTOP: the worker neither exits nor answers; the other's watchdog gives up."""
    args = ["--cpus", 1, "--data-dir", bigger_data, *COMMON, "--timeout", 3]
    took, out = kill_one_worker_then_resume(
        tmp_path,
        start=lambda ck: launch_cmd(2, "dist_sync", *args, "--checkpoint-dir", ck),
        resume=None,
        pick=lambda marker: trainer_pids(marker, DMLC_ROLE="worker", MANUAL_DP_LOCAL_RANK="1"),
        sig=signal.SIGSTOP)
    assert "no progress for 3 s (another process died or hangs)" in out, out
    print(f"dist_sync: job ended {took:.2f} s after SIGSTOP of a worker (--timeout 3)")
