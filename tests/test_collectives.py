import mxnet as mx
import numpy as np
import pytest
from mxnet import nd

from manual_dp import ALLREDUCE_ALGORITHMS
from manual_dp.fast.collectives import chunk_bounds, make_allreduce

# Sizes not divisible by k, single elements, fewer elements than contexts, LeNet's conv weight.
SHAPES = [(1,), (2,), (7,), (3, 5), (2, 3, 4), (20, 1, 3, 3), (1001,)]
NAMES = sorted(ALLREDUCE_ALGORITHMS)


@pytest.fixture(params=[1, 2, 3, 4, 5], ids=lambda k: f"{k}ctx")
def ctx5(request):
    return [mx.cpu(i) for i in range(request.param)]


def replicas(shape, ctx, seed, dtype=np.float32):
    rng = np.random.RandomState(seed)
    values = [rng.randn(*shape).astype(dtype) for _ in ctx]
    return values, [nd.array(v, ctx=c, dtype=dtype) for v, c in zip(values, ctx)]


def check_sum(arrays, values, ctx):
    want = np.sum(values, axis=0)
    for a, c in zip(arrays, ctx):
        assert a.context == c, f"{a.context} != {c}"
        np.testing.assert_allclose(a.asnumpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_algorithm_equals_numpy_sum(name, shape, ctx5):
    values, arrays = replicas(shape, ctx5, seed=len(ctx5) * 7 + len(shape))
    make_allreduce(name)(arrays)
    check_sum(arrays, values, ctx5)


@pytest.mark.parametrize("name", NAMES)
def test_repeated_calls_on_different_shapes_keep_working(name):
    """A stateful algorithm (kvstore) must keep shapes apart across calls, as a trainer makes them."""
    ctx = [mx.cpu(i) for i in range(3)]
    fn = make_allreduce(name)
    for step in range(2):
        for shape in [(20, 1, 3, 3), (20,), (20,), (800, 128)]:
            values, arrays = replicas(shape, ctx, seed=step + shape[0])
            fn(arrays)
            check_sum(arrays, values, ctx)


@pytest.mark.parametrize("name", NAMES)
def test_algorithms_agree_with_the_lessons_allreduce(name):
    ctx = [mx.cpu(i) for i in range(4)]
    values, ref = replicas((50, 20, 5, 5), ctx, seed=3)
    _, arrays = replicas((50, 20, 5, 5), ctx, seed=3)
    ALLREDUCE_ALGORITHMS["lesson"](ref)
    make_allreduce(name)(arrays)
    for a, r in zip(arrays, ref):
        np.testing.assert_allclose(a.asnumpy(), r.asnumpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["ring", "tree", "reduce_bcast", "scatter_gather"])
def test_float64_and_views_of_a_bigger_buffer(name):
    """The fused trainer reduces flat buffers whose slices are the gradients: views must work too."""
    ctx = [mx.cpu(i) for i in range(3)]
    values, arrays = replicas((30,), ctx, seed=1, dtype=np.float64)
    views = [a[5:17] for a in arrays]
    make_allreduce(name)(views)
    for a, v, c in zip(arrays, values, ctx):
        assert a.context == c and a.dtype == np.float64
        got = a.asnumpy()
        np.testing.assert_allclose(got[5:17], np.sum(values, axis=0)[5:17], rtol=1e-12)
        np.testing.assert_array_equal(got[:5], v[:5])
        np.testing.assert_array_equal(got[17:], v[17:])


@pytest.mark.parametrize("n,k", [(10, 3), (3, 3), (2, 5), (1, 1), (0, 2), (1001, 4)])
def test_chunk_bounds_cover_everything_evenly(n, k):
    b = chunk_bounds(n, k)
    assert b[0] == 0 and b[-1] == n and len(b) == k + 1
    sizes = np.diff(b)
    assert sizes.min() >= 0 and sizes.max() - sizes.min() <= 1


def test_unknown_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown allreduce 'bogus'.*ring"):
        make_allreduce("bogus")


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8])
def test_ring_schedule_moves_2_k_minus_1_over_k_of_the_data_per_link(k):
    from manual_dp.fast.collectives import ring_schedule
    steps = ring_schedule(k)
    assert len(steps) == 2 * (k - 1)
    links = {}
    for transfers in steps:
        assert sorted(src for src, _, _, _ in transfers) == list(range(k))  # every rank sends once
        for src, dst, c, _ in transfers:
            assert dst == (src + 1) % k
            links[src] = links.get(src, 0) + 1
    # each transfer is one of k chunks: 2(k-1) chunks = 2(k-1)/k of the array per link
    assert all(n == 2 * (k - 1) for n in links.values())


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_tree_schedule_has_log_rounds_and_reaches_everyone(k):
    from manual_dp.fast.collectives import tree_schedule
    rounds = tree_schedule(k)
    assert len(rounds) == 2 * int(np.ceil(np.log2(k)))
    holders = {0}
    for transfers in rounds[len(rounds) // 2:]:
        for src, dst, _, phase in transfers:
            assert phase == "copy" and src in holders
            holders.add(dst)
    assert holders == set(range(k))
