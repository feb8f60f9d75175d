"""Context x tensor parallelism at once (dp x cp x tp; picotron's and torchtitan's grid without the
pipeline): each context of a C x T grid holds block c of every sequence's tokens and tensor shard t
of every split layer.

Each row of the grid (the contexts of one block of tokens) is a tensor group, joined by Megatron's f
and g; each column (the contexts of one tensor rank) is a context-parallel group, whose blocks meet
in attention (ring or Ulysses, over rank t's heads) and in the pooling over tokens
(Model.grid_forward; the transformer's blocks have a grid_forward). Every context backpropagates
1/C of the loss, as in context parallelism; a parameter on rank t sees only block c's tokens, so its
gradient is summed over the column and over the replicas (dp), not over the row: the rows of a
tensor group are replicas of what is not split, as in tensor parallelism.

With --deterministic's FixedSums (`sums`) the sequence is in K lanes and every split layer in Q
pieces, each sum in a fixed tree: the bits of one context's step (grid_sums.py).
"""
import numpy as np
from mxnet import autograd, nd

from ...config import FAST_STEP, SEQUENCE_PIECES, RunConfig
from ...errors import CheckpointError
from ...fast.collectives import make_allreduce
from ...fast.prefetch import host
from ...fast.tensor_ops import Join
from ...lesson import split_and_load
from ...models.contract import example_loss, count_correct
from ...mesh import Mesh
from ...models import stateless
from ...optim import apply_update_and_clear, init_states
from ...replicas import fingerprint
from ..base import Strategy, placed
from .context import Sequence
from .grid_sums import FixedGrid
from ..zero.dp_zero import DataShardedOptimizer, backward, gathered, peak
from ..tensor.tensor_layout import copies, grid_layout, shard, unshard


class ContextTensorParallel(FixedGrid, Strategy):
    """len(ctx) // (C T) data-parallel grids; replica r's block c, tensor rank t on
    ctx[mesh.rank(dp=r, cp=c, tp=t)]. allreduce_fn sums over the replicas and the column;
    group_allreduce is f's, g's and the pooling's, inside the grid. sums: None, those sums; or
    --deterministic's FixedSums: the sequence in `sequence_pieces` lanes, K/C a grid row, every split
    layer in the policy's tensor_pieces, all in fixed trees (grid_sums.py)."""

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, context_parallel=2, tensor_parallel=2,
                 attention="ring", allreduce_fn=None, group_allreduce=None, model=None, zero_stage=0, sums=None,
                 sequence_pieces=SEQUENCE_PIECES):
        self.sums = sums
        if sums:
            self.hold_grid(params, ctx, optimizer, context_parallel, tensor_parallel, attention, sequence_pieces, model)
            return
        net = self.net = stateless(model, "--mesh cp x tp")
        self.C, self.T = C, T = context_parallel, tensor_parallel
        n = len(ctx)
        if n % (C * T):
            raise ValueError(f"cp={C} x tp={T} does not divide the {n} contexts")
        refusal = net.grid_refusal(C, T, attention)
        if refusal:
            raise ValueError(f"--mesh cp={C},tp={T}: {refusal}")
        self.ctx, self.optimizer, self.t = list(ctx), optimizer, 0
        self.mesh = Mesh(dp=n // (C * T), cp=C, tp=T)
        self.allreduce_fn = allreduce_fn or make_allreduce(FAST_STEP["allreduce"])
        inside = group_allreduce or make_allreduce(FAST_STEP["allreduce"])
        self.join, self.seq = Join(inside), Sequence(net.tokens, C, attention, inside, net.causal)
        self.grids = [[[self.ctx[self.mesh.rank(dp=r, cp=c, tp=t)] for t in range(T)] for c in range(C)]
                      for r in range(self.mesh.dp)]                                  # grids[r][c][t]
        self.split = [p.split for p in net.param_table()]
        values = [p.asnumpy() for p in params]
        self.params = [[[placed([shard(v, a, t, T) for v, a in zip(values, self.split)], c)
                         for t, c in enumerate(row)] for row in grid] for grid in self.grids]
        groups = [g for _, g in self.copy_groups()]
        self.zero = DataShardedOptimizer(groups, optimizer, zero_stage) if zero_stage else None
        self.states = None if self.zero else [[[init_states(P, optimizer) for P in row] for row in grid]
                                              for grid in self.params]

    def copy_groups(self):
        """[((t, i), arrays)]: tensor shard t of parameter i on every replica and block: summed."""
        return [((t, i), [grid[c][t][i] for grid in self.params for c in range(self.C)])
                for t in range(self.T) for i in range(len(self.split))]

    def every(self):
        """(context, parameters, optimiser states) of every context."""
        states = self.states or [[[None] * self.T] * self.C] * len(self.params)
        return [(c, P, S) for grid, pgrid, sgrid in zip(self.grids, self.params, states)
                for row, prow, srow in zip(grid, pgrid, sgrid) for c, P, S in zip(row, prow, srow)]

    @property
    def batch_places(self):
        """A grid of cp x tp a place (strategies/base.py)."""
        return self.mesh.dp

    def scores(self, grid, P, X):
        return self.net.grid_forward([copies(X, row) for row in grid], P, self.join, self.seq)

    def backward(self, X, y):
        if self.sums:
            return self.lane_backward(X, y)
        heads, metrics, firsts = [], [], [g[0][0] for g in self.grids]
        with gathered(self.zero):
            with autograd.record():
                for grid, P, Xg, yg in zip(self.grids, self.params, split_and_load(host(X), firsts),
                                           split_and_load(host(y), firsts)):
                    scores, ys = self.scores(grid, P, Xg), [copies(yg, row) for row in grid]
                    losses = [[example_loss(s, yj).sum() for s, yj in zip(srow, yrow)]
                              for srow, yrow in zip(scores, ys)]
                    heads += [l * (1 / self.C) for row in losses for l in row]
                    metrics.append((losses[0][0], count_correct(scores[0][0], ys[0][0])))
            backward(heads, [p for _, P, _ in self.every() for p in P], self.zero)
        return metrics

    def update(self, lr, n_examples):
        """Each shard's gradient summed over its column and the replicas (--deterministic: the
        tree's); one step everywhere."""
        if self.sums:
            return self.fixed_update(lr, n_examples)
        self.t += 1
        if self.zero:
            self.zero.step(lr, self.t, self.counted(n_examples))
            return
        for _, arrays in self.copy_groups():
            self.allreduce_fn([a.grad for a in arrays])
        n_examples = self.counted(n_examples)
        for _, P, S in self.every():
            apply_update_and_clear(P, S, self.optimizer, lr, self.t, n_examples)

    def whole(self, get):
        """Replica 0's block 0's shards joined, in the model's order: get(t, i) an NDArray."""
        home = self.ctx[0]
        return [nd.concat(*[get(t, i).as_in_context(home) for t in range(self.T)], dim=a)
                if a is not None and self.T > 1 else get(0, i) for i, a in enumerate(self.split)]

    def reduced_grads(self):
        if self.sums:
            return self.fixed_grads()
        if self.zero:
            total = {key: self.zero.total(g, self.ctx[0]) for g, (key, _) in enumerate(self.copy_groups())}
            return self.whole(lambda t, i: total[(t, i)])
        return self.whole(lambda t, i: self.params[0][0][t][i].grad)

    def correct(self, X, y):
        if self.sums:
            return self.lane_correct(X, y)
        grids = self.grids[:min(len(self.grids), X.shape[0])]
        counts = []
        with gathered(self.zero):
            for grid, P, Xg, yg in zip(grids, self.params, split_and_load(X, [g[0][0] for g in grids]),
                                       split_and_load(y, [g[0][0] for g in grids])):
                counts.append(count_correct(self.scores(grid, P, Xg)[0][0], yg).copyto(self.ctx[0]))
        return nd.add_n(*counts) if len(counts) > 1 else counts[0]

    def fingerprints(self):
        if self.sums:
            return self.fixed_fingerprints()
        names = self.net.names()
        with gathered(self.zero):
            return {f"tensor shard {t}": [fingerprint(c, P, names) for c, P, _ in self.every()
                                          if self.mesh.coords(self.ctx.index(c))["tp"] == t] for t in range(self.T)}

    def layout(self, batch_size):
        """Each context: 1/(C T) of its grid's examples' activations (a floor, as tensor's and
        context's own layouts without what every context holds whole)."""
        return grid_layout(self.grids, len(self.net.layers), batch_size)

    def arrays(self):
        if self.sums:
            return self.fixed_arrays()
        params = [p for _, P, _ in self.every() for p in P] + (self.zero.param_arrays() if self.zero else [])
        state = self.zero.state_arrays() if self.zero else [s for _, _, S in self.every() for st in S for s in st]
        return {"param": params, "grad": self.zero.grad_arrays() if self.zero else [p.grad for p in params],
                "state": state}

    def peak_arrays(self):
        return peak(self.arrays(), self.zero)

    def state_dict(self):
        if self.sums:
            return self.fixed_state_dict()
        with gathered(self.zero):
            params = [a.asnumpy() for a in self.whole(lambda t, i: self.params[0][0][t][i])]
        if self.zero:
            whole = {key: self.zero.whole_state(g) for g, (key, _) in enumerate(self.copy_groups())}
            opt = [[unshard([whole[(t, i)][k] for t in range(self.T)], a) for k in range(len(whole[(0, i)]))]
                   for i, a in enumerate(self.split)]
        else:
            S = self.states[0][0]
            opt = [[unshard([S[t][i][k].asnumpy() for t in range(self.T)], a) for k in range(len(S[0][i]))]
                   for i, a in enumerate(self.split)]
        return {"params": params, "opt_state": opt, "t": self.t, "extra": {}}

    def load_state_dict(self, state):
        if self.sums:
            return self.fixed_load_state_dict(state)
        mine = self.state_dict()
        with gathered(self.zero, keep=True):
            self.load_wholes(state, mine)

    def load_wholes(self, state, mine):
        if [np.shape(v) for v in state["params"]] != [np.shape(v) for v in mine["params"]] or \
                [len(s) for s in state["opt_state"]] != [len(s) for s in mine["opt_state"]]:
            raise CheckpointError("the checkpoint's parameters or optimiser state do not fit this run")
        for c, P, S in self.every():
            t = self.mesh.coords(self.ctx.index(c))["tp"]
            for i, a in enumerate(self.split):
                P[i][:] = nd.array(shard(state["params"][i], a, t, self.T), ctx=c)
                for s, v in zip(S[i] if S else (), state["opt_state"][i]):
                    s[:] = nd.array(shard(v, a, t, self.T), ctx=c)
        if self.zero:
            for g, ((t, i), _) in enumerate(self.copy_groups()):
                self.zero.load_state(g, [shard(v, self.split[i], t, self.T) for v in state["opt_state"][i]])
        self.t = state["t"]
