"""Asynchronous data parallelism: staleness 0 is sync, staleness S is textbook delayed SGD."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, nd

from conftest import assert_on, cpus, synthetic
from manual_dp import DataParallel, allreduce, cross_entropy, init_lenet_params, lenet
from manual_dp.strategies.data.async_dp import AsyncDataParallel, last_refresh, refresh_due
from manual_dp.checkpoint import CheckpointError
from manual_dp.lesson import shard_sizes


def batch(n, seed=0):
    images, labels = synthetic(n, seed)
    return (images.astype(np.float32) / 255)[:, None], labels.astype(np.int32)


def version_seen(k, t, staleness):
    """By brute force: the last update after which device k pulled (0: the initial copy)."""
    return max(u for u in range(t + 1) if u == 0 or (u + k) % (staleness + 1) == 0)


def check_placement(model):
    home = model.ctx[0]
    assert_on(model.master + [p.grad for p in model.master], home)
    assert_on([s for st in model.master_states for s in st], home)
    for W, c in zip(model.replicas, model.ctx):
        assert_on(W + [p.grad for p in W], c)


@pytest.mark.parametrize("staleness", [0, 1, 2, 5])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_refresh_schedule_bounds_staleness(k, staleness):
    for t in range(20):
        assert last_refresh(k, t, staleness) == version_seen(k, t, staleness)
        assert 0 <= t - last_refresh(k, t, staleness) <= staleness
    pulls = [t for t in range(1, 40) if refresh_due(k, t, staleness)]
    assert np.all(np.diff(pulls) == staleness + 1)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_staleness_zero_is_bitwise_the_sync_step(ctx, optimizer):
    sync = DataParallel(init_lenet_params(seed=1), ctx, optimizer, allreduce_fn=allreduce)
    asyn = AsyncDataParallel(init_lenet_params(seed=1), ctx, optimizer, staleness=0)
    for step in range(3):
        X, y = batch(13, seed=step)
        want, got = sync.step(X, y, 0.05), asyn.step(X, y, 0.05)
        assert [(l.asscalar(), c.asscalar()) for l, c in got] == [(l.asscalar(), c.asscalar()) for l, c in want]
    check_placement(asyn)
    for got, want in zip(asyn.state_dict()["params"], sync.state_dict()["params"]):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(asyn.master_states, sync.states[0]):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.asnumpy(), w.asnumpy())
    assert asyn.end_epoch(0.05) == {"staleness_mean": 0, "staleness_max": 0}


def delayed_sgd(params, batches, k, staleness, lr):
    """Reference on one context: device j's shard gradient taken at the master version it last pulled,
    all of a batch's gradients summed into one SGD step. Returns the master's history."""
    history = [[p.asnumpy() for p in params]]
    for t, (X, y) in enumerate(batches):
        total = [np.zeros_like(p) for p in history[-1]]
        start = 0
        for j, n in enumerate(shard_sizes(len(X), k)):
            W = [nd.array(p) for p in history[version_seen(j, t, staleness)]]
            for p in W:
                p.attach_grad()
            with autograd.record():
                loss = cross_entropy(lenet(nd.array(X[start:start + n]), W), nd.array(y[start:start + n]))
            loss.backward()
            total = [a + p.grad.asnumpy() for a, p in zip(total, W)]
            start += n
        history.append([p - lr * g / len(X) for p, g in zip(history[-1], total)])
    return history


@pytest.mark.parametrize("k,staleness", [(2, 1), (3, 2), (2, 3)])
def test_stale_gradients_equal_delayed_sgd(k, staleness):
    batches = [batch(11, seed=s) for s in range(6)]
    model = AsyncDataParallel(init_lenet_params(seed=3), cpus(k), "sgd", staleness)
    for X, y in batches:
        model.step(X, y, 0.1)
    want = delayed_sgd(init_lenet_params(seed=3), batches, k, staleness, 0.1)[-1]
    for got, w in zip(model.state_dict()["params"], want):
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-6)
    seen = [t - version_seen(j, t, staleness) for t in range(len(batches)) for j in range(k)]
    assert model.end_epoch(0.1) == {"staleness_mean": pytest.approx(np.mean(seen)),
                                    "staleness_max": max(seen)}
    assert max(seen) == staleness
    check_placement(model)


def test_stale_run_differs_from_sync_and_still_learns():
    ctx = cpus(2)
    sync = AsyncDataParallel(init_lenet_params(seed=0), ctx, "momentum", staleness=0)
    stale = AsyncDataParallel(init_lenet_params(seed=0), ctx, "momentum", staleness=2)
    X_test, y_test = (nd.array(a) for a in batch(200, seed=99))
    before = stale.correct(X_test, y_test).asscalar()
    for step in range(40):
        X, y = batch(32, seed=step)
        sync.step(X, y, 0.02), stale.step(X, y, 0.02)
    gap = max(np.abs(a - b).max() for a, b in zip(sync.state_dict()["params"], stale.state_dict()["params"]))
    assert gap > 1e-3
    after = stale.correct(X_test, y_test).asscalar()
    assert after > max(before, 100), (before, after)   # synthetic classes: chance is 20 of 200


def test_resume_mid_cycle_continues_exactly():
    a = AsyncDataParallel(init_lenet_params(seed=0), cpus(3), "adam", staleness=2)
    for step in range(4):
        a.step(*batch(12, seed=step), 0.01)
    a.end_epoch(0.01)
    b = AsyncDataParallel(init_lenet_params(seed=5), cpus(3), "adam", staleness=2)
    b.load_state_dict(a.state_dict())
    assert b.versions == a.versions and b.t == a.t == 4
    for step in range(4, 7):
        a.step(*batch(12, seed=step), 0.01), b.step(*batch(12, seed=step), 0.01)
    for got, want in zip(b.state_dict()["params"], a.state_dict()["params"]):
        np.testing.assert_array_equal(got, want)
    assert b.end_epoch(0.01) == a.end_epoch(0.01)
    check_placement(b)


@pytest.mark.parametrize("k", [1, 2, 4, 5])
def test_resume_on_another_device_count_reshards_the_replicas(k):
    """3 devices, S=2, after 4 updates: replicas of versions 4, 3, 2 (device j: last_refresh). On
    k devices device j must hold version last_refresh(j, 4, 2): the saved replica of that version
    (exactly), each on its own device; the stepping goes on."""
    a = AsyncDataParallel(init_lenet_params(seed=0), cpus(3), "adam", staleness=2)
    for step in range(4):
        a.step(*batch(12, seed=step), 0.01)
    saved = a.state_dict()
    b = AsyncDataParallel(init_lenet_params(seed=5), cpus(k), "adam", staleness=2)
    b.load_state_dict(saved)
    for j, W in enumerate(b.replicas):
        want = [p.asnumpy() for p in a.replicas[j % 3]]      # the same version: (t + j) mod 3 alike
        assert a.versions[j % 3] == b.versions[j]
        for got, value in zip(W, want):
            np.testing.assert_array_equal(got.asnumpy(), value)
    check_placement(b)
    b.step(*batch(12, seed=4), 0.01)
    assert b.t == 5


def test_correct_uses_the_master():
    model = AsyncDataParallel(init_lenet_params(seed=0), cpus(2), "sgd", staleness=3)
    model.step(*batch(10), 0.5)
    X, y = (nd.array(a) for a in batch(30, seed=7))
    want = (lenet(X, [nd.array(p) for p in model.state_dict()["params"]]).argmax(axis=1) == y.astype("float32")).sum()
    assert model.correct(X, y).asscalar() == want.asscalar()
    assert model.correct(X, y).context == mx.cpu(0)
