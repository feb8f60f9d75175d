"""ZeRO (Rajbhandari et al., 2020): data parallelism whose contexts stop holding k copies of the same
state. The model's parameters as one flat vector of N elements (fast.flat's order) are cut into k
contiguous shards (collectives.chunk_bounds: sizes differ by at most one, N need not divide by k);
context i owns shard i of whatever is sharded:

                 parameters   gradients    optimiser state
    sync         full         full         full           every context updates everything
    stage 1      full         full         shard i        reduce-scatter the gradients, update
                                                          shard i, all-gather the parameters
    stage 2      full         shard i      shard i        each layer's gradient reduce-scattered
                                                          as its backward ends, then dropped
    stage 3      shard i      shard i      shard i        each layer's parameters all-gathered
                                                          before its forward and its backward

Every stage computes the sync step (the same sums, in another order). Stages 2 and 3 run the model
a layer at a time (strategies.zero_layers). peak_arrays() adds to arrays() the transient arrays
(gathered parameters, a layer's gradients) held at the step's largest moment. Across processes
(cross_sum) each process holds the same shards and the owned gradient shards are summed across
processes before the update: ZeRO inside a process, data parallel across them. Under --precision
bf16|fp16, strategies.zero_mixed keeps these shards in DeepSpeed's mixed-precision layout. A model
with running statistics (BatchNorm) keeps them whole on every context (strategies.running), as sync
does: stage 1 runs every context's forward at once, stages 2 and 3 each layer on every context at once.
Given --deterministic's FixedSums, every sum over the batch is taken in its fixed tree (zero_sums.py).
"""
import functools
from collections import namedtuple

import numpy as np
from mxnet import autograd, nd

from ...config import FAST_STEP, RunConfig
from ...errors import CheckpointError
from ...fast.collectives import DIRECT, chunk_bounds, make_allreduce
from ...fast.flat import FlatReplica, offsets, views
from ...fast.prefetch import host
from ...fast.sharded import ALL_GATHER, REDUCE_SCATTER, empty_shards
from ...lesson import forward_backward, shard_sizes, split_and_load
from ...models.contract import count_correct, example_loss
from ...models import as_model
from ...optim import OPTIMIZERS, init_states
from ...replicas import fingerprint
from . import zero_layers
from ..base import Strategy
from ..running import RunningStats
from .zero_sums import FixedZero

Held = namedtuple("Held", "context shape size dtype")     # what memory.per_context reads of an array


class Peak:
    """The largest set of transient arrays held at one moment of a step, as Held records (so
    nothing is kept alive): {"param": [...], "state": [...]}."""

    def __init__(self):
        self.bytes, self.held = 0, {"param": [], "state": []}

    def note(self, params, grads):
        held = {kind: [Held(a.context, a.shape, a.size, a.dtype) for a in arrays]
                for kind, arrays in (("param", params), ("state", grads))}
        total = sum(h.size * np.dtype(h.dtype).itemsize for hs in held.values() for h in hs)
        if total > self.bytes:
            self.bytes, self.held = total, held


class ZeroRedundancy(RunningStats, FixedZero, Strategy):
    """ZeRO stage 1, 2 or 3 over the contexts `ctx`; collective: "ring" or "naive" (fast.sharded);
    cross_sum(array, key): a sum across processes, or None in one process; model: the network
    (manual_dp.models; None: the lesson's LeNet of the parameters' width). A model with running
    statistics: sync_batchnorm as DataParallel's; stats_reduce(arrays) the all-reduce of its
    statistics over the contexts (and processes: give it when cross_sum is given). sums: None; or
    --deterministic's FixedSums (strategies/sums/fixed_sums.py): every sum over the batch in its
    one tree, each shard's part of it on its context, across processes by the policy's exchange
    (cross_sum not read): the bits of DataParallel given it (zero_sums.py); graph: whether its
    leaves run the cached graph (unpadded) rather than imperatively; wire: what carries every transfer
    of the sharded collectives (an EmulatedLink under --link; None: nothing added)."""

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, stage=1, collective="ring",
                 cross_sum=None, model=None, sync_batchnorm=False, stats_reduce=None, graph=True, sums=None,
                 wire=None):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO has stages 1, 2 and 3, not {stage}")
        self.ctx, self.optimizer, self.stage, self.cross_sum, self.t = list(ctx), optimizer, stage, cross_sum, 0
        self.shapes, self.net = [p.shape for p in params], as_model(model, params)
        self.keep_running(sync_batchnorm, stats_reduce or make_allreduce(FAST_STEP["allreduce"]))
        self.layer_slices = self.net.slices()
        self.offsets = offsets(self.shapes)                  # each parameter's start, then N
        if not 0 < len(self.ctx) <= self.offsets[-1]:
            raise ValueError(f"{len(self.ctx)} contexts cannot each own a shard of {self.offsets[-1]} parameters")
        self.bounds = chunk_bounds(int(self.offsets[-1]), len(self.ctx))
        self.reduce_scatter = functools.partial(REDUCE_SCATTER[collective], wire=wire or DIRECT)
        self.all_gather = functools.partial(ALL_GATHER[collective], wire=wire or DIRECT)
        self.keep(params, np.concatenate([p.asnumpy().reshape(-1) for p in params]))    # (N,)
        self.peak, self.sums = Peak(), sums
        if sums:
            self.keep_fixed(graph)

    def keep(self, params, flat):
        """Make what the stage keeps (the module's table): replicas (stage 1) or flats (stage 2),
        parameter shards (views of those, or arrays of their own in stage 3), gradient shards and
        the optimiser state of `masters`, the shards the update steps (here the parameter shards)."""
        stage, parts = self.stage, list(zip(self.ctx, self.bounds, self.bounds[1:]))
        self.replicas = [FlatReplica(params, c) for c in self.ctx] if stage == 1 else None
        self.flats = [r.flat for r in self.replicas] if stage == 1 else (
            [nd.array(flat, ctx=c) for c in self.ctx] if stage == 2 else None)
        self.shards = [f[a:b] for f, (_, a, b) in zip(self.flats, parts)] if self.flats \
            else [nd.array(flat[a:b], ctx=c) for c, a, b in parts]
        self.grad_shards = None if stage == 1 else empty_shards(len(flat), self.ctx)
        self.masters = self.shards
        self.states = [init_states([s], self.optimizer)[0] for s in self.masters]

    def layer_range(self, l):
        """[start, end) of layer l's parameters in the flat vector, and their shapes."""
        s = self.layer_slices[l]
        return int(self.offsets[s.start]), int(self.offsets[s.stop]), self.shapes[s]

    def overlap(self, start, end, shards):
        """(bounds, pieces): [start, end) of the flat vector cut where the shards cut it, and the
        view of shards[i] inside it (None where shard i has none of it)."""
        bounds = [min(max(b, start), end) - start for b in self.bounds]
        return bounds, [shard[lo + start - a:hi + start - a] if hi > lo else None
                        for shard, a, lo, hi in zip(shards, self.bounds, bounds, bounds[1:])]

    def fetch(self, l):
        """Layer l's parameters per context, new arrays each call: stage 2 views of the replica, stage 3 all-gathered."""
        start, end, shapes = self.layer_range(l)
        if start == end:                                                # a layer without parameters
            return [[] for _ in self.ctx]
        if self.stage == 2:
            return [views(f[start:end], shapes) for f in self.flats]
        full = [nd.empty((end - start,), ctx=c, dtype=self.shards[0].dtype) for c in self.ctx]   # (layer size,)
        bounds, pieces = self.overlap(start, end, self.shards)
        self.all_gather(full, pieces, bounds)
        return [views(f, shapes) for f in full]

    def reduce(self, l, grad_of):
        """Layer l's gradient reduce-scattered one shard's part at a time (so that only that part
        exists): the part [lo, hi) context i owns, made on every context by grad_of, summed onto
        context i (a reduce-scatter whose other chunks are empty), added into its gradient shard."""
        start, end, _ = self.layer_range(l)
        bounds, pieces = self.overlap(start, end, self.grad_shards)
        for i, piece in enumerate(pieces):
            if piece is not None:
                self.add_sum(grad_of(bounds[i], bounds[i + 1]), piece, i)      # (hi - lo,) per context

    def add_sum(self, local, piece, i):
        """Afterwards `piece` (on context i) holds itself plus the sum of `local` (one array of its
        size per context): a reduce-scatter whose other chunks are empty."""
        total = [nd.empty(piece.shape, ctx=c, dtype=piece.dtype) if j == i else None for j, c in enumerate(self.ctx)]
        self.note([], local + [total[i]])
        self.reduce_scatter(local, total, [0] * (i + 1) + [piece.size] * (len(self.ctx) - i))
        nd.elemwise_add(piece, total[i], out=piece)

    def note(self, params, grads):
        """What the step holds besides arrays(): gathered parameters (stage 3) and gradients."""
        self.peak.note([p for Wb in params for p in Wb] if self.stage == 3 else [], grads)

    def backward(self, X, y):
        if self.sums:
            return self.fixed_backward(X, y)
        X_shards, y_shards = split_and_load(host(X), self.ctx), split_and_load(host(y), self.ctx)
        if self.stage == 1 and self.running:
            return self.grouped_forward_backward(X_shards, y_shards, [r.params for r in self.replicas])
        if self.stage == 1:
            return forward_backward(X_shards, y_shards, [r.params for r in self.replicas], self.net.forward, example_loss, count_correct)
        return zero_layers.forward_backward(X_shards, y_shards, self)

    def grads(self):
        """The gradient arrays kept: every replica's (stage 1), else the gradient shards."""
        return [r.grad for r in self.replicas] if self.stage == 1 else self.grad_shards

    def summed_here(self):
        """Per context, the gradient of its shard summed over this process's contexts."""
        if self.stage == 1:
            self.reduce_scatter([r.grad for r in self.replicas])        # in place: chunk i on context i
            return [r.grad[a:b] for r, a, b in zip(self.replicas, self.bounds, self.bounds[1:])]
        return self.grad_shards

    def owned_grads(self):
        """Per context, the gradient of its shard summed over every context (and process)."""
        grads = self.summed_here()
        for i, g in enumerate(grads) if self.cross_sum else ():
            self.cross_sum(g, f"zero-grad-{i}")
        return grads

    def update(self, lr, n_examples):
        """Each context updates its shard; stages 1 and 2 then all-gather the parameters."""
        self.t += 1
        if self.sums:
            self.fixed_update(lr, n_examples)
            return
        self.owned = self.owned_grads()
        n_examples = self.counted(n_examples)
        if n_examples is not None:
            self.apply(lr, n_examples)
        self.clear_grads()
        if self.flats:
            self.all_gather(self.flats)                                 # in place: shard i from context i
        self.owned = None

    def apply(self, lr, n_examples):
        """Afterwards each master shard and its optimiser state took the optimiser's step."""
        _, rule = OPTIMIZERS[self.optimizer]
        for p, g, state in zip(self.masters, self.owned, self.states):
            rule(p, g / n_examples, state, lr, self.t)

    def clear_grads(self):
        """Afterwards every kept gradient is zero, ready for the next backward to add into."""
        for g in self.grads():
            g[:] = 0

    def reduced_grads(self):
        """The owned gradient shards (with sums the tree-summed ones): together the flat gradient,
        once, in the model's order."""
        return [p.grad for p in self.shards] if self.sums else self.owned

    def correct(self, X, y):
        """Correct predictions on (X, y), sharded over the contexts (idle ones if X is tiny)."""
        ctx = self.ctx[:min(len(self.ctx), len(X))]
        X_shards, y_shards = split_and_load(X, ctx), split_and_load(y, ctx)
        moments = self.moments(False, len(ctx)) if self.running else None
        with autograd.train_mode():        # oneDNN's inference mode reorders weight views in place (loop.evaluate)
            if self.stage == 1:
                scores = self.net.forward_group(X_shards, [r.params for r in self.replicas[:len(ctx)]], moments) \
                    if moments else [self.net.forward(Xs, r.params) for Xs, r in zip(X_shards, self.replicas)]
            else:
                group = moments and (lambda l, hs, P, Fs: self.net.layer_group(l, hs, P, moments, Fs))
                scores = zero_layers.scores(X_shards, self.fetch, self.net.layers, group)
        counts = [count_correct(s, ys).copyto(ctx[0]) for s, ys in zip(scores, y_shards)]
        return nd.add_n(*counts) if len(counts) > 1 else counts[0]

    def fingerprints(self):
        """Stages 1, 2: every replica; stage 3: the one copy its shards make up (across processes
        it is compared with the other processes')."""
        if self.flats:
            return {"replica": [fingerprint(c, views(f, self.shapes), self.net.names()) for c, f in zip(self.ctx, self.flats)],
                    **self.running_fingerprints()}
        where = f"shards on {self.ctx[0]}..{self.ctx[-1]}"
        return {"shards": [fingerprint(where, [nd.array(p) for p in self.host_split(self.masters)], self.net.names())],
                **self.running_fingerprints()}

    def layout(self, batch_size):
        """Every context runs both stages on its shard of the batch."""
        return [(c, s, n) for c, n in zip(self.ctx, shard_sizes(batch_size, len(self.ctx))) for s in (0, 1)]

    def arrays(self):
        """What each context keeps between steps: its parameters (full, or its shard in stage 3), its
        gradients (full in stage 1, else its shard) and its shard of the optimiser state (and the
        whole running statistics of a model with BatchNorm); with sums in stage 1 also the gradient
        shards the tree's sums are held in."""
        grads = self.grads() + (self.grad_shards if self.sums and self.stage == 1 else [])
        return {"param": self.flats or self.shards, "grad": grads,
                "state": [s for st in self.states for s in st] + self.running_arrays()}

    def peak_arrays(self):
        """arrays() and the transient arrays held at the largest moment of the steps so far."""
        held = self.arrays()
        return {kind: held[kind] + self.peak.held.get(kind, []) for kind in held}

    def host_split(self, shards):
        """Host copies of the model's arrays from per-context shards of a flat vector."""
        flat = np.concatenate([s.asnumpy() for s in shards])
        return [flat[a:b].reshape(s) for a, b, s in zip(self.offsets, self.offsets[1:], self.shapes)]

    def state_dict(self):
        """The full, unsharded parameters and optimiser state, as every strategy gives them."""
        per_state = [self.host_split([st[j] for st in self.states]) for j in range(len(self.states[0]))]
        return {"params": self.host_split(self.masters), "t": self.t, "extra": self.running_state(),
                "opt_state": [[values[p] for values in per_state] for p in range(len(self.shapes))]}

    def load_state_dict(self, state):
        """Cut any strategy's full state into this run's shards."""
        n_states = len(self.states[0])
        if [np.shape(p) for p in state["params"]] != self.shapes or len(state["opt_state"]) != len(self.shapes) \
                or any(len(st) != n_states for st in state["opt_state"]):
            raise CheckpointError("the checkpoint's parameters or optimiser state do not fit this run")
        self.load_running(state)
        self.load_params(np.concatenate([np.asarray(p, np.float32).reshape(-1) for p in state["params"]]))
        for j in range(n_states):
            self.scatter([st[j] for st in self.states],
                         np.concatenate([np.asarray(st[j]).reshape(-1) for st in state["opt_state"]]))
        self.t = state["t"]

    def load_params(self, flat):
        """Afterwards the parameters this run keeps hold the flat vector `flat` (N,)."""
        for f in self.flats or []:
            f[:] = nd.array(flat, ctx=f.context)
        if not self.flats:
            self.scatter(self.shards, flat)

    def scatter(self, shards, values):
        """Afterwards shards[i] holds chunk i of the host vector `values`."""
        for s, a, b in zip(shards, self.bounds, self.bounds[1:]):
            s[:] = nd.array(values[a:b], ctx=s.context)
