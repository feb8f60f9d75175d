"""--deterministic for tensor parallelism: TensorParallel(..., sums=FixedSums) with the bits of
--deterministic in every other layout given the same --tensor-pieces Q, on any number of contexts,
any tensor degree T that divides Q, and any number of processes.

Where tensor parallelism's float sums depend on the placement, and what fixes each:

    inside a group   a row-parallel layer adds partial products over the split channels, heads or
                     units (g), a column-parallel layer's input gradient is added over them (f's
                     backward); T = 1 adds them inside one kernel. Fixed: the split is always Q
                     pieces, each its own kernel call, added in one tree (strategies/tensor/tensor_pieces.py:
                     the model's split_forward over a PieceJoin), which is also how every other
                     layout computes its leaves under --tensor-pieces Q
    over the batch   which group computes which examples, and the sum over groups and processes.
                     Fixed as in strategies/sums/fixed_sums.py: the batch is cut into pieces of
                     PIECE_ROWS rows, each run whole by one group; each context's gradients of a
                     piece (its pieces' and the unsplit parameters'), loss and correct count are
                     one leaf; the leaves are added in the tree over the piece numbers: each group's
                     whole subtrees on its contexts, the rest on group 0's context of the same shard
                     position, after the processes swapped their subtrees exactly (a zero-slot table)

The update is elementwise, per piece array, the same shapes for every T: the same bits everywhere.
Each process must run its ops with the same thread count (the command line gives one thread per op
with --deterministic). The storage (FixedTensor's first half) is also the grids' of
strategies/context/grid_sums.py, whose rows are its tensor groups.
"""
import numpy as np
from mxnet import autograd, nd

from ...errors import CheckpointError
from ...fast.prefetch import host
from ...models.contract import example_loss, count_correct
from ...models import as_model, stateless
from ...optim import apply_update_and_clear, init_states
from ...replicas import fingerprint
from ..sums.fixed_sums import cover, into_grads, pieces, root_of, spans, tree_sum
from .tensor_layout import copies
from .tensor_pieces import PieceJoin, add_on, cut, join, names, pieced


def place(values, ctx):
    """NDArrays of `values` on `ctx`, each backward writing its gradient afresh."""
    arrays = [nd.array(v, ctx=ctx, dtype=v.dtype) for v in values]
    for a in arrays:
        a.attach_grad()
    return arrays


class FixedTensor:
    """The --deterministic half of TensorParallel (strategies/tensor/tensor.py), whose attributes it
    reads: len(ctx) // T tensor groups, group r's shard position j on ctx[r * T + j] holding channel
    pieces j*Q/T .. (j+1)*Q/T - 1 of the policy's Q (see the module docstring)."""

    def hold_tensor(self, params, ctx, optimizer, T, model):
        """Afterwards the model (stateless) is cut as the module docstring says, or ValueError."""
        self.ctx, self.optimizer = list(ctx), optimizer
        self.net = stateless(as_model(model, params), "--deterministic --mode tensor")
        self.hold_pieces(params, optimizer, T)

    def hold_pieces(self, params, optimizer, T):
        """Afterwards grid[r][j] holds shards[r][j], context j's pieces (tensor_pieces.cut), its
        optimiser state, and no gradient yet; ValueError where T does not divide the contexts and Q."""
        Q, n = self.sums.tensor_pieces, len(self.ctx)
        why = self.net.tensor_refusal(Q)
        if n % T or Q % T or why:
            raise ValueError(f"tensor degree {T} must divide {n} contexts and the {Q} pieces"
                             + (f", and {why}" if why else ""))
        self.T, self.Q, self.k = T, Q, Q // T
        self.split, self.all_names = [p.split for p in self.net.param_table()], self.net.names()
        self.grid = [self.ctx[r:r + T] for r in range(0, n, T)]   # grid[group][shard]
        values = [p.asnumpy() for p in params]
        self.shards = [[place(cut(values, self.split, Q, T, j), c) for j, c in enumerate(row)] for row in self.grid]
        self.states = [[init_states(P, optimizer) for P in row] for row in self.shards]
        self.n = sum(p.size for p in self.shards[0][0])   # a leaf: [gradients, loss, correct]
        self.held, self.t, self.zero = None, 0, None

    def piece_backward(self, X, y):
        """Every group's run of the batch's pieces in the policy's Q pieces; per shard position, the
        leaves added in the tree (across processes, one table swapped)."""
        bounds, runs, mine = self.sums.cut(len(X), len(self.grid))
        m = len(bounds)
        leaves = self.piece_leaves(X, y, bounds, mine)
        have = [{} for _ in range(self.T)]               # per shard position: {node: value}
        for row, (lo, hi), L_row in zip(self.grid, mine, leaves):
            for j, (c, own) in enumerate(zip(row, L_row)):
                have[j].update({node: tree_sum(node, m, own, add_on(c)) for node in cover(lo, hi, m)})
        if self.sums.size > 1:
            have = self.swap_positions(have, runs, m)
        return self.keep_totals([tree_sum(root_of(m), m, have[j], add_on(c)) for j, c in enumerate(self.grid[0])])

    def keep_totals(self, totals):
        """Afterwards every group's context j adds totals[j] (a tree total) to what it holds; returns
        the loss sum and correct count (on rank 0; zeros elsewhere: the job's come from rank 0)."""
        held = [[total.copyto(c) for c, total in zip(row, totals)] for row in self.grid]
        self.held = held if self.held is None else [[a + b for a, b in zip(A, B)] for A, B in zip(self.held, held)]
        if self.sums.rank:
            return [(nd.zeros((1,), ctx=self.ctx[0]), nd.zeros((1,), ctx=self.ctx[0]))]
        return [(totals[0][self.n:self.n + 1], totals[0][self.n + 1:self.n + 2])]

    def piece_leaves(self, X, y, bounds, runs):
        """[[{(0, piece): [gradients, loss sum, correct] (n + 2,)} per context] per group]: each
        group's batch pieces, one after another, every group's pushed in turn."""
        out = [[{} for _ in row] for row in self.grid]
        for step in range(max(hi - lo for lo, hi in runs)):
            heads, done = [], []
            with autograd.record():
                for r, (row, P, (lo, hi)) in enumerate(zip(self.grid, self.shards, runs)):
                    if lo + step < hi:
                        a, b = bounds[lo + step]
                        Xs, ys = copies(host(X[a:b]), row), copies(host(y[a:b]), row)
                        scores = self.piece_scores(Xs, P, row)
                        losses = [example_loss(s, yj).sum() for s, yj in zip(scores, ys)]
                        heads += losses
                        done.append((r, lo + step, losses, [count_correct(s, yj) for s, yj in zip(scores, ys)]))
            autograd.backward(heads)
            for r, j_piece, losses, correct in done:
                for L, P, loss, right in zip(out[r], self.shards[r], losses, correct):
                    # + 0 turns -0 into +0: no sum in the tree is then -0, and the exchange's zeros
                    # change no bit
                    L[(0, j_piece)] = nd.concat(*[p.grad.reshape((-1,)) for p in P], loss.reshape((1,)),
                                                right.reshape((1,)).astype(loss.dtype), dim=0) + 0
        return out

    def piece_scores(self, Xs, P, row):
        """Class scores on every context of the group `row` from its copies of the images and its
        arrays P[j] (context j's pieces, then the unsplit parameters): the model's split_forward
        over the group's Q pieces."""
        return self.net.split_forward(Xs, [w for Pj in P for w in pieced(Pj, self.split, self.k)],
                                      PieceJoin(row, self.k))

    def swap_positions(self, have, runs, m):
        """Every process's subtrees, on every process: each fills its own rows of one zero table
        (every process knows every run, so every slot), and the job sums the tables."""
        slots = [node for lo, hi in runs for node in cover(lo, hi, m)]
        home, S = self.ctx[0], len(slots)
        table = nd.zeros((self.T * S, self.n + 2), ctx=home)
        for j in range(self.T):
            for i, node in enumerate(slots):
                if node in have[j]:
                    table[j * S + i] = have[j][node].as_in_context(home)
        self.sums.exchange(table, "tensortree")
        return [{node: table[j * S + i] for i, node in enumerate(slots)} for j in range(self.T)]

    def piece_correct(self, X, y):
        """Correct predictions on (X, y): pieces of the policy's rows spread over the groups."""
        bounds, G = pieces(len(X), self.sums.piece), len(self.grid)
        counts = []
        for (lo, hi), row, P in zip(spans(len(bounds), G), self.grid, self.shards):
            for a, b in bounds[lo:hi]:
                scores = self.piece_scores(copies(host(X[a:b]), row), P, row)
                counts.append(count_correct(scores[0], host(y[a:b]).as_in_context(row[0])).as_in_context(self.ctx[0]))
        return nd.add_n(*counts) if len(counts) > 1 else counts[0]

    def fixed_update(self, lr, n_examples):
        """The tree's gradients into every context's arrays, then the same elementwise update."""
        self.t += 1
        n_examples = self.counted(n_examples)
        for held_row, P_row, S_row in zip(self.held, self.shards, self.states):
            for total, P, S in zip(held_row, P_row, S_row):
                into_grads(total, P)
                apply_update_and_clear(P, S, self.optimizer, lr, self.t, n_examples)
        self.held = None

    def fixed_grads(self):
        """The tree's gradient of every parameter, whole, in the model's order (group 0's pieces
        joined on its first context, an unsplit one from it): the elements every layout sums."""
        home = self.ctx[0]
        per_context = [[] for _ in self.grid[0]]
        for j, (total, P) in enumerate(zip(self.held[0], self.shards[0])):
            at = 0
            for p in P:
                per_context[j].append(total[at:at + p.size].reshape(p.shape).as_in_context(home))
                at += p.size
        every = [w for P in per_context for w in pieced(P, self.split, self.k)]
        return [every[0][i] if a is None else nd.concat(*[w[i] for w in every], dim=a)
                for i, a in enumerate(self.split)]

    def fixed_fingerprints(self):
        """Shard position j of every group; and the unsplit parameters, whole on every context."""
        n = sum(a is not None for a in self.split) * self.k
        groups = {f"tensor shard {j}": [fingerprint(row[j], P_row[j][:n], names(self.all_names, self.split, self.Q,
                                                                               self.T, j)[:n])
                                        for row, P_row in zip(self.grid, self.shards)] for j in range(self.T)}
        whole = [name for name, a in zip(self.all_names, self.split) if a is None]
        groups["unsplit parameters"] = [fingerprint(c, P[n:], whole)
                                        for row, P_row in zip(self.grid, self.shards) for c, P in zip(row, P_row)]
        return groups

    def fixed_arrays(self):
        """Every context's pieces, their gradients and optimiser state (see Strategy.arrays)."""
        params = [p for P_row in self.shards for P in P_row for p in P]
        states = [s for S_row in self.states for S in S_row for st in S for s in st]
        return {"param": params, "grad": [p.grad for p in params], "state": states}

    def fixed_state_dict(self):
        """Group 0's pieces joined: the whole parameters and optimiser state, in the model's order."""
        P_row, S_row = self.shards[0], self.states[0]
        params = join([[p.asnumpy() for p in P] for P in P_row], self.split, self.k)
        slots = len(S_row[0][0])
        per_slot = [join([[st[s].asnumpy() for st in S] for S in S_row], self.split, self.k) for s in range(slots)]
        opt_state = [[per_slot[s][i] for s in range(slots)] for i in range(len(params))]
        return {"params": params, "opt_state": opt_state, "t": self.t, "extra": {}}

    def fixed_load_state_dict(self, state):
        """Afterwards every context holds its pieces of `state`; CheckpointError if it does not fit."""
        want = [v.shape for v in self.fixed_state_dict()["params"]]
        got = [tuple(np.shape(v)) for v in state["params"]]
        if got != want or any(len(s) != len(self.states[0][0][0]) for s in state["opt_state"]):
            raise CheckpointError(f"the checkpoint's parameters {got} or optimiser state do not fit "
                                  f"this run's {want}")
        slots = len(self.states[0][0][0])
        for P_row, S_row in zip(self.shards, self.states):
            for j, (P, S) in enumerate(zip(P_row, S_row)):
                for p, v in zip(P, cut(state["params"], self.split, self.Q, self.T, j)):
                    p[:] = nd.array(v, ctx=p.context)
                for s in range(slots):
                    values = cut([st[s] for st in state["opt_state"]], self.split, self.Q, self.T, j)
                    for st, v in zip(S, values):
                        st[s][:] = nd.array(v, ctx=st[s].context)
        self.t = state["t"]
