"""ZeRO on a model with BatchNorm (strategies/running.py): the running statistics stay whole on every
context while parameters, gradients and optimiser state are sharded, and every stage computes what
data parallelism computes.

Tolerance, as tests/test_models.py: after 2 momentum steps the parameters and running statistics
differ from the reference only by the order of float32 additions (1e-5 of the largest value); a
statistic taken from one shard instead of the batch, or folded twice, moves them by more than 1e-3
(asserted for the per-context statistics below, so the comparison can fail)."""
import numpy as np
import pytest
from mxnet import autograd, nd

from conftest import batch, cpus, run_main
from manual_dp import models
from manual_dp.errors import CheckpointError
from manual_dp.strategies.data_parallel import DataParallel
from manual_dp.strategies.zero import ZeroRedundancy

TOL = 1e-5
TINY = ["--train-size", "96", "--test-size", "32", "--batch-size", "32", "--no-progress", "--epochs", "1"]


def after(strategy, steps=2, lr=0.01):
    X, y = batch(24, 0)
    for _ in range(steps):
        strategy.step(X, y, lr)
    return strategy.state_dict()


def close(got, want, tol=TOL):
    scale = max(float(np.abs(w).max()) for w in want)
    return max(float(np.abs(np.asarray(g) - w).max()) for g, w in zip(got, want)) <= tol * scale


@pytest.fixture(scope="module")
def resnet():
    net = models.build("resnet")
    P = net.init_params(0)
    return net, P, after(DataParallel(P, cpus(1), "momentum", lesson=True, model=net))


@pytest.mark.parametrize("stage,k", [(1, 2), (2, 2), (3, 2), (3, 3)])
def test_zero_with_sync_batchnorm_equals_one_context(resnet, stage, k):
    net, P, want = resnet
    model = ZeroRedundancy(P, cpus(k), "momentum", stage, model=net, sync_batchnorm=True)
    got = after(model)
    assert close(got["params"], want["params"])
    assert close(got["extra"]["running"], want["extra"]["running"])
    prints = model.fingerprints()["running statistics"]
    assert len(prints) == k and len({tuple(sums) for _, sums in prints}) == 1       # every context alike


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_with_per_context_statistics_equals_sync(resnet, stage):
    """Each context normalises its shard with its own statistics, as DataParallel does (Gluon's
    default): the same parameters and running statistics, and they differ from one context's."""
    net, P, whole = resnet
    want = after(DataParallel(P, cpus(2), "momentum", model=net))
    got = after(ZeroRedundancy(P, cpus(2), "momentum", stage, model=net))
    assert close(got["params"], want["params"]) and close(got["extra"]["running"], want["extra"]["running"])
    assert not close(got["params"], whole["params"], 1e-3)


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_evaluates_with_the_running_statistics(resnet, stage):
    net, P, _ = resnet
    sync, zero = DataParallel(P, cpus(2), "momentum", model=net), ZeroRedundancy(P, cpus(2), "momentum", stage, model=net)
    after(sync), after(zero)
    X, y = (nd.array(a) for a in batch(40, 5))
    autograd.set_training(True)          # as loop.evaluate
    try:
        assert float(zero.correct(X, y).asscalar()) == float(sync.correct(X, y).asscalar())
        assert float(zero.correct(X[:1], y[:1]).asscalar()) == float(sync.correct(X[:1], y[:1]).asscalar())
    finally:
        autograd.set_training(False)


def test_zero_checkpoint_keeps_the_running_statistics_and_resumes_in_sync(resnet):
    """ZeRO-3's checkpoint holds the running statistics; data parallelism resumes from it and
    continues as an uninterrupted run; a checkpoint without them is refused."""
    net, P, _ = resnet
    X, y = batch(24, 0)
    straight = DataParallel(P, cpus(2), "momentum", model=net, sync_batchnorm=True)
    for _ in range(3):
        straight.step(X, y, 0.01)
    zero = ZeroRedundancy(P, cpus(2), "momentum", 3, model=net, sync_batchnorm=True)
    zero.step(X, y, 0.01)
    state = zero.state_dict()
    resumed = DataParallel(P, cpus(2), "momentum", model=net, sync_batchnorm=True)
    resumed.load_state_dict(state)
    for _ in range(2):
        resumed.step(X, y, 0.01)
    assert close(resumed.state_dict()["params"], straight.state_dict()["params"])
    assert close(resumed.state_dict()["extra"]["running"], straight.state_dict()["extra"]["running"])
    back = ZeroRedundancy(P, cpus(3), "momentum", 2, model=net)
    back.load_state_dict(state)
    assert all(np.array_equal(a, b) for a, b in zip(back.state_dict()["extra"]["running"], state["extra"]["running"]))
    with pytest.raises(CheckpointError, match="running statistics"):
        ZeroRedundancy(P, cpus(2), "momentum", 1, model=net).load_state_dict(dict(state, extra={}))


def test_zero_memory_counts_the_whole_running_statistics(resnet):
    net, P, _ = resnet
    model = ZeroRedundancy(P, cpus(2), "momentum", 3, model=net)
    stats = sum(p.size for p in net.stats())
    kept = [a for a in model.arrays()["state"] if a.context == cpus(2)[1]]
    assert sum(a.size for a in kept) == stats + model.shards[1].size      # momentum's shard, whole statistics


def test_cli_resnet_under_zero_and_the_planner(capsys, data_dir):
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--model", "resnet", "--mode", "zero",
                                       "--zero-stage", "3", "--cpus", "2", "--sync-batchnorm"])
    assert code == 0 and "BatchNorm statistics over every context" in out, err
    code, out, err = run_main(capsys, ["--data-dir", str(data_dir), *TINY, "--model", "resnet", "--mode", "async"])
    assert code == 2 and len(err) == 1 and "not --mode async: each replica steps on its own" in err[0], err


def test_two_dist_sync_workers_train_resnet_under_zero_as_one_process(data_dir, tmp_path):
    """2 workers x 1 context of ZeRO-2 with --sync-batchnorm against one process with 2 contexts:
    the statistics' sums and counts cross the processes (to float rounding)."""
    from jobs import two_workers_as_one_process
    one, two = two_workers_as_one_process(tmp_path, 1, "--model", "resnet", "--mode", "zero", "--zero-stage", "2",
                                          "--sync-batchnorm", "--data-dir", data_dir, "--train-size", 128,
                                          "--test-size", 64, "--batch-size", 64, "--epochs", 1, "--lr", 0.01)
    assert one["test_acc"] == pytest.approx(two["test_acc"], abs=1e-6)
