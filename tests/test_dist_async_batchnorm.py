"""--backend dist_async on a model with BatchNorm (multiprocess/kvstore.py, PushPull): the running
statistics travel as the parameters do. Each worker folds its own batches' statistics into the copy
it pulled last, pushes the change beside its parameters' change, and the servers add every change.

The rule is checked in one process against MXNet's own KVStore (a local store with the servers'
update, AddDelta, two workers stepping in a known order): what a worker pulls is the start plus
each worker's change, each computed by DataParallel alone from the copy that worker held, added in
arrival order (the same float additions: bit for bit). The command line runs two real workers, and
one worker against one process (the start plus one change: float rounding, 1e-4 as
tests/jobs.assert_same_run).
"""
import mxnet as mx
import numpy as np
import pytest

from conftest import batch, cpus, write_dataset
from jobs import assert_same_run, launch_cmd, read_log, run_job, saved_arrays, train_cmd
from manual_dp import models
from manual_dp.multiprocess.distributed import flatten
from manual_dp.multiprocess.kvstore import PushPull
from manual_dp.multiprocess.ps_server import AddDelta
from manual_dp.strategies.base import rank_rows
from manual_dp.strategies.data.data_parallel import DataParallel


class Servers:
    """MXNet's local KVStore with the servers' update, whose init, as dist_async's, keeps the
    first worker's value (every worker of a job inits each key; rank 0's reaches the servers)."""

    def __init__(self):
        self.kv = mx.kv.create("local")
        self.kv.set_optimizer(AddDelta())
        self.keys = set()

    def init(self, key, value):
        if key not in self.keys:
            self.keys.add(key)
            self.kv.init(key, value)

    def push(self, key, value):
        self.kv.push(key, value)

    def pull(self, key, out):
        self.kv.pull(key, out=out)


class OneStore:
    """The part of KVStoreWorld that PushPull uses, on shared Servers: every 'worker' of one
    process sees the same store."""

    def __init__(self, kv, rank, size):
        self.kv, self.rank, self.size, self.step = kv, rank, size, 0

    def new_key(self, what):
        return what

    def progress(self):
        pass

    def collective(self, op, key, run, result=None):
        return run()


@pytest.fixture(scope="module")
def resnet():
    net = models.build("resnet")
    return net, net.init_params(0)


def test_the_servers_add_each_workers_change_of_parameters_and_statistics(resnet):
    net, P = resnet
    X, y = batch(24, 0)
    kv = Servers()
    workers = [PushPull(DataParallel(P, cpus(1), "momentum", model=net, graph=False), OneStore(kv, r, 2))
               for r in range(2)]
    start = flatten(workers[0].held()).asnumpy()

    def alone(rank):
        """A worker's change from the start, by DataParallel alone on its rows."""
        model = DataParallel(P, cpus(1), "momentum", model=net, graph=False)
        a, b = rank_rows(len(X), rank, 2, 1)
        model.backward(X[a:b], y[a:b])
        model.update(0.01, b - a)
        return flatten(list(model.replicas[0]) + list(model.running[0])).asnumpy() - start

    for w in workers:                                  # worker 0 steps and pulls, then worker 1
        w.step(X, y, 0.01)
    first, second = alone(0), alone(1)
    stats = slice(sum(p.size for p in P), None)
    assert np.abs(first[stats]).max() > 0 and np.abs(second[stats]).max() > 0      # the statistics moved
    np.testing.assert_array_equal(flatten(workers[0].held()).asnumpy(), (start + first).astype(np.float32))
    np.testing.assert_array_equal(flatten(workers[1].held()).asnumpy(), start + first + second)
    assert workers[1].model.fingerprints()["running statistics"]


def test_the_command_line_trains_it(tmp_path):
    """One worker equals one process (the servers return the start plus its change); two workers
    train to the end with running statistics saved; --sync-batchnorm is refused in one line."""
    data = write_dataset(tmp_path / "data", n_train=96, n_test=40)
    small = ["--model", "resnet", "--data-dir", str(data), "--train-size", "96", "--test-size", "40",
             "--batch-size", "24", "--epochs", "1", "--optimizer", "momentum", "--lr", "0.01"]
    runs = {"one": train_cmd("--cpus", 2, *small), "kv1": launch_cmd(1, "dist_async", "--cpus", 2, *small),
            "kv2": launch_cmd(2, "dist_async", "--cpus", 1, *small)}
    for name, cmd in runs.items():
        code, out = run_job([*cmd, "--log-json", str(tmp_path / f"{name}.jsonl"), "--checkpoint-dir",
                             str(tmp_path / name)], tmp_path / f"{name}.txt")
        assert code == 0, out
    assert_same_run(tmp_path / "one.jsonl", tmp_path / "one", tmp_path / "kv1.jsonl", tmp_path / "kv1", exact=False)
    start = models.build("resnet").init_stats()
    saved = saved_arrays(tmp_path / "kv2")[-len(start):]
    assert all(np.isfinite(a).all() for a in saved) and any(np.abs(a - s.asnumpy()).max() > 0
                                                             for a, s in zip(saved, start))
    assert np.isfinite(read_log(tmp_path / "kv2.jsonl")[-1]["test_acc"])
    code, out = run_job(launch_cmd(1, "dist_async", "--cpus", 1, *small, "--sync-batchnorm"), tmp_path / "no.txt")
    assert code == 2 and "--sync-batchnorm: not --backend dist_async" in out, out
