"""Learning-rate scaling and warm-up against their formulas; the loop's per-update rate; accumulation."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import nd

from conftest import assert_on, synthetic
from manual_dp import DataParallel, init_lenet_params
from manual_dp.strategies.wrappers.accum import GradAccum
from manual_dp.strategies.base import Strategy
from manual_dp.strategies.data.async_dp import AsyncDataParallel
from manual_dp.schedule import Warmup, lr_at, make_lr, scaled_lr, updates_per_epoch
from manual_dp.loop import fit, run_epoch


def batch(n, seed=0):
    images, labels = synthetic(n, seed)
    return (images.astype(np.float32) / 255)[:, None], labels.astype(np.int32)


@pytest.mark.parametrize("batch_size", [32, 256, 1024, 100])
def test_linear_scaling_rule(batch_size):
    assert scaled_lr(0.1, batch_size, "linear") == pytest.approx(0.1 * batch_size / 256)
    assert scaled_lr(0.1, batch_size, "none") == 0.1
    with pytest.raises(ValueError):
        scaled_lr(0.1, batch_size, "sqrt")


def test_warmup_ramps_linearly_then_holds():
    w = Warmup(peak=0.4, steps=4)
    assert [w(t) for t in range(7)] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4, 0.4])


def test_make_lr_combines_scaling_and_warmup():
    assert make_lr(0.05, 512, "none") == 0.05
    assert make_lr(0.05, 512, "linear") == pytest.approx(0.1)
    sched = make_lr(0.05, 512, "linear", warmup_epochs=1.5, n_updates_per_epoch=10)
    assert sched == Warmup(peak=pytest.approx(0.1), steps=15)
    assert lr_at(sched, 0) == pytest.approx(0.1 / 15) and lr_at(sched, 20) == pytest.approx(0.1)
    assert lr_at(0.3, 99) == 0.3


@pytest.mark.parametrize("n,b,accum,want", [(600, 64, 1, 10), (600, 64, 2, 5), (600, 32, 2, 10),
                                            (640, 64, 3, 4), (10, 64, 4, 1)])
def test_updates_per_epoch(n, b, accum, want):
    assert updates_per_epoch(n, b, accum) == want


class Recorder(Strategy):
    """A strategy that records the rate it is given and counts updates like the real ones."""

    def __init__(self):
        self.ctx, self.t, self.rates = [mx.cpu(0)], 0, []

    def backward(self, X, y):
        return [(nd.array([0.0]), nd.array([0.0]))]

    def update(self, lr, n_examples):
        self.rates.append(lr)
        self.t += 1

    def state_dict(self):
        return {"params": [], "opt_state": [], "t": self.t, "extra": {}}

    def correct(self, X, y):
        return nd.array([0.0])


def test_the_loop_asks_the_schedule_once_per_update():
    X, y = batch(50)
    model = Recorder()
    schedule = Warmup(peak=1.0, steps=8)
    for _ in fit(model, (X, y), (X[:4], y[:4]), 2, 10, schedule, np.random.default_rng(0)):
        pass
    assert model.rates == pytest.approx([schedule(t) for t in range(10)])
    run_epoch(model, X, y, 10, 0.5, None)
    assert model.rates[-5:] == [0.5] * 5


@pytest.mark.parametrize("lesson", [True, False], ids=["lesson_step", "fast_step"])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_sync_grad_accum_equals_one_big_batch(ctx, optimizer, lesson):
    big = DataParallel(init_lenet_params(seed=1), ctx, optimizer, lesson=True)
    acc = GradAccum(DataParallel(init_lenet_params(seed=1), ctx, optimizer, lesson=lesson), 3)
    for step in range(2):
        parts = [batch(n, seed=10 * step + i) for i, n in enumerate((9, 8, 7))]
        big.step(np.concatenate([X for X, _ in parts]), np.concatenate([y for _, y in parts]), 0.02)
        for X, y in parts:
            acc.step(X, y, 0.02)
    assert acc.t == big.t == 2
    for W, S, c in zip(acc.model.replicas, acc.model.states, ctx):
        assert_on(W + [p.grad for p in W] + [s for st in S for s in st], c)
    atol = 1e-4 if optimizer == "adam" else 1e-6
    for got, want in zip(acc.state_dict()["params"], big.state_dict()["params"]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=atol)


def test_async_grad_accum_equals_one_big_batch():
    ctx = [mx.cpu(0), mx.cpu(1)]
    big = AsyncDataParallel(init_lenet_params(seed=1), ctx, "momentum", staleness=1)
    acc = GradAccum(AsyncDataParallel(init_lenet_params(seed=1), ctx, "momentum", staleness=1), 2)
    for step in range(3):
        (X1, y1), (X2, y2) = batch(6, seed=2 * step), batch(6, seed=2 * step + 1)
        # shards line up: device k sees rows 3k..3k+2 of each half in both runs
        big.step(np.concatenate([X1[:3], X2[:3], X1[3:], X2[3:]]),
                 np.concatenate([y1[:3], y2[:3], y1[3:], y2[3:]]), 0.05)
        acc.step(X1, y1, 0.05), acc.step(X2, y2, 0.05)
    for got, want in zip(acc.state_dict()["params"], big.state_dict()["params"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert acc.end_epoch(0.05)["staleness_max"] == big.end_epoch(0.05)["staleness_max"] == 1


def test_end_epoch_applies_a_short_window():
    acc = GradAccum(DataParallel(init_lenet_params(seed=1), [mx.cpu(0)], "sgd"), 4)
    ref = DataParallel(init_lenet_params(seed=1), [mx.cpu(0)], "sgd", lesson=True)
    X, y = batch(20)
    for _ in fit(acc, (X, y), (X, y), 1, 8, 0.1, None):   # batches 8, 8, 4: one short window
        pass
    ref.step(X, y, 0.1)
    assert acc.t == 1 and acc.batches == 0
    for got, want in zip(acc.state_dict()["params"], ref.state_dict()["params"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
