import mxnet as mx
import numpy as np
from mxnet import gluon, nd

from manual_dp import cross_entropy, init_lenet_params, lenet
from manual_dp.bench.train import gluon_lenet
from manual_dp.lesson import LENET_SHAPES, lenet_shapes


def load_into_gluon(net, params):
    net.initialize()
    net(nd.zeros((1, 1, 28, 28)))
    dense = {2: True, 3: True}
    for i, (layer_params, W, b) in enumerate(zip(
            [net[0], net[2], net[5], net[6]], params[0::2], params[1::2])):
        # gluon's Dense keeps weights as (out, in); ours are (in, out) for X @ W.
        layer_params.weight.set_data(W.T if i in dense else W)
        layer_params.bias.set_data(b)


def test_lenet_equals_gluon_lenet_with_same_weights():
    params = init_lenet_params(seed=3)
    net = gluon_lenet()
    load_into_gluon(net, params)
    X = nd.array(np.random.RandomState(0).rand(5, 1, 28, 28))
    np.testing.assert_allclose(lenet(X, params).asnumpy(), net(X).asnumpy(), rtol=1e-5, atol=1e-5)


def test_cross_entropy_equals_gluon_loss():
    scores = nd.array(np.random.RandomState(1).randn(6, 10))
    y = nd.array([0, 3, 9, 1, 1, 5])
    ref = gluon.loss.SoftmaxCrossEntropyLoss()(scores, y)
    np.testing.assert_allclose(cross_entropy(scores, y).asnumpy(), ref.asnumpy(), rtol=1e-6)


def test_init_is_seeded_shaped_and_placed():
    a, b = init_lenet_params(seed=1), init_lenet_params(seed=1)
    assert [p.shape for p in a] == [s for _, s in LENET_SHAPES]
    assert all((x.asnumpy() == y.asnumpy()).all() for x, y in zip(a, b))
    assert not np.allclose(a[0].asnumpy(), init_lenet_params(seed=2)[0].asnumpy())
    lesson = init_lenet_params(seed=1, scale=0.01, ctx=mx.cpu(2))
    assert all(p.context == mx.cpu(2) for p in lesson)
    assert abs(lesson[2].asnumpy().std() - 0.01) < 1e-3
    assert lenet_shapes(1) == LENET_SHAPES and all(
        (x.asnumpy() == y.asnumpy()).all() for x, y in zip(a, init_lenet_params(seed=1, width=1)))
    wide = init_lenet_params(seed=1, width=16)
    assert sum(p.size for p in wide) == 2_880 + 320 + 6_400_000 + 800 + 26_214_400 + 2_048 + 20_480 + 10
    assert lenet(nd.zeros((2, 1, 28, 28)), wide).shape == (2, 10)
