"""--deterministic with the sequence in K pieces and every split layer in Q pieces at once: cp x tp
(--mode context --tensor-parallel T) with the bits of one context's --deterministic step given the
same --sequence-pieces K and --tensor-pieces Q, for any C dividing K and T dividing Q.

A group is a C x T grid of contexts (dp x cp x tp, tp counting fastest, as mesh.py numbers them):
row c holds lanes c*K/C .. (c+1)*K/C - 1 of the sequence, column t split-layer pieces t*Q/T ..
(t+1)*Q/T - 1 (tensor_pieces.cut's arrays). Each lane runs the transformer's grid_forward as one row
of a grid whose rows are lanes: its split layers in Q pieces joined in the tree (PieceJoin, on the
lane's row of contexts), attention over the lanes folded in one order per piece (FixedAttention), the
pooling the tree's sum of the lanes' shares (LaneSum); each lane with its own copy of its contexts'
arrays, so its gradient is a leaf. Per column, the lanes' gradients are added in the tree over the
lane numbers (tree_reduce), then a batch piece's [gradient, loss, correct] is a leaf of FixedSums'
tree over the batch pieces, one tree per column (strategies/sums/fixed_sums.py). The same kernels on the
same shapes for every C and T (C = T = 1: one context holding all K x Q), so the same bits.

Storage, update, checkpoints and fingerprints are TensorDeterministic's, the grid's rows being its
tensor groups (every context of a column holds the same pieces).
"""
from mxnet import autograd, nd

from ...config import SEQUENCE_PIECES, TENSOR_PIECES, RunConfig
from ...fast.attention import ATTENTION
from ...fast.prefetch import host
from ...lesson import cross_entropy, n_correct
from ..sums.fixed_sums import FixedSums, leaf
from .sequence_pieces import Lanes
from ..tensor.tensor_layout import even_split
from ..tensor.tensor_deterministic import TensorDeterministic
from ..tensor.tensor_pieces import PieceJoin, pieced, tree_reduce


class LaneJoin(PieceJoin):
    """PieceJoin on whichever row of contexts its arguments live on (one per lane of the grid),
    every context holding k pieces."""

    def __init__(self, k):
        super().__init__([], k)

    def f(self, xs):
        self.row = [x.context for x in xs]
        return super().f(xs)

    def g(self, parts):
        self.row = [x.context for x in parts[::self.k]]
        return super().g(parts)


class GridDeterministic(TensorDeterministic):
    """len(ctx) // (C T) data-parallel C x T grids (see the module docstring). pieces: K;
    tensor_pieces: Q; sums: this process's FixedSums (default one process); model: a transformer."""

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, context_parallel=1, tensor_parallel=1,
                 attention="ring", pieces=SEQUENCE_PIECES, tensor_pieces=TENSOR_PIECES, sums=None, model=None):
        C, T, n = context_parallel, tensor_parallel, len(ctx)
        if attention not in ATTENTION:
            raise ValueError(f"unknown attention {attention!r}: choose from {', '.join(ATTENTION)}")
        why = model.grid_refusal(C, tensor_pieces, attention) if model is not None else "LeNet has no sequence"
        if why or n % (C * T) or pieces % C or tensor_pieces % T or pieces > model.tokens:
            raise ValueError(why or f"cp={C} x tp={T} must divide the {n} contexts, cp the {pieces} sequence pieces "
                                    f"(at most the {model.tokens} tokens) and tp the {tensor_pieces} tensor pieces")
        self.sums = sums or FixedSums()
        super().__init__(params, ctx, optimizer, T, self.sums.piece, tensor_pieces, model=model)
        self.C, self.K, self.kc, self.attention = C, pieces, pieces // C, attention     # kc lanes a grid row
        self.groups = [self.grid[r:r + C] for r in range(0, len(self.grid), C)]       # groups[r][c][t]
        self.lanes = [Lanes(self.net.tokens, pieces, [row[0] for row in g], attention) for g in self.groups]

    def members(self, r):
        """Group r's rows of contexts and arrays."""
        return self.groups[r], self.shards[r * self.C:(r + 1) * self.C]

    def backward(self, X, y):
        bounds, runs, mine = self.sums.cut(len(X), len(self.groups))
        m = len(bounds)
        leaves = self.leaves(X, y, bounds, mine)
        totals = []
        for t, home in enumerate(self.grid[0]):                 # one tree a column, on group 0's first row
            have = self.sums.subtrees(leaves[t], mine, m, home)
            totals.append(self.sums.total(have, runs, m, self.n + 2, home, f"grid-tree{t}-"))
        held = [[total.copyto(c) for c, total in zip(row, totals)] for row in self.grid]
        self.held = held if self.held is None else [[a + b for a, b in zip(A, B)] for A, B in zip(self.held, held)]
        if self.sums.rank:                               # the job's metrics come from rank 0 alone
            return [(nd.zeros((1,), ctx=self.ctx[0]), nd.zeros((1,), ctx=self.ctx[0]))]
        return [(totals[0][self.n:self.n + 1], totals[0][self.n + 1:self.n + 2])]

    def leaves(self, X, y, bounds, runs):
        """[{piece: [gradient, loss sum, correct] (n + 2,)} per column], each on its group's first
        row's context of that column."""
        out = [{} for _ in range(self.T)]
        for r, (lo, hi) in enumerate(runs):
            rows, P = self.members(r)
            weights = [[[p.copyto(c) for p in Pt] for Pt, c in zip(P[b // self.kc], rows[b // self.kc])]
                       for b in range(self.K)]                                     # weights[lane][t]: a copy
            for w in (w for W in weights for Wt in W for w in Wt):
                w.attach_grad()
            for j in range(lo, hi):
                a, b = bounds[j]
                for t, value in enumerate(self.piece_leaves(r, weights, host(X[a:b]), host(y[a:b]))):
                    out[t][j] = value
        return out

    def piece_leaves(self, r, weights, X, y):
        """One batch piece through group r's K lanes: per column, the lanes' gradients added in the
        tree, the loss sum and correct count (lane 0's), one leaf."""
        with autograd.record():
            scores = self.forward(r, X, weights)
            losses = [[cross_entropy(s, y.as_in_context(s.context)).sum() for s in row] for row in scores]
            heads = [loss * (1 / self.K) for row in losses for loss in row]
        autograd.backward(heads)
        loss, right = losses[0][0].reshape((1,)), n_correct(scores[0][0], y.as_in_context(scores[0][0].context))
        right = right.reshape((1,)).astype(loss.dtype)
        return [leaf([total, loss.as_in_context(total.context), right.as_in_context(total.context)])
                for total in self.lane_sums(r, weights)]

    def views(self, weights):
        """Each lane's parameters as its Q pieces see them (weights[lane][t]: context t's arrays)."""
        return [[w for Wt in W for w in pieced(Wt, self.split, self.k)] for W in weights]

    def forward(self, r, X, weights):
        """Class scores [[per context of its row] per lane] of images X through group r's lanes."""
        rows = self.groups[r]
        Xs = [[X.as_in_context(c) for c in rows[b // self.kc]] for b in range(self.K)]
        return self.net.grid_forward(Xs, self.views(weights), LaneJoin(self.k), self.lanes[r])

    def lane_sums(self, r, weights):
        """Per column t: the tree's sum over the lanes of their gradients of t's arrays, on group r's
        first row."""
        return [tree_reduce([leaf([w.grad for w in W[t]]) for W in weights], [row[t] for row in self.groups[r]],
                            self.kc) for t in range(self.T)]

    def correct(self, X, y):
        """Correct predictions on (X, y): batch pieces spread over the groups, each through its lanes."""
        bounds, runs, _ = FixedSums(self.sums.piece).cut(len(X), len(self.groups))
        counts = []
        for r, (lo, hi) in enumerate(runs):
            P = self.members(r)[1]
            weights = [P[b // self.kc] for b in range(self.K)]
            for a, b in bounds[lo:hi]:
                scores = self.forward(r, host(X[a:b]), weights)
                right = n_correct(scores[0][0], host(y[a:b]).as_in_context(scores[0][0].context))
                counts.append(right.as_in_context(self.ctx[0]))
        return nd.add_n(*counts) if len(counts) > 1 else counts[0]

    def layout(self, batch_size):
        """As ContextTensorParallel prices a grid: 1/(C T) of its examples a context (a floor)."""
        out, every = [], tuple(range(len(self.net.layers)))
        for g, n in zip(self.groups, even_split(batch_size, len(self.groups))):
            cells = [c for row in g for c in row]
            out += [(c, every, k) for c, k in zip(cells, even_split(n, len(cells)))]
        return out
