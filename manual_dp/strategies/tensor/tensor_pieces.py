"""Tensor parallelism over a fixed number of pieces, every sum in one fixed tree: the split-layer
arithmetic of --deterministic (strategies/tensor/tensor_sums.py, and every other layout's leaves
under --tensor-pieces Q).

strategies/tensor/tensor.py splits a model's split layers into T shards, so a row-parallel layer's output
is a sum of T partial products, and T = 1 adds all of them inside one kernel. Here the split is
fixed at Q pieces (channels, heads, hidden units: each Param.split axis cut in Q) whatever T is: a
context of a T-group holds Q/T consecutive pieces and runs each piece's part of a split layer on its
own, the same kernels on the same shapes for any T (one context included, holding all Q), and the
pieces' partial products are added in strategies/sums/fixed_sums.py's binary tree over the piece
numbers; for Q = 4:  (p0 + p1) + (p2 + p3)  on T = 1, 2 or 4 alike (each context adds the whole
subtrees of its own pieces, the first context of the group the rest, and copies the sum back).

    PieceJoin   the model's split_forward sees the group as Q pieces: f a copy per piece (backward:
                the pieces' gradients added in the tree, TreeF), g the tree's sum of the pieces'
                partials on every context (TreeG); the unsplit layers run once per context
    per context its pieces' arrays of every split parameter, piece by piece, then the unsplit
                parameters once (cut; join is its inverse; pieced gives each piece's view in the
                model's order)
"""
import numpy as np
from mxnet import autograd, nd

from ...fast.tensor_ops import Join
from ..sums.fixed_sums import cover, root_of, tree_sum
from ..mesh.group_stages import tensor_stage
from .tensor_layout import shard


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


def as_list(out):
    """An autograd Function's outputs as a list (one output comes back bare)."""
    return [out] if isinstance(out, nd.NDArray) else list(out)


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


class PieceJoin(Join):
    """The Join (fast.tensor_ops) of a tensor group `row` whose every context holds k pieces, joined
    in the tree (its shard, unshard and starts are Join's: no sequence cut)."""

    def __init__(self, row, k):
        super().__init__(allreduce=None)
        self.row, self.k = list(row), k

    def f(self, xs):
        return as_list(TreeF(self.row, self.k)(*xs))

    def g(self, parts):
        return as_list(TreeG(self.row, self.k)(*parts))

    def spread(self, xs):
        return [x for x in xs for _ in range(self.k)]

    def leads(self, per_piece):
        return list(per_piece[::self.k])


def pieced(P, split, k):
    """k lists, each the model's parameters in order as piece q of a context sees them, from the
    context's arrays P (cut's layout: its k pieces of every split parameter, then the unsplit ones)."""
    cut_at = [i for i, a in enumerate(split) if a is not None]
    whole = dict(zip([i for i, a in enumerate(split) if a is None], P[len(cut_at) * k:]))
    return [[P[q * len(cut_at) + cut_at.index(i)] if i in cut_at else whole[i] for i in range(len(split))]
            for q in range(k)]


def sliced(W, split, Q):
    """Q lists of the model's parameters W (whole, on one context) as pieces 0..Q-1 see them: each
    split parameter's piece a recorded slice (its gradient reaches W), the unsplit ones whole."""
    def piece(w, axis, q):
        n = w.shape[axis] // Q
        return nd.slice_axis(w, axis=axis, begin=q * n, end=(q + 1) * n)
    return [[w if a is None else piece(w, a, q) for w, a in zip(W, split)] for q in range(Q)]


def cut(values, split, Q, T, j):
    """Context j's arrays (numpy) of T from the model's `values`: the split parameters' pieces
    j*Q/T .. (j+1)*Q/T - 1 of Q, piece by piece, then the unsplit parameters."""
    k = Q // T
    return [shard(values[i], a, q, Q) for q in range(j * k, (j + 1) * k) for i, a in enumerate(split)
            if a is not None] + [v for v, a in zip(values, split) if a is None]


def join(per_context, split, k):
    """The model's values (numpy) from every context's arrays in a group, in order (cut's inverse)."""
    pieces = [w for P in per_context for w in pieced(P, split, k)]
    return [pieces[0][i] if a is None else np.concatenate([w[i] for w in pieces], axis=a)
            for i, a in enumerate(split)]


def names(all_names, split, Q, T, j):
    """The names of context j's arrays, in cut's order ("block0_wq piece 3", ..., then unsplit)."""
    k = Q // T
    return [f"{all_names[i]} piece {q}" for q in range(j * k, (j + 1) * k) for i, a in enumerate(split)
            if a is not None] + [n for n, a in zip(all_names, split) if a is None]


def piece_forward(net, Q):
    """The forward --deterministic's leaves run under --tensor-pieces Q: net.forward for Q = 1; else
    every split layer in Q pieces on the images' one context (a PieceJoin of one context holding
    all Q), the arithmetic of a tensor group of any T dividing Q."""
    if Q == 1:
        return net.forward
    split = [p.split for p in net.param_table()]

    def forward(X, W):
        return net.split_forward([X], sliced(W, split, Q), PieceJoin([X.context], Q))[0]
    return forward


def piece_stage(net, ids, Q):
    """A pipeline stage of the model's layers `ids` in Q pieces on its context (piece_forward's
    arithmetic, a stage at a time): the function (h, params, F=nd) of strategies/pipeline/stages.py."""
    split = [p.split for i in ids for p in net.layers[i].params]

    def stage(h, params, F=nd):
        run = tensor_stage(net, ids, PieceJoin([h.context], Q))
        return run([h], sliced(params, split, Q), F)[0]
    stage.__name__ = f"layers {ids[0]}..{ids[-1]} in {Q} pieces"
    return stage
