"""Tensor parallelism over a fixed number of channel pieces, every sum in one fixed tree: the layer
arithmetic of --deterministic --mode tensor (strategies/tensor_deterministic.py).

strategies/tensor.py splits LeNet's split layers into T shards, so a row-parallel layer's output is
a sum of T partial products, and T = 1 adds all channels inside one kernel. Here the split is fixed
at Q channel pieces (config.TENSOR_PIECES) whatever T is: a context of a T-group holds Q/T
consecutive pieces and runs each piece's layers on its own, the same kernels on the same shapes for
any T, and the pieces' partial products are added in deterministic.py's binary tree over the piece
numbers; for Q = 4:  (p0 + p1) + (p2 + p3)  on T = 1, 2 or 4 alike (each context adds the whole
subtrees of its own pieces, the first context of the group the rest, and copies the sum back).

    per piece q: [W1_q, b1_q, W2_q, W3_q, b3_q, W4_q]     conv1's output channels, conv2's input
                                                           channels, dense1's units, dense2's inputs
    per context: its pieces' arrays, end to end, then b2 and b4 (whole on every context)

    conv1_q, conv2_q  (B, c2, 9, 9) partial per piece -> TreeG: the tree's sum on every context
    + b2, ReLU, pool                                     (B, c2, 4, 4) per context
    TreeF             a copy per piece; backward: the pieces' input gradients added in the tree
    dense1_q, dense2_q (B, 10) partial per piece        -> TreeG, then + b4
"""
import numpy as np
from mxnet import autograd, nd

from ..lesson import conv_block, dense, relu
from .fixed_sums import cover, root_of, tree_sum
from .tensor import NAMES, SPLIT
from .tensor_layout import shard

PIECED = [i for i, a in enumerate(SPLIT) if a is not None]     # W1, b1, W2, W3, b3, W4 (lenet indices)
WHOLE = [i for i, a in enumerate(SPLIT) if a is None]          # b2, b4


def add_on(ctx):
    """add(a, b) for tree_sum: a + b computed on `ctx` (both fetched there)."""
    return lambda a, b: a.as_in_context(ctx) + b.as_in_context(ctx)


def tree_reduce(values, row, k):
    """The tree sum over the pieces' `values` (values[q] on row[q // k]): each context's whole
    subtrees added on it, the rest on row[0]; a fresh array on row[0]."""
    m, leaves, have = len(values), {(0, q): v for q, v in enumerate(values)}, {}
    for j, c in enumerate(row):
        for node in cover(j * k, (j + 1) * k, m):
            have[node] = tree_sum(node, m, leaves, add_on(c))
    total = tree_sum(root_of(m), m, have, add_on(row[0]))
    return total.copy() if m == 1 else total


class TreeG(autograd.Function):
    """g over pieces: forward, every context of `row` gets the tree sum of the pieces' partials;
    backward, each piece gets the gradient of its own context's output."""

    def __init__(self, row, k):
        super().__init__()
        self.row, self.k = row, k

    def forward(self, *parts):
        total = tree_reduce(parts, self.row, self.k)
        return tuple(total.copyto(c) for c in self.row)

    def backward(self, *dys):
        return tuple(dys[q // self.k].copy() for q in range(len(self.row) * self.k))


class TreeF(autograd.Function):
    """f over pieces: forward, a copy of its context's input for each piece; backward, every context
    gets the tree sum of the pieces' gradients."""

    def __init__(self, row, k):
        super().__init__()
        self.row, self.k = row, k

    def forward(self, *xs):
        return tuple(xs[q // self.k].copy() for q in range(len(self.row) * self.k))

    def backward(self, *dys):
        total = tree_reduce(dys, self.row, self.k)
        return tuple(total.copyto(c) for c in self.row)


def piece_params(P, k):
    """[[W1, b1, W2, W3, b3, W4] per piece] of one context's arrays P (its k pieces, then b2, b4)."""
    n = len(PIECED)
    return [P[p * n:(p + 1) * n] for p in range(k)]


def group_scores(Xs, P, row, k):
    """Class scores (B, 10) on every context of a tensor group `row` from its copies of the images
    Xs (B, 1, 28, 28) and its arrays P[j] (context j's k pieces, then b2, b4)."""
    pieces = [(X, w) for X, Pj in zip(Xs, P) for w in piece_params(Pj, k)]
    parts = [nd.Convolution(conv_block(X, w[0], w[1]), w[2], no_bias=True, kernel=w[2].shape[2:],
                            num_filter=w[2].shape[0]) for X, w in pieces]      # (B, c2, 9, 9) each
    h = TreeG(row, k)(*parts)                                                   # summed, per context
    h = [nd.Pooling(relu(nd.broadcast_add(hj, Pj[-2].reshape((1, -1, 1, 1)))), pool_type="avg",
                    kernel=(2, 2), stride=(2, 2)) for hj, Pj in zip(h, P)]     # (B, c2, 4, 4)
    h = TreeF(row, k)(*h)                                                       # a copy per piece
    parts = [nd.FullyConnected(relu(dense(hq, w[3], w[4])), nd.transpose(w[5]), no_bias=True,
                               num_hidden=w[5].shape[1]) for hq, (_, w) in zip(h, pieces)]  # (B, 10)
    s = TreeG(row, k)(*parts)
    return [nd.broadcast_add(sj, Pj[-1].reshape((1, -1))) for sj, Pj in zip(s, P)]


def cut(values, Q, T, j):
    """Context j's arrays (numpy) of T from lenet's 8 `values`: the pieced parameters' pieces
    j*Q/T .. (j+1)*Q/T - 1 of Q, piece by piece, then b2 and b4."""
    k = Q // T
    return [shard(values[i], SPLIT[i], q, Q) for q in range(j * k, (j + 1) * k) for i in PIECED] + \
        [values[i] for i in WHOLE]


def join(per_context, k):
    """lenet's 8 values (numpy) from every context's arrays in a group, in order (cut's inverse)."""
    pieces = [w for P in per_context for w in piece_params(P, k)]
    out = [None] * len(SPLIT)
    for pos, i in enumerate(PIECED):
        out[i] = np.concatenate([w[pos] for w in pieces], axis=SPLIT[i])
    for pos, i in enumerate(WHOLE):
        out[i] = per_context[0][len(PIECED) * k + pos]
    return out


def names(Q, T, j):
    """The names of context j's arrays, in cut's order ("W2 piece 3", ..., "b2", "b4")."""
    k = Q // T
    return [f"{NAMES[i]} piece {q}" for q in range(j * k, (j + 1) * k) for i in PIECED] + \
        [NAMES[i] for i in WHOLE]
