import mxnet as mx
import numpy as np
import pytest
from mxnet import nd

from conftest import assert_on
from manual_dp import allreduce, get_params, split_and_load
from manual_dp.lesson import shard_sizes

# Legacy NDArrays have no 0-d shape: a scalar is the 1-element array (1,).
SHAPES = [(1,), (7,), (3, 5), (2, 3, 4), (20, 1, 3, 3)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_allreduce_equals_numpy_sum(ctx, shape):
    rng = np.random.RandomState(len(ctx))
    values = [rng.randn(*shape).astype(np.float32) for _ in ctx]
    arrays = [nd.array(v, ctx=c) for v, c in zip(values, ctx)]
    allreduce(arrays)
    for a, c in zip(arrays, ctx):
        assert a.context == c
        np.testing.assert_allclose(a.asnumpy(), np.sum(values, axis=0), rtol=1e-6, atol=1e-6)


def test_get_params_copies_to_context_with_gradients():
    params = [nd.ones((2, 3)), nd.zeros((4,))]
    copies = get_params(params, mx.cpu(3))
    assert_on(copies, mx.cpu(3))
    assert_on([p.grad for p in copies], mx.cpu(3))
    copies[0][:] = 5
    assert params[0].asnumpy().max() == 1, "get_params must copy, not alias"


@pytest.mark.parametrize("n", [4, 5, 7, 10, 11])
def test_split_and_load_uneven_reassembles(ctx, n):
    data = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    for source in (data, nd.array(data)):
        shards = split_and_load(source, ctx)
        assert len(shards) == len(ctx)
        for s, c in zip(shards, ctx):
            assert s.context == c
        sizes = [s.shape[0] for s in shards]
        assert max(sizes) - min(sizes) <= 1
        np.testing.assert_array_equal(np.concatenate([s.asnumpy() for s in shards]), data)


def test_split_and_load_batch_smaller_than_devices_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot be split over 4 devices"):
        split_and_load(np.zeros((3, 2)), [mx.cpu(i) for i in range(4)])


def test_shard_sizes():
    assert shard_sizes(10, 3) == [4, 3, 3]
    assert shard_sizes(3, 3) == [1, 1, 1]
    with pytest.raises(ValueError):
        shard_sizes(5, 0)
