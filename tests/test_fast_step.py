"""The fast step (fused gradients, cached graph, every allreduce) equals the lesson's step."""
import mxnet as mx
import numpy as np
import pytest

from conftest import assert_on
from manual_dp import ALLREDUCE_ALGORITHMS, DataParallel, init_lenet_params, make_allreduce
from manual_dp.fast.graph import lenet_loss_symbol
from test_step import batch, numpy_params

FAST = [dict(fuse_grads=True), dict(graph=True), dict(fuse_grads=True, graph=True)]


def run(model, steps, n=10, lr=0.05):
    losses = []
    for step in range(steps):
        X, y = batch(n, seed=step)
        losses.append(sum(l.asscalar() for l, _ in model.step(X, y, lr)))
    return losses


def assert_same_model(fast, ref, atol):
    for W, S, c in zip(fast.replicas, fast.states, fast.ctx):
        assert_on(W + [p.grad for p in W] + [s for st in S for s in st], c)
        for got, want in zip(numpy_params(W), numpy_params(ref.replicas[0])):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=atol)
        for st_got, st_want in zip(S, ref.states[0]):
            for got, want in zip(st_got, st_want):
                np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-4, atol=atol)


@pytest.mark.parametrize("options", FAST, ids=lambda o: "+".join(o))
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_fast_step_equals_lessons_step_on_one_context(ctx, options, optimizer):
    ref = DataParallel(init_lenet_params(seed=1), [mx.cpu(0)], optimizer, lesson=True)
    fast = DataParallel(init_lenet_params(seed=1), ctx, optimizer, lesson=True, **options)
    np.testing.assert_allclose(run(fast, 3), run(ref, 3), rtol=1e-5)
    assert_same_model(fast, ref, atol=1e-3 if optimizer == "adam" else 1e-6)


@pytest.mark.parametrize("name", sorted(ALLREDUCE_ALGORITHMS))
@pytest.mark.parametrize("fuse", [False, True], ids=["per-array", "fused"])
def test_training_with_each_allreduce_equals_the_reference(name, fuse):
    ctx = [mx.cpu(i) for i in range(3)]
    ref = DataParallel(init_lenet_params(seed=2), [mx.cpu(0)], "momentum", lesson=True)
    fast = DataParallel(init_lenet_params(seed=2), ctx, "momentum", make_allreduce(name),
                        fuse_grads=fuse, graph=fuse)
    np.testing.assert_allclose(run(fast, 2, n=13), run(ref, 2, n=13), rtol=1e-5)
    assert_same_model(fast, ref, atol=1e-6)


def test_fused_gradients_are_views_of_one_buffer_per_device():
    model = DataParallel(init_lenet_params(seed=0), [mx.cpu(0), mx.cpu(1)], "momentum", fuse_grads=True)
    run(model, 1)
    for f, W, c in zip(model.flat, model.replicas, model.ctx):
        assert_on([f.flat, f.grad], c)
        np.testing.assert_array_equal(f.grad.asnumpy(),
                                      np.concatenate([p.grad.asnumpy().ravel() for p in W]))
        np.testing.assert_array_equal(f.flat.asnumpy(), np.concatenate([p.asnumpy().ravel() for p in W]))


def test_metrics_survive_the_next_step():
    """The cached graph reuses its memory: metrics a caller still holds must not be overwritten."""
    model = DataParallel(init_lenet_params(seed=0), [mx.cpu(0), mx.cpu(1)], "sgd", graph=True, fuse_grads=False)
    ref = DataParallel(init_lenet_params(seed=0), [mx.cpu(0)], "sgd", lesson=True)
    X, y = batch(12)
    first = model.step(X, y, 0.1)
    X2, y2 = batch(12, seed=5)
    model.step(X2, y2, 0.1)
    (want_loss, want_correct), = ref.step(X, y, 0.1)
    assert sum(l.asscalar() for l, _ in first) == pytest.approx(want_loss.asscalar(), rel=1e-5)
    assert sum(c.asscalar() for _, c in first) == want_correct.asscalar()
    assert [l.context for l, _ in first] == model.ctx


def test_state_dict_moves_between_fused_and_per_array_models():
    a = DataParallel(init_lenet_params(seed=0), [mx.cpu(0), mx.cpu(1)], "adam", fuse_grads=True, graph=True)
    X, y = batch(8)
    a.step(X, y, 0.01)
    b = DataParallel(init_lenet_params(seed=5), [mx.cpu(0)], "adam", lesson=True)
    b.load_state_dict(a.state_dict())
    a.step(X, y, 0.01), b.step(X, y, 0.01)
    assert_same_model(a, b, atol=1e-5)
    c = DataParallel(init_lenet_params(seed=7), [mx.cpu(2)], "adam", fuse_grads=True)
    c.load_state_dict(b.state_dict())
    assert_same_model(c, b, atol=0)


def test_the_graph_is_built_from_lenet_itself():
    names = lenet_loss_symbol().list_inputs()
    assert names[0] == "X" and names[-1] == "y" and len(names) == 10


def test_epoch_loop_gives_the_same_history_fast_or_not():
    """run_epoch (prefetched batches, per-device running sums) on the fast step and the lesson's."""
    from manual_dp import fit
    X, y = batch(100, seed=3)
    data = (X, y), (X[:40], y[:40])
    histories = []
    for ctx, options in (([mx.cpu(0)], {"lesson": True}), ([mx.cpu(0), mx.cpu(1), mx.cpu(2)], FAST[2])):
        model = DataParallel(init_lenet_params(seed=4), ctx, "momentum", **options)
        histories.append(list(fit(model, *data, epochs=2, batch_size=16, lr=0.05,
                                    rng=np.random.default_rng(0))))
    for fast, ref in zip(*histories):
        assert fast["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-5)
        assert fast["train_acc"] == ref["train_acc"] and fast["test_acc"] == ref["test_acc"]


def test_prefetch_keeps_order_raises_and_stops_early():
    from manual_dp.fast.prefetch import prefetch
    assert list(prefetch(iter(range(50)), depth=3)) == list(range(50))

    def broken():
        yield 1
        raise KeyError("boom")
    with pytest.raises(KeyError, match="boom"):
        list(prefetch(broken()))
    for i, _ in enumerate(prefetch(iter(range(10 ** 6)))):
        if i == 3:
            break  # the producer thread notices and ends


def test_the_callers_batch_stays_writable_and_may_be_reused_at_once():
    """The fast step hands batches to MXNet without waiting; the caller's array must not be tied up."""
    model = DataParallel(init_lenet_params(seed=0), [mx.cpu(0), mx.cpu(1)], "sgd", fuse_grads=True, graph=True)
    ref = DataParallel(init_lenet_params(seed=0), [mx.cpu(0)], "sgd", lesson=True)
    X, y = batch(12)
    buffer_X, buffer_y = X.copy(), y.copy()
    model.step(buffer_X, buffer_y, 0.1)
    buffer_X[:] = 0  # reuse at once, before the devices have necessarily read it
    buffer_y[:] = 0
    ref.step(X, y, 0.1)
    for got, want in zip(numpy_params(model.replicas[0]), numpy_params(ref.replicas[0])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
