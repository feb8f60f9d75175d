"""The collectives of a device mesh beyond the all-reduce, written by hand across contexts: one array
per context of a group in, one array per context out, each on its own context.

    all_gather      out[j] = concat(x_0, ..., x_{k-1}) along `axis`       (pieces may differ in size)
    reduce_scatter  out[j] = piece j of (x_0 + ... + x_{k-1}) along `axis`, cut by `sizes`
    all_to_all      out[j] = concat(piece j of x_0, ..., piece j of x_{k-1}): x_i cut along
                    `split`, the pieces joined along `join` (Ulysses: sequence shards <-> head shards)
    ring_shift      out[j] = x_{j-1}: every context sends its array to the next one round a ring
                    (ring attention's key and value blocks)
    group_allreduce the all-reduce of every group of a mesh dimension, each on its own

Each of the first four is differentiable: one mx.autograd.Function over the group (as Megatron's f
and g in tensor_ops), whose backward is the collective's transpose: all-gather's is the
reduce-scatter of the gradients and the other way round, all-to-all's is the all-to-all back, a
ring shift's is the shift the other way. tests/test_mesh.py checks each against numpy.

Each takes a `wire` (default collectives.DIRECT): an EmulatedLink (manual_dp.fast.link) delays every
piece that crosses between contexts, forward and backward, shipped in k-1 rounds in which context i
sends to i + r, so that no port is used twice in a round (tests/test_link.py). The strategies do
not pass one yet: under --link the activations' collectives of tensor, context and mesh modes are
not delayed.
"""
from mxnet import autograd, nd

from .collectives import DIRECT, chunk_bounds


def cut(x, axis, sizes):
    """x cut along `axis` into consecutive pieces of `sizes` (which add up to x.shape[axis])."""
    ends = [0]
    for s in sizes:
        ends.append(ends[-1] + s)
    return [nd.slice_axis(x, axis=axis, begin=a, end=b) for a, b in zip(ends, ends[1:])]


def even_sizes(n, k):
    """k sizes adding up to n, differing by at most one (the larger first): how a mesh cuts n items."""
    bounds = chunk_bounds(n, k)
    return [b - a for a, b in zip(bounds, bounds[1:])]


def join(pieces, axis, ctx):
    """The pieces copied to `ctx` and concatenated along `axis` (a fresh array)."""
    here = [p.as_in_context(ctx) for p in pieces]
    return nd.concat(*here, dim=axis) if len(here) > 1 else here[0].copy()


def shipped(piece, xs, wire):
    """moved[i][j]: piece(i, j) (context i's piece for context j) shipped over `wire` to j's context,
    in rounds r = 1..k-1 of sends i -> i + r (each port once a round); moved[j][j] stays."""
    k = len(xs)
    moved = [[piece(i, i) if j == i else None for j in range(k)] for i in range(k)]
    for r in range(1, k):
        for i in range(k):
            j = (i + r) % k
            moved[i][j] = wire.ship(piece(i, j), xs[j].context)
    return moved


def gather(xs, axis, wire=DIRECT):
    moved = shipped(lambda i, j: xs[i], xs, wire)
    return [join([moved[i][j] for i in range(len(xs))], axis, x.context) for j, x in enumerate(xs)]


def scatter_sum(xs, axis, sizes, wire=DIRECT):
    pieces = [cut(x, axis, sizes) for x in xs]                  # pieces[i][j]: context i's piece j
    moved = shipped(lambda i, j: pieces[i][j], xs, wire)
    return [nd.add_n(*[moved[i][j].as_in_context(x.context) for i in range(len(xs))])
            for j, x in enumerate(xs)]


def exchange(xs, split, join_axis, sizes, wire=DIRECT):
    pieces = [cut(x, split, sizes) for x in xs]
    moved = shipped(lambda i, j: pieces[i][j], xs, wire)
    return [join([moved[i][j] for i in range(len(xs))], join_axis, x.context) for j, x in enumerate(xs)]


def shifted(xs, step, wire=DIRECT):
    k = len(xs)
    return [wire.ship(xs[(j - step) % k], xs[j].context).copyto(xs[j].context) for j in range(k)]


class Collective(autograd.Function):
    """One autograd node over a group's arrays: `forward_fn(xs)` and its transpose `backward_fn(dys)`."""

    def __init__(self, forward_fn, backward_fn):
        super().__init__()
        self.forward_fn, self.backward_fn = forward_fn, backward_fn

    def forward(self, *xs):
        return tuple(self.forward_fn(list(xs)))

    def backward(self, *dys):
        return tuple(self.backward_fn(list(dys)))


def apply(forward_fn, backward_fn, xs):
    out = Collective(forward_fn, backward_fn)(*xs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def all_gather(xs, axis, wire=DIRECT):
    """Every context's output is every x joined along `axis`, in order; backward: the reduce-scatter."""
    sizes = [x.shape[axis] for x in xs]
    return apply(lambda a: gather(a, axis, wire), lambda d: scatter_sum(d, axis, sizes, wire), xs)


def reduce_scatter(xs, axis, sizes=None, wire=DIRECT):
    """Context j's output is piece j (of `sizes`, default even) of the sum of every x along `axis`;
    backward: the all-gather."""
    sizes = sizes or even_sizes(xs[0].shape[axis], len(xs))
    return apply(lambda a: scatter_sum(a, axis, sizes, wire), lambda d: gather(d, axis, wire), xs)


def all_to_all(xs, split, join_axis, sizes=None, wire=DIRECT):
    """Context j's output joins (along `join_axis`) piece j of every x, x cut along `split` into
    `sizes` (default even); backward: the all-to-all back, each gradient cut along `join_axis` by
    the sizes the inputs had there."""
    sizes = sizes or even_sizes(xs[0].shape[split], len(xs))
    back = [x.shape[join_axis] for x in xs]
    return apply(lambda a: exchange(a, split, join_axis, sizes, wire),
                 lambda d: exchange(d, join_axis, split, back, wire), xs)


def ring_shift(xs, step=1, wire=DIRECT):
    """Context j's output is a copy of x_{j - step} (indices round the ring); backward: the shift back."""
    return apply(lambda a: shifted(a, step, wire), lambda d: shifted(d, -step, wire), xs)


def group_allreduce(arrays, groups, allreduce):
    """All-reduce `arrays` (one per rank of a mesh) within each group (lists of ranks) on its own."""
    for group in groups:
        allreduce([arrays[r] for r in group])
