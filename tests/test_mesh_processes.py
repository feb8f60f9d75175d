"""Meshes across processes: data parallelism spans the processes, the other dimensions stay inside
each one. 2 workers each holding a context-parallel group (or a pipeline of tensor groups) against
one process holding both. dp x pp x tp: each shard's gradient is g0 + g1 either way, so the runs
agree bit for bit; dp x cp: one process sums its 4 contexts' copies in one all-reduce, two processes
sum pairs, then the pairs, so float32 rounding of that order (rtol 1e-5)."""
import importlib.util

import pytest

from conftest import write_dataset
from jobs import assert_same_run, horovod_cmd, launch_cmd, run_job, train_cmd

HAVE_HOROVOD = importlib.util.find_spec("horovod") is not None and \
    importlib.util.find_spec("horovod.mxnet") is not None


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("mesh_dist_data"))


def small_run(data, *more):
    return ["--model", "transformer", "--layers", "2", "--d-model", "16", "--heads", "4", "--data-dir", data,
            "--train-size", "160", "--batch-size", "32", "--optimizer", "sgd", "--lr", "0.05", "--epochs", "2",
            "--test-size", "64", *more]


@pytest.mark.parametrize("engine,mesh,per_process", [("dist_sync", "dp=2,cp=2", "cp=2"),
                                                     ("horovod", "dp=2,pp=2,tp=2", "pp=2,tp=2")])
def test_two_workers_of_a_mesh_equal_one_process(small_data, tmp_path, engine, mesh, per_process):
    if engine == "horovod" and not HAVE_HOROVOD:
        pytest.skip("horovod.mxnet is not importable (bash setup.sh --test installs it)")
    n = 4 if "cp" in mesh else 8
    extra = ["--micro-batches", "2"] if "pp" in mesh else ["--attention", "ulysses"]
    ref_log, ref_ck, log, ck = (tmp_path / x for x in ("local.jsonl", "local_ck", "w.jsonl", "w_ck"))
    code, out = run_job(train_cmd("--cpus", n, "--mesh", mesh, *extra,
                                  *small_run(small_data, "--log-json", ref_log, "--checkpoint-dir", ref_ck)),
                        tmp_path / "local.txt")
    assert code == 0, out
    argv = ["--cpus", n // 2, "--mesh", per_process, *extra,
            *small_run(small_data, "--log-json", log, "--checkpoint-dir", ck)]
    cmd = launch_cmd(2, "dist_sync", *argv) if engine == "dist_sync" else horovod_cmd(2, *argv)
    code, out = run_job(cmd, tmp_path / "out.txt")
    assert code == 0, out
    assert "dp also spans the 2 processes" in out and out.count("epoch 2/2") == 1
    assert_same_run(ref_log, ref_ck, log, ck, exact="pp" in mesh)
