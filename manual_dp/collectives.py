"""All-reduce algorithms, all with the lesson's contract: a list of replicas of one array, one per
context; afterwards every replica holds the elementwise sum of all of them, on its own context.

    lesson          manual_dp.parallel.allreduce: add each replica into the first, copy back (reference)
    reduce_bcast    the same picture, with one add_n on the first context instead of k-1 adds
    ring            reduce-scatter then all-gather over k chunks: each link carries 2(k-1)/k of the data
    tree            pairwise sums up a binary tree in log2(k) rounds, then copies back down it
    kvstore         MXNet's own kvstore('device') pushpull, as the reference to beat

Copies between contexts are engine operations like any other, so the transfers of one round run
at the same time on different devices; the Python loop only describes who sends what to whom.
"""
import mxnet as mx
from mxnet import nd

from .parallel import allreduce as lesson_allreduce


def chunk_bounds(n, k):
    """k+1 offsets cutting n items into k contiguous chunks that differ by at most one (some may be empty)."""
    return [i * (n // k) + min(i, n % k) for i in range(k + 1)]


def reduce_bcast(arrays):
    """Afterwards every `arrays[i]` holds the sum: gathered and added in one add_n on the first context."""
    home = arrays[0].context
    if len(arrays) > 1:
        nd.add_n(*[a if a.context == home else a.copyto(home) for a in arrays], out=arrays[0])
    for a in arrays[1:]:
        arrays[0].copyto(a)


def ring_allreduce(arrays):
    """Afterwards every `arrays[i]` holds the sum, passed around the ring 0 -> 1 -> ... -> k-1 -> 0.

    Reduce-scatter: in step s rank i sends chunk (i - s) mod k to rank i+1, which adds it to its own;
    after k-1 steps rank i holds the full sum of chunk (i + 1) mod k. All-gather: in step s rank i
    passes chunk (i + 1 - s) mod k on, and rank i+1 overwrites its copy with it.
    """
    k = len(arrays)
    flat = [a.reshape((-1,)) for a in arrays]  # views: writing them writes the arrays
    bounds = chunk_bounds(flat[0].size, k)

    def chunk(rank, c):
        return flat[rank][bounds[c]:bounds[c + 1]] if bounds[c + 1] > bounds[c] else None

    for s in range(k - 1):
        for i in range(k):
            src, dst = chunk(i, (i - s) % k), chunk((i + 1) % k, (i - s) % k)
            if src is not None:
                nd.elemwise_add(dst, src.copyto(dst.context), out=dst)
    for s in range(k - 1):
        for i in range(k):
            src, dst = chunk(i, (i + 1 - s) % k), chunk((i + 1) % k, (i + 1 - s) % k)
            if src is not None:
                src.copyto(dst)


def tree_allreduce(arrays):
    """Afterwards every `arrays[i]` holds the sum: rank i adds rank i+step (step 1, 2, 4, ...) up a
    binary tree into rank 0, then the total goes back down the same tree."""
    k, step = len(arrays), 1
    while step < k:
        for i in range(0, k - step, 2 * step):
            nd.elemwise_add(arrays[i], arrays[i + step].copyto(arrays[i].context), out=arrays[i])
        step *= 2
    while step > 1:
        step //= 2
        for i in range(0, k - step, 2 * step):
            arrays[i].copyto(arrays[i + step])


class KVStoreAllreduce:
    """MXNet's kvstore(kind) as an all-reduce: pushpull sums the replicas and hands every one the sum.

    Holds its store and one key per (shape, dtype, contexts), created on first use.
    """

    def __init__(self, kind="device"):
        self.kind, self.store, self.keys = kind, None, {}

    def __call__(self, arrays):
        if self.store is None:
            self.store = mx.kv.create(self.kind)
        sig = (arrays[0].shape, str(arrays[0].dtype), tuple(str(a.context) for a in arrays))
        if sig not in self.keys:
            self.keys[sig] = len(self.keys)
            self.store.init(self.keys[sig], nd.zeros(arrays[0].shape, arrays[0].context, arrays[0].dtype))
        self.store.pushpull(self.keys[sig], arrays, out=arrays)


def kvstore_allreduce(arrays):
    """Afterwards every `arrays[i]` holds the sum, via a fresh kvstore('device') (use make_allreduce
    ("kvstore") to keep one store across calls, as a trainer does)."""
    KVStoreAllreduce()(arrays)


ALLREDUCE_ALGORITHMS = {
    "lesson": lesson_allreduce,
    "reduce_bcast": reduce_bcast,
    "ring": ring_allreduce,
    "tree": tree_allreduce,
    "kvstore": kvstore_allreduce,
}


def make_allreduce(name):
    """The all-reduce called `name`, ready for repeated use (kvstore gets a store of its own)."""
    if name not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"unknown allreduce {name!r}; choose from {', '.join(ALLREDUCE_ALGORITHMS)}")
    return KVStoreAllreduce() if name == "kvstore" else ALLREDUCE_ALGORITHMS[name]
