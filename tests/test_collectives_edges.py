"""All-reduce at the edges of what a legacy NDArray can be: every algorithm on 1..4 contexts
takes arrays without elements (nothing to add) and the smallest arrays there are, refuses
replicas of different shapes in one ValueError, and a kvstore all-reduce survives a failed call."""
import mxnet as mx
import numpy as np
import pytest
from mxnet import nd

from manual_dp import ALLREDUCE_ALGORITHMS, allreduce
from manual_dp.fast.collectives import KVStoreAllreduce, make_allreduce

NAMES = sorted(ALLREDUCE_ALGORITHMS)
# What a legacy NDArray can be: nd.array of a numpy scalar or of an empty numpy array, and
# nd.empty, make 0-d and empty arrays; nd.zeros(()) and nd.zeros((0,)) fail (0 means "unknown").
EMPTY = [(0,), (0, 3), (3, 0), (2, 0, 4)]
SMALLEST = [(), (1,), (1, 1)]


def replicas(shape, ctx, seed, make):
    """(numpy values, NDArrays made by `make` on ctx[i] holding them)."""
    rng = np.random.RandomState(seed)
    values = [np.asarray(rng.randn(*shape), dtype=np.float32) for _ in ctx]
    return values, [make(v, c) for v, c in zip(values, ctx)]


MAKERS = {
    "nd.array": lambda v, c: nd.array(v, ctx=c),
    "nd.empty+copy": lambda v, c: copied(nd.empty(v.shape, ctx=c), v),
}


def copied(a, v):
    """`a` holding `v` (nothing to copy without elements; a 0-d `a` through a flat view, as
    MXNet infers no shapes for 0-d operands)."""
    if v.size:
        nd.array(v.reshape(-1), ctx=a.context).copyto(a.reshape((-1,)))
    return a


@pytest.mark.parametrize("maker", sorted(MAKERS))
@pytest.mark.parametrize("shape", EMPTY + SMALLEST, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_every_algorithm_sums_edge_shapes_like_numpy(name, shape, maker, ctx):
    values, arrays = replicas(shape, ctx, seed=len(ctx), make=MAKERS[maker])
    assert [a.shape for a in arrays] == [shape] * len(ctx)
    make_allreduce(name)(arrays)
    want = np.sum(values, axis=0)
    for a, c in zip(arrays, ctx):
        assert a.context == c, f"{a.context} != {c}"
        assert a.shape == shape
        np.testing.assert_allclose(a.asnumpy(), want, rtol=1e-6, atol=1e-6)


def test_the_registrys_lesson_is_the_lessons_allreduce_for_any_shape():
    assert ALLREDUCE_ALGORITHMS["lesson"].__wrapped__ is allreduce


@pytest.mark.parametrize("name", NAMES)
def test_replicas_of_different_shapes_are_one_value_error(name):
    arrays = [nd.ones((2,), ctx=mx.cpu(0)), nd.ones((3,), ctx=mx.cpu(1))]
    with pytest.raises(ValueError, match=r"^all-reduce of replicas of different shapes: \(2,\), \(3,\)$"):
        make_allreduce(name)(arrays)
    empty_first = [nd.empty((0,), ctx=mx.cpu(0)), nd.ones((3,), ctx=mx.cpu(1))]
    with pytest.raises(ValueError, match="different shapes"):
        make_allreduce(name)(empty_first)  # not taken for "nothing to add"


@pytest.mark.parametrize("name", NAMES)
def test_no_replicas_is_nothing_to_do(name):
    make_allreduce(name)([])


class FlakyInit:
    """A kvstore whose first init fails (as MXNet's did for shapes it cannot infer)."""

    def __init__(self, store):
        self.store, self.failed = store, False

    def init(self, key, value):
        if not self.failed:
            self.failed = True
            raise mx.base.MXNetError("init failed on purpose")
        self.store.init(key, value)

    def pushpull(self, key, value, out):
        self.store.pushpull(key, value, out=out)


def test_a_kvstore_allreduce_reused_after_a_failed_init_works():
    ctx = [mx.cpu(i) for i in range(2)]
    reduce = KVStoreAllreduce()
    reduce.store = FlakyInit(mx.kv.create("device"))
    values, arrays = replicas((5,), ctx, seed=1, make=MAKERS["nd.array"])
    with pytest.raises(mx.base.MXNetError, match="on purpose"):
        reduce(arrays)
    assert reduce.keys == {}   # the failed key is not kept
    reduce(arrays)             # the key is initialised now, not taken as initialised
    for a in arrays:
        np.testing.assert_allclose(a.asnumpy(), np.sum(values, axis=0), rtol=1e-6)
