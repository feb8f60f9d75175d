"""--deterministic for context parallelism: ContextParallel(..., sums=FixedSums) with the bits of one
context's --deterministic step given the same --sequence-pieces K, for any context degree C
dividing K, ring or Ulysses.

Where its float sums depend on the placement, and what fixes each:

    over the tokens  attention's online softmax, the gradients of keys and values, every weight
                     gradient (a sum over tokens) and the pooling. Fixed: the sequence is always K
                     pieces ("lanes"), each run layer by layer on its own with its own copy of the
                     parameters, attention folded in one order and every sum over the lanes taken in
                     one tree (strategies/context/sequence_pieces.py); C = 1 holds all K lanes
    over the batch   which group computes which examples, and the sum over groups and processes.
                     Fixed as in strategies/sums/fixed_sums.py: the batch cut into pieces of PIECE_ROWS
                     rows, each run whole by one group; a piece's leaf is [the lanes' tree sum of
                     their gradients, its loss sum, its correct count] on the group's first context,
                     the leaves added in the tree over the piece numbers (FixedSums, as
                     --deterministic --mode sync adds its contexts')

Each lane computes the loss of the (same) class scores and backpropagates 1/K of it; the loss and
the correct count are lane 0's. The update is elementwise, the same on every context; parameters,
optimiser state, checkpoints, fingerprints and the memory layout are kept as ContextParallel keeps
them. --mode sync --deterministic --sequence-pieces K is this with C = 1 (each context a group).
Each process must run its ops with the same thread count (the command line gives one per op).
"""
from mxnet import autograd, nd

from ...fast.prefetch import host
from ...models.contract import example_loss, count_correct
from ...optim import apply_update_and_clear, init_states
from ..sums.fixed_sums import FixedSums, into_grads, leaf, whole_leaves_backward
from .sequence_pieces import Lanes
from ..tensor.tensor_pieces import tree_reduce
from ..tensor.tensor_sums import place


class FixedContext:
    """The --deterministic half of ContextParallel (strategies/context/context.py), whose attributes
    it reads: len(ctx) // C data-parallel groups of C contexts, group r's contexts ctx[r*C:(r+1)*C]
    holding lanes j*K/C .. (j+1)*K/C - 1 of the sequence's K (see the module docstring)."""

    def hold_lanes(self, params, K):
        """Afterwards every context holds the parameters (each backward writing its gradients) and
        its optimiser state, and lanes[r] group r's K lanes; ValueError where C does not divide K."""
        C = self.C
        why = "LeNet has no sequence of tokens to cut" if self.net is None else \
            self.net.sequence_refusal(C, self.attention) or (f"{K} sequence pieces exceed the {self.net.tokens} "
                                                             f"tokens" if K > self.net.tokens else None)
        if len(self.ctx) % C or K % C or why:
            raise ValueError(why or f"context degree {C} must divide {len(self.ctx)} contexts and the {K} "
                                    f"sequence pieces")
        self.K = K
        self.grid = [self.ctx[r:r + C] for r in range(0, len(self.ctx), C)]      # grid[group][block]
        self.lanes = [Lanes(self.net.tokens, K, row, self.attention, self.net.causal) for row in self.grid]
        values = [p.asnumpy() for p in params]
        self.params = [[place(values, c) for c in row] for row in self.grid]
        self.states = [[init_states(P, self.optimizer) for P in row] for row in self.params]
        self.n = sum(p.size for p in self.params[0][0])     # a leaf: [gradients, loss, correct]
        self.held, self.t, self.zero = None, 0, None

    def own(self, c):
        """The parameters on context `c`."""
        return self.copies[self.ctx.index(c)]


    def fixed_backward(self, X, y):
        """Every group's run of the batch's pieces through its lanes; afterwards `held` adds the tree's
        total [gradient, loss sum, correct] on the first context (fixed_sums.whole_leaves_backward)."""
        return whole_leaves_backward(self, X, y, len(self.grid), "sequence-tree")

    def leaves(self, X, y, bounds, runs):
        """{piece: [gradient, loss sum, correct] (n + 2,)} on its group's first context."""
        out = {}
        for lanes, (lo, hi) in zip(self.lanes, runs):
            weights = [[p.copyto(c) for p in self.own(c)] for c in lanes.where]    # a copy per lane
            for W in weights:
                for w in W:
                    w.attach_grad()                                                 # each backward writes
            for j in range(lo, hi):
                out[j] = self.piece_leaf(lanes, weights, host(X[bounds[j][0]:bounds[j][1]]),
                                         host(y[bounds[j][0]:bounds[j][1]]))
        return out

    def piece_leaf(self, lanes, weights, X, y):
        """One batch piece through the group's K lanes: the lanes' gradients added in the tree, its
        loss sum and correct count (lane 0's), one leaf on the group's first context."""
        ys = [y.as_in_context(c) for c in lanes.where]
        with autograd.record():
            scores = self.net.sequence_forward([X.as_in_context(c) for c in lanes.where], weights, lanes)
            losses = [example_loss(s, yj).sum() for s, yj in zip(scores, ys)]
            heads = [loss * (1 / self.K) for loss in losses]
        autograd.backward(heads)
        grads = [leaf([w.grad for w in W]) for W in weights]                    # (n,) on each lane's context
        right = count_correct(scores[0], ys[0]).reshape((1,)).astype(losses[0].dtype)
        return leaf([tree_reduce(grads, lanes.row, lanes.k), losses[0].reshape((1,)), right])

    def fixed_update(self, lr, n_examples):
        """The tree's gradient into every context's parameters, then the same elementwise update."""
        self.t += 1
        n_examples = self.counted(n_examples)
        for P, S in zip(self.copies, [S for row in self.states for S in row]):
            into_grads(self.held.as_in_context(P[0].context), P)
            apply_update_and_clear(P, S, self.optimizer, lr, self.t, n_examples)
        self.held = None

    def fixed_grads(self):
        """The tree's total gradient (the same bits on any layout)."""
        return [self.held[:self.n]]

    def fixed_correct(self, X, y):
        """Correct predictions on (X, y): batch pieces spread over the groups, each through its lanes."""
        bounds, runs, _ = FixedSums(self.sums.piece).cut(len(X), len(self.grid))
        counts = []
        for lanes, (lo, hi) in zip(self.lanes, runs):
            for a, b in bounds[lo:hi]:
                Xs = [host(X[a:b]).as_in_context(c) for c in lanes.where]
                scores = self.net.sequence_forward(Xs, [self.own(c) for c in lanes.where], lanes)
                right = count_correct(scores[0], host(y[a:b]).as_in_context(lanes.where[0]))
                counts.append(right.as_in_context(self.ctx[0]))
        return nd.add_n(*counts) if len(counts) > 1 else counts[0]
