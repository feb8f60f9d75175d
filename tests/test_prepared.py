"""make_allreduce("prepared"): reduce_bcast's engine calls built once per list of replicas and
replayed (manual_dp/fast/prepared.py). Its sums are reduce_bcast's bit for bit (the same engine
calls on the same arrays), and a plan follows the replicas' memory, not their wrappers."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, nd

from manual_dp.fast import prepared
from manual_dp.fast.collectives import make_allreduce, reduce_bcast
from manual_dp.lesson import cross_entropy, get_params, init_lenet_params, lenet, split_and_load


def grads_after_backward(ctx, seed):
    """Each context's LeNet parameters with gradients of its own half of one random batch."""
    rng = np.random.RandomState(seed)
    X, y = nd.array(rng.rand(8 * len(ctx), 1, 28, 28)), nd.array(rng.randint(0, 10, 8 * len(ctx)))
    params = [get_params(init_lenet_params(0), c) for c in ctx]
    with autograd.record():
        losses = [cross_entropy(lenet(Xs, P), ys).sum()
                  for Xs, ys, P in zip(split_and_load(X, ctx), split_and_load(y, ctx), params)]
    autograd.backward(losses)
    return params


@pytest.mark.parametrize("k", [2, 3, 4])
def test_the_lessons_call_path_gives_reduce_bcasts_bits_and_keeps_one_plan_per_gradient(k):
    """One call per gradient with fresh `.grad` wrappers on every step, as the lesson's train_batch
    makes them: 8 plans after the first step, none added by the next two, and every step's sums
    equal to reduce_bcast's on a copy of the same gradients, bit for bit, on their own contexts."""
    ctx = [mx.cpu(i) for i in range(k)]
    fn = make_allreduce("prepared")
    for step in range(3):
        params = grads_after_backward(ctx, seed=step) if step == 0 else params
        if step:                                      # new gradient values in the same arrays
            for P in params:
                for p in P:
                    p.grad[:] = nd.array(np.random.RandomState(step).randn(*p.shape), ctx=p.context)
        copies = [[p.grad.copy() for p in P] for P in params]
        for i in range(8):
            fn([P[i].grad for P in params])
            reduce_bcast([c[i] for c in copies])
        assert len(fn.plans) == 8
        for P, C, c in zip(params, copies, ctx):
            for p, want in zip(P, C):
                assert p.grad.context == c and want.context == c
                np.testing.assert_array_equal(p.grad.asnumpy(), want.asnumpy())


def test_plans_are_bounded_and_a_replayed_plan_reads_the_current_values(monkeypatch):
    monkeypatch.setattr(prepared, "MAX_PLANS", 2)
    ctx = [mx.cpu(0), mx.cpu(1)]
    fn = make_allreduce("prepared")
    lists = [[nd.full((5,), i + j, ctx=c) for j, c in enumerate(ctx)] for i in range(3)]
    for arrays in lists:
        fn(arrays)
    assert len(fn.plans) == 2
    for a in lists[2]:
        a[:] = 10
    fn(lists[2])                                      # its plan, replayed: 10 + 10
    for a, c in zip(lists[2], ctx):
        assert a.context == c
        np.testing.assert_array_equal(a.asnumpy(), np.full(5, 20.0))


def test_replicas_of_different_shapes_are_refused_and_empty_or_scalar_ones_work():
    fn = make_allreduce("prepared")
    with pytest.raises(ValueError, match="different shapes"):
        fn([nd.zeros((3,), ctx=mx.cpu(0)), nd.zeros((4,), ctx=mx.cpu(1))])
    fn([nd.empty((0,), ctx=mx.cpu(0)), nd.empty((0,), ctx=mx.cpu(1))])
    scalars = [nd.array(np.float32(2.5), ctx=mx.cpu(i)).reshape(()) for i in range(3)]
    fn(scalars)
    assert [float(s.asscalar()) for s in scalars] == [7.5] * 3


def test_a_plan_makes_reduce_bcasts_engine_calls():
    """k contexts of one memory: one add_n reading every replica in place, k - 1 copies back."""
    arrays = [nd.ones((4,), ctx=mx.cpu(i)) for i in range(3)]
    calls = prepared.plan(arrays)
    assert [c.arrays[0][0] is arrays[0] for c in calls] == [True] * 3
    assert len(calls) == 3 and calls[0].n_in.value == 3 and calls[0].arrays[1] == [arrays[0]]
    assert [c.arrays[1][0] for c in calls[1:]] == arrays[1:]
