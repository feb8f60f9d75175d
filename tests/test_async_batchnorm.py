"""Asynchronous data parallelism on a model with BatchNorm (strategies/data/async_dp.py): each device
normalises its shard with the statistics its own, possibly stale, replica gives and pushes them
with its gradient; the master folds their mean into the running statistics when it applies the
step, and keeps them the same on every context.

Tolerance, as tests/test_batchnorm_modes.py: after 2 momentum steps at lr 0.01 the parameters and
running statistics differ from the reference only by the order of float32 additions (1e-5 of the
largest value); one context's statistics, or a fresh replica's instead of a stale one's, move them
by more than 1e-3 (asserted, so the comparisons can fail)."""
import numpy as np
import pytest
from mxnet import autograd, nd

from conftest import after, batch, close, cpus, evaluates_alike, run_main, statistics_alike, straight_and_resumed
from manual_dp import models
from manual_dp.errors import CheckpointError
from manual_dp.lesson import cross_entropy
from manual_dp.models.batchnorm import MOMENTUM, Moments
from manual_dp.strategies.wrappers.accum import GradAccum
from manual_dp.strategies.data.async_dp import AsyncDataParallel
from manual_dp.strategies.data.data_parallel import DataParallel

TINY = ["--train-size", "96", "--test-size", "32", "--batch-size", "32", "--no-progress", "--epochs", "1"]


@pytest.fixture(scope="module")
def resnet():
    """(net, its initial parameters, one context's state and 2 contexts' (per-context statistics) after 2 steps)."""
    net = models.build("resnet")
    P = net.init_params(0)
    return (net, P, after(DataParallel(P, cpus(1), "momentum", lesson=True, model=net)),
            after(DataParallel(P, cpus(2), "momentum", model=net)))


def test_staleness_0_is_data_parallelism_with_per_context_statistics(resnet):
    net, P, one, sync = resnet
    got = after(AsyncDataParallel(P, cpus(2), "momentum", 0, model=net))
    assert close(got["params"], sync["params"]) and close(got["extra"]["running"], sync["extra"]["running"])
    assert not close(got["params"], one["params"], 1e-3)                   # not one context's statistics
    assert not close(got["extra"]["running"], one["extra"]["running"], 1e-3)


def test_gradient_accumulation_folds_every_batch_pushed(resnet):
    """A window of 2 batches, one update: each batch's statistics folded, as DataParallel folds them."""
    net, P, _, _ = resnet
    got, want = (after(GradAccum(make(), 2), steps=4) for make in (
        lambda: AsyncDataParallel(P, cpus(2), "momentum", 0, model=net),
        lambda: DataParallel(P, cpus(2), "momentum", model=net)))
    assert close(got["params"], want["params"]) and close(got["extra"]["running"], want["extra"]["running"])


def shard_step(net, W, X, y):
    """(gradients, batch statistics: each BatchNorm's mean and variance) of one device's shard (X,
    y) on parameters W (numpy), computed on cpu(0)."""
    params = [nd.array(w) for w in W]
    for p in params:
        p.attach_grad()
    moments = Moments(True)
    with autograd.record():
        loss = cross_entropy(net.forward_group([nd.array(X)], [params], moments)[0], nd.array(y))
    loss.backward()
    return [p.grad.asnumpy() for p in params], [s.asnumpy() for per_context in moments.batch for s in per_context[0]]


def replayed(net, P, k, staleness, steps=2, lr=0.01, n=24):
    """The documented rule replayed by hand in numpy: device j computes its shard's gradient and
    statistics on the master it last pulled, (t + j) % (staleness + 1) == 0 after update t; the
    master takes one momentum step on the summed gradients / n and folds the devices' mean
    statistics. Returns (parameters, running statistics)."""
    X, y = batch(n, 0)
    cut = np.array_split(np.arange(n), k)
    master, velocity = [p.asnumpy() for p in P], [np.zeros(p.shape, np.float32) for p in P]
    running, replicas = [s.asnumpy() for s in net.init_stats()], [master] * k
    for t in range(1, steps + 1):
        pushed = [shard_step(net, replicas[j], X[cut[j]], y[cut[j]]) for j in range(k)]
        grads = [sum(g[i] for g, _ in pushed) / n for i in range(len(master))]
        velocity = [0.9 * v + g for v, g in zip(velocity, grads)]
        master = [w - lr * v for w, v in zip(master, velocity)]
        means = [sum(s[i] for _, s in pushed) / k for i in range(len(running))]
        running = [MOMENTUM * r + (1 - MOMENTUM) * m for r, m in zip(running, means)]
        replicas = [master if (t + j) % (staleness + 1) == 0 else replicas[j] for j in range(k)]
    return master, running


def test_stale_replicas_normalise_with_their_own_statistics(resnet):
    """Staleness 1 on 2 contexts: the second step's device 0 still holds the initial parameters;
    the parameters and the running statistics are the hand replay's, and differ from staleness 0's."""
    net, P, _, sync = resnet
    model = AsyncDataParallel(P, cpus(2), "momentum", 1, model=net)
    got = after(model)
    assert model.versions == [2, 1]                  # after 2 updates: device 0 pulled at 2, device 1 at 1
    params, running = replayed(net, P, 2, 1)
    assert close(got["params"], params) and close(got["extra"]["running"], running)
    assert not close(got["params"], sync["params"], 1e-3)
    assert not close(got["extra"]["running"], sync["extra"]["running"], 1e-3)
    fresh = replayed(net, P, 2, 0)                                   # the hand replay tells the two apart too
    assert close(fresh[0], sync["params"]) and close(fresh[1], sync["extra"]["running"])


def test_running_statistics_alike_everywhere_and_evaluation_reads_them(resnet):
    net, P, _, _ = resnet
    model = AsyncDataParallel(P, cpus(2), "momentum", 1, model=net)
    state = after(model)
    assert statistics_alike(model, 2)
    assert [R[0].context for R in model.running] == cpus(2)
    sync = DataParallel(P, cpus(2), "momentum", model=net)
    sync.load_state_dict(state)                         # the same master parameters and running statistics
    assert evaluates_alike(model, sync, (40, 1))


def test_checkpoint_keeps_the_running_statistics_and_resumes_exactly(resnet):
    net, P, _, _ = resnet
    make = lambda: AsyncDataParallel(P, cpus(2), "momentum", 1, model=net)     # noqa: E731
    straight, resumed, state = straight_and_resumed(make, make(), *batch(24, 0))
    assert {"replicas", "running"} <= set(state["extra"])
    a, b = resumed.state_dict(), straight.state_dict()
    for got, want in ((a["params"], b["params"]), (a["extra"]["running"], b["extra"]["running"]),
                      (a["extra"]["replicas"], b["extra"]["replicas"])):
        assert all(np.array_equal(u, v) for u, v in zip(got, want))
    back = make()
    back.load_state_dict(state)
    for R in back.running:
        assert all(np.array_equal(r.asnumpy(), v) for r, v in zip(R, state["extra"]["running"]))
    with pytest.raises(CheckpointError, match="running statistics"):
        make().load_state_dict(dict(state, extra={"replicas": state["extra"]["replicas"]}))


def test_cli_trains_resnet_asynchronously_and_refuses_sync_batchnorm(capsys, data_dir):
    argv = ["--data-dir", str(data_dir), *TINY, "--model", "resnet", "--mode", "async", "--cpus", "2"]
    code, out, err = run_main(capsys, argv + ["--staleness", "1"])
    assert code == 0 and "replicas up to 1 updates stale" in out and "staleness" in out, err
    code, _, err = run_main(capsys, argv + ["--sync-batchnorm"])
    assert code == 2 and len(err) == 1 and "--sync-batchnorm: not --mode async" in err[0], err
