"""Local SGD and DiLoCo: every replica takes H optimiser steps on its own shards, then they meet.

    inner   replica k steps with --optimizer on the mean gradient of its own shard, with its own
            optimiser state and no communication: its parameters W_k drift away from the others'
    sync    every H inner steps one all-reduce gives A = sum_k (c_k / c) W_k (c_k: the examples
            replica k took since the last sync, c: all of them, on every process), the average
            change is the pseudo-gradient D = G - A, and the outer optimiser moves the global
            parameters G with it:
                sgd       G <- G - lr_out D          (computed as (1 - lr_out) G + lr_out A)
                nesterov  m <- mu m + D;  G <- G - lr_out (D + mu m)     (DiLoCo: 0.7, 0.9)
            then every replica starts again from G; each keeps its own inner optimiser state.

With H = 1, outer sgd and lr_out = 1, G is the examples-weighted average of replicas that each took
one step from G: for sgd and momentum (linear in the gradient) that is sync's step, up to the order
of float additions, and with one replica it is the one-device step bit for bit for every optimiser
((1 - 1) G + A is exactly A). Adam is not linear: at H = 1 over several replicas it is "local
Adam", an algorithm of its own. A period still open at the end of an epoch is synced there, so
evaluation and checkpoints see the average; an epoch records its communication rounds.

A model with BatchNorm: each replica normalises its shard with its shard's statistics (as sync's
per-context default) and folds them into running statistics of its own; a sync averages those
with the same weights c_k / c (statistics are not trained: no outer step), and evaluation and
checkpoints read the average. At H = 1 with sgd that is sync's per-context BatchNorm.
"""
import numpy as np
from mxnet import autograd, nd

from ...config import FAST_STEP, RunConfig
from ...errors import CheckpointError
from ...fast.collectives import make_allreduce
from ...fast.flat import FlatReplica, views
from ...fast.prefetch import host
from ...lesson import forward_backward, shard_sizes, split_and_load
from ...models.contract import count_correct, example_loss
from ...models import as_model
from ...models.batchnorm import Moments
from ...optim import apply_update_and_clear, init_states
from ...replicas import fingerprint
from ..base import Strategy
from .data_parallel import load_into
from ..running import RunningStats

OUTER_OPTIMIZERS = ("sgd", "nesterov")


class LocalSGD(RunningStats, Strategy):
    """A replica per context stepping on its own shards; every `sync_every` steps the averaged change
    is applied to the global parameters by the outer optimiser (`outer_optimizer`, `outer_lr`,
    `outer_momentum`). allreduce_fn sums the replicas' weighted parameters (and, from
    World.reducer, every process's)."""

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, sync_every=1, outer_optimizer="sgd",
                 outer_lr=1.0, outer_momentum=0.9, allreduce_fn=None, model=None):
        if sync_every < 1 or not outer_lr > 0 or outer_optimizer not in OUTER_OPTIMIZERS:
            raise ValueError(f"local SGD needs sync_every >= 1, outer_lr > 0 and an outer optimiser in "
                             f"{OUTER_OPTIMIZERS}: got {sync_every}, {outer_lr}, {outer_optimizer!r}")
        self.ctx, self.optimizer, self.sync_every = list(ctx), optimizer, sync_every
        self.net = as_model(model, params)
        self.outer_optimizer, self.outer_lr, self.outer_momentum = outer_optimizer, outer_lr, outer_momentum
        self.allreduce_fn = allreduce_fn or make_allreduce(FAST_STEP["allreduce"])
        self.flat = [FlatReplica(params, c) for c in self.ctx]           # W_k: (N,) and its views
        self.inner = [init_states([f.flat], optimizer)[0] for f in self.flat]
        self.outer = [f.flat.copy() for f in self.flat]                   # G, the same on every context
        self.outer_views = [views(G, self.flat[0].shapes) for G in self.outer]
        self.momentum = [nd.zeros(G.shape, ctx=G.context) for G in self.outer]
        self.keep_running(False, self.allreduce_fn)          # running[k]: replica k's own statistics
        self.global_running = [[r.copy() for r in R] for R in self.running] if self.running else None
        self.t, self.rounds = 0, 0
        self.reset_period()

    def reset_period(self):
        """No examples, inner steps or pending gradients since the last sync."""
        k = len(self.ctx)
        self.pending, self.counts, self.steps, self.examples = [0] * k, [0] * k, 0, 0

    def backward(self, X, y):
        """Every replica's forward and backward on its shard, against its own parameters."""
        sizes = shard_sizes(len(X), len(self.ctx))
        self.pending = [p + n for p, n in zip(self.pending, sizes)]
        X_shards, y_shards = split_and_load(host(X), self.ctx), split_and_load(host(y), self.ctx)
        if self.running:                                      # each shard its own statistics
            return self.grouped_forward_backward(X_shards, y_shards, [f.params for f in self.flat], each=True)
        return forward_backward(X_shards, y_shards, [f.params for f in self.flat], self.net.forward, example_loss, count_correct)

    def update(self, lr, n_examples):
        """Every replica steps on its own gradient / its own examples; every H steps, a sync."""
        self.t += 1
        for f, s, n in zip(self.flat, self.inner, self.pending):
            apply_update_and_clear([f.flat], [s], self.optimizer, lr, self.t, n)
        self.counts = [c + n for c, n in zip(self.counts, self.pending)]
        self.pending, self.steps = [0] * len(self.ctx), self.steps + 1
        self.examples += n_examples                # every process's: update is told the global count
        if self.steps == self.sync_every:
            self.sync()

    def grad_buffers(self, i):
        """The array holding replica i's gradients: its one flat buffer."""
        return [self.flat[i].grad]

    def sync(self):
        """One communication round: afterwards G has taken the outer step and every W_k == G."""
        shares = [f.flat * (c / self.examples) for f, c in zip(self.flat, self.counts)]   # (N,) each
        self.allreduce_fn(shares)                                                    # each holds A
        for f, G, m, A in zip(self.flat, self.outer, self.momentum, shares):
            self.outer_step(G, m, A)
            G.copyto(f.flat)
        if self.running:
            self.average_running()
        self.rounds += 1
        self.reset_period()

    def average_running(self):
        """Afterwards the global running statistics and every replica's hold the replicas' average,
        weighted as the parameters are."""
        shares = [nd.concat(*[r.reshape((-1,)) for r in R], dim=0) * (c / self.examples)
                  for R, c in zip(self.running, self.counts)]
        self.allreduce_fn(shares)
        for R, G, avg in zip(self.running, self.global_running, shares):
            at = 0
            for r, g in zip(R, G):
                value = avg[at:at + r.size].reshape(r.shape)
                at += r.size
                value.copyto(r)
                value.copyto(g)

    def outer_step(self, G, m, A):
        """G moved by the pseudo-gradient G - A with the outer optimiser (m: nesterov's momentum)."""
        lr, mu = self.outer_lr, self.outer_momentum
        if self.outer_optimizer == "sgd":
            G[:] = (1 - lr) * G + lr * A           # G - lr (G - A); exactly A at lr = 1
            return
        D = G - A
        m[:] = mu * m + D
        G[:] -= lr * (D + mu * m)

    def end_epoch(self, lr):
        """Sync an open period; the epoch's communication rounds (all-reduces of the parameters)."""
        if self.steps:
            self.sync()
        rounds, self.rounds = self.rounds, 0
        return {"comm_rounds": rounds}

    def correct(self, X, y):
        """Correct predictions of the global parameters G, sharded over every context."""
        ctx = self.ctx[:min(len(self.ctx), len(X))]
        Xs, ys = split_and_load(X, ctx), split_and_load(y, ctx)
        with autograd.train_mode():        # oneDNN's inference mode reorders weight views in place (loop.evaluate)
            scores = self.net.forward_group(Xs, self.outer_views[:len(ctx)], Moments(False, self.global_running)) \
                if self.running else [self.net.forward(X_, W) for X_, W in zip(Xs, self.outer_views)]
        counts = [count_correct(s, y_).copyto(ctx[0]) for s, y_ in zip(scores, ys)]
        return nd.add_n(*counts) if len(counts) > 1 else counts[0]

    def fingerprints(self):
        """Only G's copies: the replicas differ from each other between syncs by design."""
        out = {"global parameters": [fingerprint(c, W, self.net.names()) for c, W in zip(self.ctx, self.outer_views)]}
        if self.running:
            names = [p.name for p in self.net.stats()]
            out["global running statistics"] = [fingerprint(c, G, names) for c, G in zip(self.ctx, self.global_running)]
        return out

    def layout(self, batch_size):
        """Every context runs both stages on its shard of the batch."""
        sizes = shard_sizes(batch_size, len(self.ctx))
        return [(c, s, n) for c, n in zip(self.ctx, sizes) for s in (0, 1)]

    def arrays(self):
        states = [s for S in self.inner for s in S]
        stats = [r for R in (self.running or []) + (self.global_running or []) for r in R]
        return {"param": [f.flat for f in self.flat] + self.outer,
                "state": [f.grad for f in self.flat] + states + self.momentum + stats}

    per_process_extra = ("local_replicas", "local_inner_state", "local_running")   # each process's own replicas

    def state_dict(self):
        """params: G; opt_state: the replicas' mean inner state; extra: every replica's parameters
        and inner state, the outer momentum and where the period stands (resumes exactly)."""
        period = [self.steps, self.examples, self.rounds] + self.counts
        return {"params": [p.asnumpy() for p in self.outer_views[0]], "opt_state": self.mean_inner_state(),
                "t": self.t,
                "extra": {"local_replicas": [f.flat.asnumpy() for f in self.flat],
                          "local_inner_state": [s.asnumpy() for S in self.inner for s in S],
                          "local_outer_momentum": [self.momentum[0].asnumpy()],
                          "local_period": [np.array(period, dtype=np.int64)],
                          **self.running_extra()}}

    def running_extra(self):
        """A model with BatchNorm: the global running statistics (what another mode resumes from)
        and every replica's own (this strategy's exact resume)."""
        if not self.running:
            return {}
        return {"running": [g.asnumpy() for g in self.global_running[0]],
                "local_running": [r.asnumpy() for R in self.running for r in R]}

    def mean_inner_state(self, inner=None):
        """[[arrays] per parameter]: the replicas' inner optimiser state (inner[r][j]: replica r's
        state j, flat; default this process's replicas), averaged in float64 (so that equal states
        give exactly their own value)."""
        inner = inner if inner is not None else [[s.asnumpy() for s in S] for S in self.inner]
        shapes = self.flat[0].shapes
        per_state = [views_np(np.mean([S[j] for S in inner], axis=0, dtype=np.float64)
                              .astype(np.float32), shapes) for j in range(len(self.inner[0]))]
        return [list(st) for st in zip(*per_state)] if per_state else [[] for _ in shapes]

    def job_state(self, state):
        """opt_state: the mean inner state of every process's replicas (extra's gathered
        local_inner_state), as one process with all of them would save it."""
        saved, n = state["extra"]["local_inner_state"], len(self.inner[0])
        if not n:
            return state
        return dict(state, opt_state=self.mean_inner_state([saved[i:i + n] for i in range(0, len(saved), n)]))

    def load_state_dict(self, state):
        """Exactly this strategy's run from its own state_dict with as many replicas; from any other
        (another mode's, or one taken at a sync with another replica count) every replica starts
        from G with the saved inner state."""
        for f, S in zip(self.flat, self.inner):
            load_into(f.params, f.state_views(S), state)
        for f, G in zip(self.flat, self.outer):
            f.flat.copyto(G)
        self.load_running(state)                             # every replica's from the global ones
        for R, G in zip(self.running or [], self.global_running or []):
            for r, g in zip(R, G):
                r.copyto(g)
        self.t, self.rounds = state["t"], 0
        self.reset_period()
        extra = state.get("extra", {})
        saved = extra.get("local_outer_momentum")
        for m in self.momentum:
            m[:] = nd.array(saved[0], ctx=m.context) if saved else 0
        if "local_replicas" in extra:
            self.load_period(extra)

    def load_period(self, extra):
        """The replicas, their inner state and the period's counters, from this strategy's extra."""
        steps, examples, rounds, *counts = (int(v) for v in extra["local_period"][0])
        processes = int(extra.get("processes", [[1]])[0][0])     # set by a multi-process job's wrapper
        if len(counts) != len(self.ctx) or processes != 1:
            if steps:
                where = f" in each of {processes} processes" if processes > 1 else ""
                raise CheckpointError(f"the checkpoint was taken between syncs of {len(counts)} local SGD "
                                      f"replicas{where}; this run has {len(self.ctx)}"
                                      f"{' in one process' if processes > 1 else ''}")
            return
        for f, W in zip(self.flat, extra["local_replicas"]):
            f.flat[:] = nd.array(W, ctx=f.flat.context)
        saved = iter(extra["local_inner_state"])
        for s in (s for S in self.inner for s in S):
            s[:] = nd.array(next(saved), ctx=s.context)
        saved = iter(extra.get("local_running", []))
        for r in (r for R in self.running or [] for r in R):
            r[:] = nd.array(next(saved), ctx=r.context)
        self.steps, self.examples, self.rounds, self.counts = steps, examples, rounds, counts


def views_np(flat, shapes):
    """numpy arrays of `shapes` cut one after the other from the 1-D `flat`."""
    sizes = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
    return [flat[a:b].reshape(s) for a, b, s in zip(sizes[:-1], sizes[1:], shapes)]
