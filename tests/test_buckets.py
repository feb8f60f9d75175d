"""Gradient buckets (manual_dp.fast.buckets): the bucketed step equals the one-buffer sync step
for every all-reduce algorithm and bucket size, and every bucket is an array of its own.

Tolerance: the forward, backward and update are the same ops on the same numbers; only the
all-reduce of a bucket may add an element's k terms in another order than the one-buffer step
(the ring and scatter_gather cut each buffer into k chunks, so where an element falls decides
its order), so parameters agree to float32 rounding: rtol 1e-5, atol 1e-6.
"""
import numpy as np
import pytest
from mxnet import nd

from conftest import batch, cpus
from manual_dp import ALLREDUCE_ALGORITHMS, DataParallel, init_lenet_params, make_allreduce
from manual_dp.fast.buckets import MB, plan_buckets
from manual_dp.lesson import LENET_SHAPES

LENET_BYTES = [4 * int(np.prod(s)) for _, s in LENET_SHAPES]


def test_plan_buckets_in_reverse_order_closing_at_the_size():
    assert plan_buckets(LENET_BYTES, 0) == [[i] for i in range(7, -1, -1)]
    assert plan_buckets(LENET_BYTES, 10 ** 12) == [list(range(7, -1, -1))]
    # 0.1 MB: W4+b4 (5 KB) are not enough, W3 (400 KB) closes the first bucket; the rest is one
    assert plan_buckets(LENET_BYTES, 0.1 * MB) == [[7, 6, 5, 4], [3, 2, 1, 0]]
    assert plan_buckets(LENET_BYTES, 0.001 * MB) == [[7, 6], [5, 4], [3, 2], [1, 0]]
    assert plan_buckets([4, 4, 4], 8) == [[2, 1], [0]]          # the last bucket may be smaller
    with pytest.raises(ValueError):
        plan_buckets(LENET_BYTES, -1)


@pytest.mark.parametrize("bucket_mb", [0, 0.001, 0.1, 1e6])
@pytest.mark.parametrize("algorithm", sorted(ALLREDUCE_ALGORITHMS))
def test_bucketed_step_equals_the_sync_step(algorithm, bucket_mb):
    ctx = cpus(3)
    ref = DataParallel(init_lenet_params(seed=5), ctx, "momentum", make_allreduce(algorithm), graph=False)
    model = DataParallel(init_lenet_params(seed=5), ctx, "momentum", make_allreduce(algorithm),
                         graph=False, bucket_mb=bucket_mb)
    for step in range(2):
        X, y = batch(13, seed=step)
        got, want = model.step(X, y, 0.05), ref.step(X, y, 0.05)
        assert [c.asscalar() for _, c in got] == [c.asscalar() for _, c in want]
    for W, W_ref in zip(model.replicas, ref.replicas):
        for p, q in zip(W, W_ref):
            np.testing.assert_allclose(p.asnumpy(), q.asnumpy(), rtol=1e-5, atol=1e-6)
    for S, S_ref in zip(model.states, ref.states):
        for s, r in zip(sum(S, []), sum(S_ref, [])):
            np.testing.assert_allclose(s.asnumpy(), r.asnumpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bucket_mb", [0, 0.001, 1e6])
def test_bucketed_step_with_the_cached_graph_equals_the_sync_step(bucket_mb):
    ctx = cpus(2)
    ref = DataParallel(init_lenet_params(seed=6), ctx, "adam", conv_pad=1)
    model = DataParallel(init_lenet_params(seed=6), ctx, "adam", conv_pad=1, bucket_mb=bucket_mb)
    for step in range(3):
        model.step(*batch(12, seed=step), 0.01), ref.step(*batch(12, seed=step), 0.01)
    for p, q in zip(model.state_dict()["params"], ref.state_dict()["params"]):
        np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-6)


def test_each_bucket_is_an_array_of_its_own_on_its_context():
    ctx = cpus(3)
    model = DataParallel(init_lenet_params(seed=0), ctx, "momentum", graph=False, bucket_mb=0.001)
    buckets = model.buckets
    assert buckets.plan == [[7, 6], [5, 4], [3, 2], [1, 0]]
    for c, replica in zip(ctx, buckets.replicas):
        arrays = [a for g in replica.groups for a in (g.flat, g.grad)]
        assert all(a.context == c for a in arrays)
        assert all(p.context == c and p.grad.context == c for p in replica.params)
        assert len({a.handle.value for a in arrays}) == len(arrays)
    # a bucket's gradient is written by backward through its parameters' views, and only it
    model.backward(*batch(9, seed=1))
    grads = [g.grad.asnumpy() for g in buckets.replicas[1].groups]
    assert all(np.abs(g).sum() > 0 for g in grads)
    p0 = buckets.replicas[1].params[7]                      # b4, first in bucket 0
    np.testing.assert_array_equal(p0.grad.asnumpy(), grads[0][:10])
    buckets.replicas[1].groups[0].grad[:] = 0
    assert np.abs(p0.grad.asnumpy()).sum() == 0
    assert np.abs(buckets.replicas[1].groups[1].grad.asnumpy()).sum() > 0
    nd.waitall()
