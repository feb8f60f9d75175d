import mxnet as mx
import numpy as np
import pytest

from conftest import assert_on, synthetic
from manual_dp import DataParallel, get_params, init_lenet_params, train_batch


def batch(n, seed=0):
    images, labels = synthetic(n, seed)
    return (images.astype(np.float32) / 255)[:, None], labels.astype(np.int32)


def numpy_params(replica):
    return [p.asnumpy() for p in replica]


@pytest.mark.parametrize("n", [12, 13])
def test_k_context_step_equals_one_context_step_on_full_batch(ctx, n):
    X, y = batch(n)
    params = init_lenet_params(seed=0)
    ref = [get_params(params, mx.cpu(0))]
    train_batch(X, y, ref, [mx.cpu(0)], lr=0.1)
    replicas = [get_params(params, c) for c in ctx]
    train_batch(X, y, replicas, ctx, lr=0.1)
    for W, c in zip(replicas, ctx):
        assert_on(W, c)
        assert_on([p.grad for p in W], c)
        for got, want in zip(numpy_params(W), numpy_params(ref[0])):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lesson", [True, False], ids=["lesson_step", "fast_step"])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_replicas_stay_identical_and_match_single_context(ctx, optimizer, lesson):
    one = DataParallel(init_lenet_params(seed=1), [mx.cpu(0)], optimizer, lesson=True)
    many = DataParallel(init_lenet_params(seed=1), ctx, optimizer, lesson=lesson)
    for step in range(3):
        X, y = batch(10, seed=step)
        loss_one = sum(l.asscalar() for l, _ in one.step(X, y, 0.05))
        loss_many = sum(l.asscalar() for l, _ in many.step(X, y, 0.05))
        assert loss_many == pytest.approx(loss_one, rel=1e-5)
    for W, S, c in zip(many.replicas, many.states, ctx):
        assert_on(W + [s for st in S for s in st], c)
        for got, want in zip(numpy_params(W), numpy_params(many.replicas[0])):
            np.testing.assert_array_equal(got, want)
        # Adam divides by sqrt(v): on near-zero gradients float noise moves a weight by up to lr.
        atol = 1e-3 if optimizer == "adam" else 1e-6
        for got, want in zip(numpy_params(W), numpy_params(one.replicas[0])):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=atol)


def test_metrics_count_correct_predictions_on_every_context(ctx):
    model = DataParallel(init_lenet_params(seed=0), ctx)
    X, y = batch(9)
    metrics = model.step(X, y, 0.0 + 1e-9)
    assert [l.context for l, _ in metrics] == ctx
    assert sum(c.asscalar() for _, c in metrics) == model.correct(X, y).asscalar()


def test_state_dict_round_trip():
    a = DataParallel(init_lenet_params(seed=0), [mx.cpu(0), mx.cpu(1)], "adam")
    X, y = batch(8)
    a.step(X, y, 0.01)
    b = DataParallel(init_lenet_params(seed=5), [mx.cpu(0), mx.cpu(1), mx.cpu(2)], "adam")
    b.load_state_dict(a.state_dict())
    a.step(X, y, 0.01), b.step(X, y, 0.01)
    for W, c in zip(b.replicas, b.ctx):
        assert_on(W, c)
        for got, want in zip(numpy_params(W), numpy_params(a.replicas[0])):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
