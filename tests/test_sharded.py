"""Reduce-scatter and all-gather (manual_dp.fast.sharded) against numpy, on 1..8 contexts and awkward
sizes; every output's context asserted (MXNet mixes CPU contexts silently)."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import nd

from manual_dp.fast.collectives import chunk_bounds
from manual_dp.fast.sharded import (ALL_GATHER, REDUCE_SCATTER, empty_shards, ring_all_gather_schedule,
                                    ring_reduce_scatter_schedule)

# Not divisible by k, 1 element, fewer elements than contexts, 0-d, LeNet's flat size.
SHAPES = [(), (1,), (2,), (7,), (3, 5), (20, 1, 3, 3), (1001,), (129068,)]
KS = [1, 2, 3, 4, 5, 8]


def inputs(shape, k, seed):
    rng = np.random.RandomState(seed)
    values = [np.asarray(rng.randn(*shape), dtype=np.float32) for _ in range(k)]
    ctx = [mx.cpu(i) for i in range(k)]
    return ctx, values, [nd.array(v, ctx=c) if shape else nd.array(v.reshape(1), ctx=c).reshape(())
                         for v, c in zip(values, ctx)]


def check_shards(shards, want_flat, bounds, ctx):
    for i, (s, c) in enumerate(zip(shards, ctx)):
        a, b = bounds[i], bounds[i + 1]
        if b == a:
            assert s is None
            continue
        assert s.context == c and s.shape == (b - a,)
        np.testing.assert_allclose(s.asnumpy(), want_flat[a:b], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(REDUCE_SCATTER))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("k", KS)
def test_reduce_scatter_into_shards_equals_numpy(name, shape, k):
    ctx, values, arrays = inputs(shape, k, seed=k + len(shape))
    n = int(np.prod(shape))
    bounds = chunk_bounds(n, k)
    shards = empty_shards(n, ctx)
    REDUCE_SCATTER[name](arrays, shards)
    check_shards(shards, np.sum(values, axis=0).reshape(-1), bounds, ctx)
    for a, v, c in zip(arrays, values, ctx):              # the inputs are only read
        assert a.context == c
        np.testing.assert_array_equal(a.asnumpy().reshape(-1), v.reshape(-1))


@pytest.mark.parametrize("name", sorted(REDUCE_SCATTER))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("k", KS)
def test_reduce_scatter_in_place_leaves_chunk_i_in_array_i(name, shape, k):
    ctx, values, arrays = inputs(shape, k, seed=3 * k + len(shape))
    bounds = chunk_bounds(int(np.prod(shape)), k)
    REDUCE_SCATTER[name](arrays)
    want = np.sum(values, axis=0).reshape(-1)
    for i, (a, c) in enumerate(zip(arrays, ctx)):
        assert a.context == c and a.shape == shape
        np.testing.assert_allclose(a.asnumpy().reshape(-1)[bounds[i]:bounds[i + 1]],
                                   want[bounds[i]:bounds[i + 1]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(ALL_GATHER))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("k", KS)
def test_all_gather_from_shards_equals_numpy(name, shape, k):
    ctx, values, _ = inputs(shape, k, seed=5 * k)
    n = int(np.prod(shape))
    bounds = chunk_bounds(n, k)
    full = values[0].reshape(-1)
    shards = [nd.array(full[a:b], ctx=c) if b > a else None for a, b, c in zip(bounds, bounds[1:], ctx)]
    outs = [nd.full(shape or (1,), -7.0, ctx=c) for c in ctx]
    ALL_GATHER[name](outs, shards)
    for o, c in zip(outs, ctx):
        assert o.context == c
        np.testing.assert_array_equal(o.asnumpy().reshape(-1), full)
    for s, c, a, b in zip(shards, ctx, bounds, bounds[1:]):   # the shards are only read
        assert s is None or (s.context == c and np.array_equal(s.asnumpy(), full[a:b]))


@pytest.mark.parametrize("name", sorted(ALL_GATHER))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("k", KS)
def test_all_gather_in_place(name, shape, k):
    ctx, values, outs = inputs(shape, k, seed=7 * k)
    bounds = chunk_bounds(int(np.prod(shape)), k)
    want = np.concatenate([v.reshape(-1)[a:b] for v, a, b in zip(values, bounds, bounds[1:])])
    ALL_GATHER[name](outs)
    for o, c in zip(outs, ctx):
        assert o.context == c
        np.testing.assert_array_equal(o.asnumpy().reshape(-1), want)


@pytest.mark.parametrize("rs,ag", [("naive", "ring"), ("ring", "ring"), ("ring", "naive")])
@pytest.mark.parametrize("k", KS)
def test_reduce_scatter_then_all_gather_is_an_all_reduce(rs, ag, k):
    ctx, values, arrays = inputs((1001,), k, seed=k)
    REDUCE_SCATTER[rs](arrays)
    ALL_GATHER[ag](arrays)
    for a, c in zip(arrays, ctx):
        assert a.context == c
        np.testing.assert_allclose(a.asnumpy(), np.sum(values, axis=0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(REDUCE_SCATTER))
def test_uneven_bounds_and_views_of_a_bigger_buffer(name):
    """ZeRO reduces one layer's gradient into the parts of the shards it overlaps: any ordered
    bounds, empty chunks among them, inputs that are views."""
    ctx = [mx.cpu(i) for i in range(4)]
    rng = np.random.RandomState(0)
    values = [rng.randn(30).astype(np.float32) for _ in ctx]
    bigs = [nd.array(v, ctx=c) for v, c in zip(values, ctx)]
    views = [b[5:17] for b in bigs]                       # 12 elements
    bounds = [0, 0, 9, 9, 12]
    shards = empty_shards(12, ctx, bounds=bounds)
    REDUCE_SCATTER[name](views, shards, bounds)
    check_shards(shards, np.sum(values, axis=0)[5:17], bounds, ctx)
    outs = [nd.zeros((12,), ctx=c) for c in ctx]
    ALL_GATHER[name](outs, shards, bounds)
    for o, c in zip(outs, ctx):
        assert o.context == c
        np.testing.assert_allclose(o.asnumpy(), np.sum(values, axis=0)[5:17], rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_one_clear_error():
    ctx = [mx.cpu(i) for i in range(2)]
    a = [nd.zeros((5,), ctx=c) for c in ctx]
    with pytest.raises(ValueError, match="shards of sizes"):
        REDUCE_SCATTER["ring"](a, [nd.zeros((2,)), nd.zeros((2,))])
    with pytest.raises(ValueError, match="do not cut"):
        ALL_GATHER["naive"](a, None, [0, 6, 5])
    with pytest.raises(ValueError, match="different sizes"):
        ALL_GATHER["ring"]([a[0], nd.zeros((4,))])


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_ring_schedules_end_with_chunk_i_on_rank_i(k):
    """Follow the schedules symbolically: after the reduce-scatter, rank i's running sum of chunk
    i has every rank's contribution; after the all-gather every rank holds every chunk."""
    partial = {(r, c): {r} for r in range(k) for c in range(k)}
    for transfers in ring_reduce_scatter_schedule(k):
        sent = {(src, dst, c): set(partial[(src, c)]) for src, dst, c in transfers}
        for (src, dst, c), got in sent.items():
            partial[(dst, c)] |= got
    assert all(partial[(i, i)] == set(range(k)) for i in range(k))
    held = {r: {r} for r in range(k)}
    for transfers in ring_all_gather_schedule(k):
        moved = [(dst, c) for src, dst, c in transfers if c in held[src]]
        assert len(moved) == len(transfers)                # a rank passes on only what it has
        for dst, c in moved:
            held[dst].add(c)
    assert all(held[r] == set(range(k)) for r in range(k))
