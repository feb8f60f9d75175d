"""The conjugate operators of Megatron-LM's tensor parallelism, written by hand across contexts.

A tensor group is T contexts that each hold one shard of every split layer. Two operators join the
shards, each the other's transpose (Shoeybi et al. 2019, "f" and "g"), and the sum both ways:

    f   forward: identity (every context already holds the same input)
        backward: all-reduce (each context's shard saw only its part of the gradient)
    g   forward: all-reduce (each context computed a partial sum of the layer's output)
        backward: identity (every context already holds the whole gradient of the output)

    sum_everywhere   forward: all-reduce, backward: all-reduce (--sync-batchnorm's statistics)

A column-parallel layer (output units split) is entered through f; a row-parallel layer (input
units split) is left through g. Each is one mx.autograd.Function (Joined) over all T contexts of a group:
its forward takes the T arrays (one per context) and returns T arrays on the same contexts; MXNet's
autograd records it as one node whose inputs and outputs live on different contexts and calls its
backward with the T output gradients, each on its own context (tests/test_tensor.py checks it).

`allreduce` is any algorithm of manual_dp.fast.collectives (the lesson's contract: afterwards every
array of the list holds the sum). Its work runs on copies, so no recorded array is overwritten.
"""
import numpy as np
from mxnet import autograd, nd

from .mesh_ops import all_gather, even_sizes, reduce_scatter


def summed(arrays, allreduce):
    """Fresh copies of `arrays` (one per context), each afterwards holding the elementwise sum."""
    out = [a.copy() for a in arrays]
    allreduce(out)
    return out


class Joined(autograd.Function):
    """One autograd node over a tensor group's arrays: forward and backward each either the identity
    (copies) or the all-reduce (fresh sums on every context); `back`: the backward's all-reduce
    (default `allreduce`)."""

    def __init__(self, allreduce, sum_forward, sum_backward, back=None):
        super().__init__()
        self.allreduce, self.sum_forward, self.sum_backward = allreduce, sum_forward, sum_backward
        self.back = back or allreduce

    def forward(self, *xs):
        return tuple(summed(xs, self.allreduce) if self.sum_forward else (x.copy() for x in xs))

    def backward(self, *dys):
        return tuple(summed(dys, self.back) if self.sum_backward else (dy.copy() for dy in dys))


def keyed(allreduce, key, like=None):
    """`allreduce` under the name `key` where it sums across processes (the engine sums by name: a
    multiprocess.distributed.CrossProcessAllreduce has named(key, like), which readies the name for
    arrays like `like` now); an in-process one as it is."""
    named = getattr(allreduce, "named", None)
    return named(key, like) if named else allreduce


def sum_everywhere(xs, allreduce, key="sum"):
    """Every context's output holds the sum of `xs`; in backward, each x's gradient is the sum of
    every output's gradient (each output depends on every input): --sync-batchnorm's statistics.
    One context too: `allreduce` may sum across processes, then under names of its own for the
    forward and the backward (key + "f", key + "b": a sum inside a backward must not wait on one
    of the same name, see CrossProcessAllreduce)."""
    out = Joined(keyed(allreduce, key + "f"), True, True, keyed(allreduce, key + "b", xs[0]))(*xs)
    return [out] if isinstance(out, nd.NDArray) else list(out)


def f(xs, allreduce):
    """The same values as `xs` (one array per context of a tensor group); in backward, each x's
    gradient is the sum of the gradients of every context's output."""
    return list(Joined(allreduce, False, True)(*xs)) if len(xs) > 1 else list(xs)


def g(xs, allreduce):
    """Every context's output holds the sum of `xs` (partial results, one per context); in
    backward, each x's gradient is its own output's gradient."""
    return list(Joined(allreduce, True, False)(*xs)) if len(xs) > 1 else list(xs)


class Join:
    """Megatron's f and g over one tensor group's contexts, with `allreduce` (fast.tensor_ops);
    shard and unshard (entering and leaving a run of split layers) do nothing.

    A model's split layers see the group as pieces, each context holding k of them (here k = 1:
    a piece a context; --deterministic's PieceJoin, strategies/tensor/tensor_pieces.py, holds several):
    f takes one array per context to one per piece, g one per piece to one per context, `spread`
    hands a context's array to each of its pieces (no gradient: the images), `leads` picks each
    context's first piece (whose replicated parameters the context's unsplit layers use)."""
    k = 1

    def __init__(self, allreduce):
        self.allreduce = allreduce

    def spread(self, xs):
        return list(xs)

    def leads(self, per_piece):
        return list(per_piece)

    def f(self, xs):
        return f(xs, self.allreduce)

    def g(self, xs):
        return g(xs, self.allreduce)

    def shard(self, hs):
        return hs

    def unshard(self, hs):
        return hs

    def starts(self, n):
        """The first token each of the n contexts holds between shard and unshard: all of them."""
        return [0] * n

    def for_row(self, c):
        """The join of row c of a grid (Model.grid_forward): this one, for every row."""
        return self


class SequenceJoin(Join):
    """Megatron-SP (Korthikanti et al. 2022): between the split layers every context keeps only its
    block of tokens (axis 1), so the layer norms, residual adds and biases there run on 1/T of
    them. f becomes an all-gather of the blocks (backward: reduce-scatter), g a reduce-scatter of
    the partial sums (backward: all-gather): the same bytes as f's and g's all-reduces, which
    are a reduce-scatter and an all-gather each. shard cuts the sequence where the split layers
    begin, unshard gathers it where they end."""

    def __init__(self, allreduce, n_tokens, T):
        super().__init__(allreduce)
        self.sizes = even_sizes(n_tokens, T)

    def f(self, xs):
        return all_gather(xs, axis=1)

    def g(self, xs):
        return reduce_scatter(xs, axis=1, sizes=self.sizes)

    def shard(self, hs):
        ends = np.cumsum([0] + self.sizes)
        return [nd.slice_axis(h, axis=1, begin=int(a), end=int(b)) for h, a, b in zip(hs, ends, ends[1:])]

    def unshard(self, hs):
        return all_gather(hs, axis=1)

    def starts(self, n):
        return [int(a) for a in np.cumsum([0] + self.sizes)[:n]]
