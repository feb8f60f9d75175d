"""--deterministic with the sequence in K pieces and every split layer in Q pieces at once:
ContextTensorParallel(..., sums=FixedSums) (cp x tp, --mode context --tensor-parallel T) with the bits
of one context's --deterministic step given the same --sequence-pieces K and --tensor-pieces Q, for
any C dividing K and T dividing Q.

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

Storage, update, checkpoints and fingerprints are FixedTensor's (strategies/tensor/tensor_sums.py),
the grid's rows being its tensor groups (every context of a column holds the same pieces). Megatron-SP
(strategies/tensor/sequence_sums.py) is this grid with C = 1 whose lanes' token-wise work stays home.
"""
from mxnet import autograd, nd

from ...fast.attention import ATTENTION
from ...fast.prefetch import host
from ...models.contract import example_loss, count_correct
from ...models import as_model, stateless
from ..sums.fixed_sums import FixedSums, leaf
from .sequence_pieces import Lanes
from ..tensor.tensor_pieces import PieceJoin, pieced, tree_reduce
from ..tensor.tensor_sums import FixedTensor


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


class FixedGrid(FixedTensor):
    """The --deterministic half of ContextTensorParallel (strategies/context/context_tensor.py):
    len(ctx) // (C T) data-parallel C x T grids (see the module docstring)."""

    def hold_grid(self, params, ctx, optimizer, C, T, attention, K, model):
        """Afterwards grids[r][c][t] is group r's grid, each row a tensor group of FixedTensor's
        pieces, and lanes[r] its K lanes; ValueError where the degrees do not divide."""
        n, Q = len(ctx), self.sums.tensor_pieces
        if attention not in ATTENTION:
            raise ValueError(f"unknown attention {attention!r}: choose from {', '.join(ATTENTION)}")
        why = model.grid_refusal(C, Q, attention) if model is not None else "LeNet has no sequence"
        if why or n % (C * T) or K % C or Q % T or K > model.tokens:
            raise ValueError(why or f"cp={C} x tp={T} must divide the {n} contexts, cp the {K} sequence pieces "
                                    f"(at most the {model.tokens} tokens) and tp the {Q} tensor pieces")
        self.ctx, self.optimizer = list(ctx), optimizer
        self.net = stateless(as_model(model, params), "--deterministic --mode tensor")
        self.hold_pieces(params, optimizer, T)
        self.C, self.K, self.kc, self.attention = C, K, K // C, attention     # kc lanes a grid row
        self.grids = [self.grid[r:r + C] for r in range(0, len(self.grid), C)]       # grids[r][c][t]
        self.lanes = [self.group_lanes(g) for g in self.grids]

    def group_lanes(self, grid):
        """The Lanes of a grid: K/C on the first context of each row."""
        return Lanes(self.net.tokens, self.K, [row[0] for row in grid], self.attention, self.net.causal)

    def members(self, r):
        """Group r's rows of contexts and arrays."""
        return self.grids[r], self.shards[r * self.C:(r + 1) * self.C]

    def lane_backward(self, X, y):
        """Every group's run of the batch's pieces through its lanes; per column, the leaves added
        in the tree on group 0's first row."""
        bounds, runs, mine = self.sums.cut(len(X), len(self.grids))
        m = len(bounds)
        leaves = self.lane_leaves(X, y, bounds, mine)
        totals = []
        for t, home in enumerate(self.grid[0]):                 # one tree a column, on group 0's first row
            have = self.sums.subtrees(leaves[t], mine, m, home)
            totals.append(self.sums.total(have, runs, m, self.n + 2, home, f"grid-tree{t}-"))
        return self.keep_totals(totals)

    def lane_leaves(self, X, y, bounds, runs):
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
                for t, value in enumerate(self.lane_leaf(r, weights, host(X[a:b]), host(y[a:b]))):
                    out[t][j] = value
        return out

    def lane_leaf(self, r, weights, X, y):
        """One batch piece through group r's K lanes: per column, the lanes' gradients added in the
        tree, the loss sum and correct count (lane 0's), one leaf."""
        with autograd.record():
            scores = self.lane_forward(r, X, weights)
            losses = [[example_loss(s, y.as_in_context(s.context)).sum() for s in row] for row in scores]
            heads = [loss * (1 / self.K) for row in losses for loss in row]
        autograd.backward(heads)
        loss, right = losses[0][0].reshape((1,)), count_correct(scores[0][0], y.as_in_context(scores[0][0].context))
        right = right.reshape((1,)).astype(loss.dtype)
        return [leaf([total, loss.as_in_context(total.context), right.as_in_context(total.context)])
                for total in self.lane_sums(r, weights)]

    def lane_views(self, weights):
        """Each lane's parameters as its Q pieces see them (weights[lane][t]: context t's arrays)."""
        return [[w for Wt in W for w in pieced(Wt, self.split, self.k)] for W in weights]

    def lane_forward(self, r, X, weights):
        """Class scores [[per context of its row] per lane] of images X through group r's lanes."""
        rows = self.grids[r]
        Xs = [[X.as_in_context(c) for c in rows[b // self.kc]] for b in range(self.K)]
        return self.net.grid_forward(Xs, self.lane_views(weights), LaneJoin(self.k), self.lanes[r])

    def lane_sums(self, r, weights):
        """Per column t: the tree's sum over the lanes of their gradients of t's arrays, on group r's
        first row."""
        return [tree_reduce([leaf([w.grad for w in W[t]]) for W in weights], [row[t] for row in self.grids[r]],
                            self.kc) for t in range(self.T)]

    def lane_correct(self, X, y):
        """Correct predictions on (X, y): batch pieces spread over the groups, each through its lanes."""
        bounds, runs, _ = FixedSums(self.sums.piece).cut(len(X), len(self.grids))
        counts = []
        for r, (lo, hi) in enumerate(runs):
            P = self.members(r)[1]
            weights = [P[b // self.kc] for b in range(self.K)]
            for a, b in bounds[lo:hi]:
                scores = self.lane_forward(r, host(X[a:b]), weights)
                right = count_correct(scores[0][0], host(y[a:b]).as_in_context(scores[0][0].context))
                counts.append(right.as_in_context(self.ctx[0]))
        return nd.add_n(*counts) if len(counts) > 1 else counts[0]
