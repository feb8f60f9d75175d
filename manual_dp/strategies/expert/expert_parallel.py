"""Expert parallelism: len(ctx) // N groups of N contexts; in each group context j holds experts
j E/N .. (j + 1) E/N - 1 of every MoE block (their w1, b1, w2, b2: Model.expert_params, cut along
axis 0) and a copy of every other parameter. Every context is a data-parallel place: it takes its
own rows of the batch, routes them (per window, as one context does: the same tokens dropped), and
meets its group only in each MoE block's two all-to-alls (exchange.py, Model.expert_forward).

The gradient. The all-to-all's backward brings to each expert's context the gradient of every
slot it computed, from the tokens of every context of its group; so after backward context j's
expert gradient is the sum over its group's rows. update() then sums each expert shard over its
replicas (context j of every group: dp / N copies) and every other parameter over every context,
as sync data parallelism does, and each context applies the same optimiser step to what it holds.
A checkpoint holds the whole parameters in the model's order (the shards joined), so it moves
between this and any other layout.
"""
from mxnet import autograd, nd

from ...config import FAST_STEP, RunConfig
from ...errors import CheckpointError
from ...fast.collectives import make_allreduce
from ...fast.prefetch import host
from ...lesson import shard_sizes, split_and_load
from ...models import as_model, stateless
from ...models.contract import count_correct, example_loss
from ...optim import apply_update_and_clear, init_states
from ...replicas import fingerprint
from ..base import Strategy, placed
from .exchange import ExpertGroup


class ExpertParallel(Strategy):
    """Expert parallelism over `ctx`: groups of `expert_parallel` contexts (None: every context, one
    group), the experts of `model` (an MoE GPT) sharded over each; allreduce_fn sums the gradients
    of the copies of each parameter (the replicated ones over every context, an expert shard over
    the groups)."""

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, expert_parallel=None, allreduce_fn=None,
                 model=None):
        self.ctx, self.optimizer, self.t = list(ctx), optimizer, 0
        self.net = as_model(model, params)
        N = self.N = expert_parallel or len(self.ctx)
        E = getattr(self.net, "experts", None)
        if not E:
            raise ValueError(f"--mode expert shards the experts of an MoE: --model {self.net.name} has none "
                             f"(give --model gpt --experts E)")
        stateless(self.net, "--mode expert")
        if len(self.ctx) % N:
            raise ValueError(f"--expert-parallel {N} does not divide {len(self.ctx)} contexts")
        self.groups = [ExpertGroup(self.ctx[r:r + N], E.experts) for r in range(0, len(self.ctx), N)]
        self.sharded = set(self.net.expert_params())
        self.allreduce_fn = allreduce_fn or make_allreduce(FAST_STEP["allreduce"])
        values = [p.asnumpy() for p in params]
        self.params = [placed(self.shard(values, j), c) for g in self.groups for j, c in enumerate(g.ctx)]
        self.states = [init_states(P, optimizer) for P in self.params]

    def shard(self, values, j):
        """The values context j of a group holds: its experts' rows of the sharded, the rest whole."""
        return [self.shard_one(v, i, j) for i, v in enumerate(values)]

    def shard_one(self, value, i, j):
        """Context j's part of parameter i's `value` (or of an optimiser state of its shape)."""
        per = self.groups[0].experts // self.N
        return value[j * per:(j + 1) * per] if i in self.sharded else value

    def in_groups(self, items):
        """items (one per context, in rank order) cut into the groups' runs."""
        return [items[r:r + self.N] for r in range(0, len(items), self.N)]

    def scores(self, Xs):
        """Every context's scores of its rows Xs[c], group by group."""
        return [s for g, P, X in zip(self.groups, self.in_groups(self.params), self.in_groups(Xs))
                for s in self.net.expert_forward(X, P, g)]

    def backward(self, X, y):
        """Every context its rows of the batch; forward through the groups' all-to-alls, then backward."""
        Xs, ys = split_and_load(host(X), self.ctx), split_and_load(host(y), self.ctx)
        with autograd.record():
            scores = self.scores(Xs)
            losses = [example_loss(s, yc).sum() for s, yc in zip(scores, ys)]
        autograd.backward(losses)
        return [(l, count_correct(s, yc)) for l, s, yc in zip(losses, scores, ys)]

    def copies_of(self, i):
        """The copies of parameter i whose gradients are summed: every context's, or an expert
        shard's on each group (a list of such lists)."""
        if i in self.sharded:
            return [[P[i] for P in self.params[j::self.N]] for j in range(self.N)]
        return [[P[i] for P in self.params]]

    def update(self, lr, n_examples):
        """Sum each parameter's gradient over its copies, then the same optimiser step on each."""
        for i in range(len(self.params[0])):
            for copies in self.copies_of(i):
                if len(copies) > 1:
                    self.allreduce_fn([p.grad for p in copies])
        self.t += 1
        n_examples = self.counted(n_examples)
        for P, S in zip(self.params, self.states):
            apply_update_and_clear(P, S, self.optimizer, lr, self.t, n_examples)

    def whole(self, arrays, i):
        """Parameter i's arrays[c] (one per context: its values, gradient or a state) whole, on the
        first context: an expert parameter's shards of the first group joined along the experts."""
        if i not in self.sharded:
            return arrays[0]
        return nd.concat(*[a.as_in_context(self.ctx[0]) for a in arrays[:self.N]], dim=0)

    def reduced_grads(self):
        """The summed gradient of every parameter, whole, on the first context."""
        return [self.whole([P[i].grad for P in self.params], i) for i in range(len(self.params[0]))]

    def correct(self, X, y):
        """Correct predictions on (X, y): every context its rows; a batch shorter than the contexts
        is padded with copies of its rows (each window is routed alone), counted once."""
        n = X.shape[0]
        take = [r % n for r in range(max(n, len(self.ctx)))]
        Xp, yp = (nd.array(a, ctx=self.ctx[0]) if not isinstance(a, nd.NDArray) else a for a in (X, y))
        if len(take) > n:
            rows = nd.array(take, ctx=Xp.context, dtype="int64")
            Xp, yp = nd.take(Xp, rows), nd.take(yp, rows)
        Xs, ys = split_and_load(Xp, self.ctx), split_and_load(yp, self.ctx)
        counts, start = [], 0
        for s, yc in zip(self.scores(Xs), ys):
            real = max(0, min(yc.shape[0], n - start))
            start += yc.shape[0]
            if real:
                counts.append(count_correct(s[:real], yc[:real]).copyto(self.ctx[0]))
        return nd.add_n(*counts) if len(counts) > 1 else counts[0]

    def fingerprints(self):
        """The replicated parameters on every context; each expert shard on each group."""
        names, P = self.net.names(), self.params
        rest = [i for i in range(len(P[0])) if i not in self.sharded]
        out = {"replicas": [fingerprint(c, [W[i] for i in rest], [names[i] for i in rest])
                            for c, W in zip(self.ctx, P)]}
        for j, g in enumerate(self.groups[0].ctx):
            out[f"expert shard {j}"] = [fingerprint(c, [W[i] for i in sorted(self.sharded)],
                                                    [names[i] for i in sorted(self.sharded)])
                                        for c, W in zip(self.ctx[j::self.N], P[j::self.N])]
        return out

    def layout(self, batch_size):
        """Every context runs every layer on its rows of the batch."""
        every = tuple(range(len(self.net.layers)))
        return [(c, every, n) for c, n in zip(self.ctx, shard_sizes(batch_size, len(self.ctx)))]

    def arrays(self):
        params = [p for P in self.params for p in P]
        return {"param": params, "grad": [p.grad for p in params],
                "state": [s for S in self.states for st in S for s in st]}

    def state_dict(self):
        """The whole parameters and optimiser state, in the model's order (the shards joined)."""
        n = len(self.params[0])
        states = [[self.whole([S[i][k] for S in self.states], i).asnumpy() for k in range(len(self.states[0][i]))]
                  for i in range(n)]
        return {"params": [self.whole([P[i] for P in self.params], i).asnumpy() for i in range(n)],
                "opt_state": states, "t": self.t, "extra": {}}

    def load_state_dict(self, state):
        """Each context takes its shards of the whole parameters and optimiser state."""
        n = len(self.params[0])
        if len(state["params"]) != n or any(len(a) != len(b) for a, b in zip(state["opt_state"], self.states[0])):
            raise CheckpointError("the checkpoint's parameters or optimiser state do not fit this run")
        for c, (P, S) in enumerate(zip(self.params, self.states)):
            for i, (p, st) in enumerate(zip(P, S)):
                p[:] = nd.array(self.shard_one(state["params"][i], i, c % self.N), ctx=p.context)
                for s, value in zip(st, state["opt_state"][i]):
                    s[:] = nd.array(self.shard_one(value, i, c % self.N), ctx=s.context)
        self.t = state["t"]
