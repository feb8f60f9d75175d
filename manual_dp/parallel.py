"""The lesson's data-parallel primitives: copy params, split the batch, sum gradients."""
import mxnet as mx
import numpy as np
from mxnet import nd


def get_params(params, ctx):
    """Copies of `params` on `ctx`, each with a gradient buffer attached."""
    new_params = [p.copyto(ctx) for p in params]
    for p in new_params:
        p.attach_grad()
    return new_params


def shard_sizes(n, k):
    """Sizes of k contiguous shards of n items that differ by at most one."""
    if k < 1:
        raise ValueError(f"need at least one device, got {k}")
    if n < k:
        raise ValueError(f"a batch of {n} cannot be split over {k} devices: "
                         f"use a batch of at least {k}")
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def split_and_load(data, ctx):
    """Shard `data` (NDArray or numpy) along axis 0 into len(ctx) pieces, piece i on ctx[i]."""
    sizes = shard_sizes(data.shape[0], len(ctx))
    shards, start = [], 0
    for size, c in zip(sizes, ctx):
        piece = data[start:start + size]
        shards.append(nd.array(piece, ctx=c, dtype=piece.dtype) if isinstance(piece, np.ndarray)
                      else piece.as_in_context(c))
        start += size
    return shards


def allreduce(data):
    """Afterwards every `data[i]` holds the elementwise sum of all of them, on its own context
    (MXNet's shape inference refuses arrays without elements, which hold nothing to add, and
    0-d ones, which are summed as 1-element views)."""
    if any(d.shape != data[0].shape for d in data):
        raise ValueError(f"all-reduce of replicas of different shapes: {', '.join(str(d.shape) for d in data)}")
    if not data or data[0].size == 0:
        return
    if data[0].ndim == 0:
        data = [d.reshape((1,)) for d in data]
    for i in range(1, len(data)):
        data[0][:] += data[i].copyto(data[0].context)
    for i in range(1, len(data)):
        data[0].copyto(data[i])


def try_gpus(n):
    """[gpu(0), ..., gpu(n-1)], or a clear error if fewer than n GPUs are visible."""
    found = mx.context.num_gpus()
    if n < 1 or n > found:
        raise ValueError(f"asked for {n} GPU(s) but found {found}; "
                         f"use --cpus N to train on CPU contexts instead")
    return [mx.gpu(i) for i in range(n)]


def cpus(n):
    """[cpu(0), ..., cpu(n-1)]: n CPU contexts that share the machine's cores."""
    if n < 1:
        raise ValueError(f"--cpus must be at least 1, got {n}")
    return [mx.cpu(i) for i in range(n)]
