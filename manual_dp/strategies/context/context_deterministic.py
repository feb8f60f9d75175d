"""--deterministic --mode context: context parallelism with the bits of one context's --deterministic
step given the same --sequence-pieces K, for any context degree C dividing K, ring or Ulysses.

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
the correct count are lane 0's. The update is elementwise, the same on every context. --mode sync
--deterministic --sequence-pieces K is this strategy with C = 1 (each context a group). Each
process must run its ops with the same thread count (the command line gives one per op).
"""
from mxnet import autograd, nd

from ...config import RunConfig, SEQUENCE_PIECES
from ...fast.attention import ATTENTION
from ...fast.prefetch import host
from ...lesson import cross_entropy, n_correct
from ...models import stateless
from ...optim import apply_update_and_clear, init_states
from ...replicas import fingerprint
from ..base import Strategy
from .context import ContextParallel
from ..data.data_parallel import host_state, load_into
from ..sums.fixed_sums import FixedSums, WholeBatch, into_grads, leaf, whole_leaves_backward
from .sequence_pieces import Lanes
from ..tensor.tensor_deterministic import TensorDeterministic
from ..tensor.tensor_pieces import tree_reduce


class ContextDeterministic(WholeBatch, Strategy):
    """len(ctx) // C data-parallel groups of C contexts, group r's contexts ctx[r*C:(r+1)*C] holding
    lanes j*K/C .. (j+1)*K/C - 1 of the sequence's K (see the module docstring). sums: the
    FixedSums of this process (default: one process); model: a transformer (a sequence_forward)."""

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, context_parallel=None, attention="ring",
                 pieces=SEQUENCE_PIECES, sums=None, model=None):
        self.ctx, self.optimizer = list(ctx), optimizer
        self.net = stateless(model, "--deterministic --mode context") if model is not None else None
        C = self.C = context_parallel or len(self.ctx)
        if attention not in ATTENTION:
            raise ValueError(f"unknown attention {attention!r}: choose from {', '.join(ATTENTION)}")
        why = "LeNet has no sequence of tokens to cut" if self.net is None else \
            self.net.sequence_refusal(C, attention) or (f"{pieces} sequence pieces exceed the {self.net.tokens} "
                                                        f"tokens" if pieces > self.net.tokens else None)
        if len(self.ctx) % C or pieces % C or why:
            raise ValueError(why or f"context degree {C} must divide {len(self.ctx)} contexts and the {pieces} "
                                    f"sequence pieces")
        self.attention, self.K, self.sums = attention, pieces, sums or FixedSums()
        self.grid = [self.ctx[r:r + C] for r in range(0, len(self.ctx), C)]      # grid[group][block]
        self.lanes = [Lanes(self.net.tokens, pieces, row, attention) for row in self.grid]
        values = [p.asnumpy() for p in params]
        self.params = [TensorDeterministic.place(values, c) for c in self.ctx]
        self.states = [init_states(P, optimizer) for P in self.params]
        self.n = sum(p.size for p in self.params[0])     # a leaf: [gradients, loss, correct]
        self.held, self.t = None, 0

    def own(self, c):
        """The parameters on context `c`."""
        return self.params[self.ctx.index(c)]

    def backward(self, X, y):
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
            losses = [cross_entropy(s, yj).sum() for s, yj in zip(scores, ys)]
            heads = [loss * (1 / self.K) for loss in losses]
        autograd.backward(heads)
        grads = [leaf([w.grad for w in W]) for W in weights]                    # (n,) on each lane's context
        right = n_correct(scores[0], ys[0]).reshape((1,)).astype(losses[0].dtype)
        return leaf([tree_reduce(grads, lanes.row, lanes.k), losses[0].reshape((1,)), right])

    def update(self, lr, n_examples):
        """The tree's gradient into every context's parameters, then the same elementwise update."""
        self.t += 1
        n_examples = self.counted(n_examples)
        for P, S in zip(self.params, self.states):
            into_grads(self.held.as_in_context(P[0].context), P)
            apply_update_and_clear(P, S, self.optimizer, lr, self.t, n_examples)
        self.held = None

    def reduced_grads(self):
        """The tree's total gradient (the same bits on any layout)."""
        return [self.held[:self.n]]

    def correct(self, X, y):
        """Correct predictions on (X, y): batch pieces spread over the groups, each through its lanes."""
        bounds, runs, _ = FixedSums(self.sums.piece).cut(len(X), len(self.grid))
        counts = []
        for lanes, (lo, hi) in zip(self.lanes, runs):
            for a, b in bounds[lo:hi]:
                Xs = [host(X[a:b]).as_in_context(c) for c in lanes.where]
                scores = self.net.sequence_forward(Xs, [self.own(c) for c in lanes.where], lanes)
                right = n_correct(scores[0], host(y[a:b]).as_in_context(lanes.where[0]))
                counts.append(right.as_in_context(self.ctx[0]))
        return nd.add_n(*counts) if len(counts) > 1 else counts[0]

    def fingerprints(self):
        """Every context's copy of the parameters: all equal."""
        names = self.net.names()
        return {"replicas": [fingerprint(c, P, names) for c, P in zip(self.ctx, self.params)]}

    layout = ContextParallel.layout      # as ContextParallel prices it (an upper bound: one piece at a time)

    def arrays(self):
        params = [p for P in self.params for p in P]
        return {"param": params, "grad": [p.grad for p in params],
                "state": [s for S in self.states for st in S for s in st]}

    def state_dict(self):
        return host_state(self.params[0], self.states[0], self.t)

    def load_state_dict(self, state):
        for P, S in zip(self.params, self.states):
            load_into(P, S, state)
        self.t = state["t"]
