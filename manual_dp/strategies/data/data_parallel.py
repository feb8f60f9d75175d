"""Synchronous data parallelism: a replica of the parameters on every context, updated in lock-step.

One class for the lesson's step and the fast one. By default a step is fast: each replica's
parameters, gradients and optimiser state are views of flat buffers (manual_dp.fast.flat), so a step
does one all-reduce and one optimiser update per device, and forward and backward run as LeNet's
cached graph (manual_dp.fast.graph). `lesson=True` turns both off and takes the lesson's own
train_batch, with the lesson's allreduce: one call per gradient. `bucket_mb` cuts the flat buffers
into buckets whose all-reduces overlap the backward pass (manual_dp.fast.buckets). Given
--deterministic's FixedSums, every sum over the batch is taken in its fixed tree (data_sums.py).
"""
from mxnet import autograd, nd

from ...config import FAST_STEP, LESSON_STEP, RunConfig
from ...errors import CheckpointError
from ...fast import autotune
from ...fast.buckets import Buckets
from ...fast.collectives import make_allreduce
from ...fast.flat import FlatReplica
from ...fast.graph import ModelGraph, graph_forward_backward
from ...fast.prefetch import host
from ...fast.trace import Tracer
from ...lesson import forward_backward, get_params, shard_sizes, split_and_load, train_batch
from ...models.contract import count_correct, example_loss
from ...models import as_model
from ...optim import apply_update_and_clear, init_states
from ...replicas import fingerprint
from ..base import Strategy
from ..clipping import NormLog, squares
from ..running import RunningStats
from .data_sums import FixedData, leaf_graph


def host_state(params, states, t, **extra):
    """A state_dict (see Strategy.state_dict) from one replica's parameters and optimiser states."""
    return {"params": [p.asnumpy() for p in params],
            "opt_state": [[s.asnumpy() for s in st] for st in states], "t": t, "extra": extra}


def load_into(params, states, state):
    """Overwrite one replica's `params` and optimiser `states` in place with saved host values."""
    if len(state["params"]) != len(params) or any(len(a) != len(b) for a, b in zip(state["opt_state"], states)):
        raise CheckpointError("the checkpoint's parameters or optimiser state do not fit this run")
    for p, value in zip(params, state["params"]):
        p[:] = nd.array(value, ctx=p.context)
    for st, values in zip(states, state["opt_state"]):
        for s, value in zip(st, values):
            s[:] = nd.array(value, ctx=s.context)


class DataParallel(RunningStats, FixedData, Strategy):
    """A replica on every context; gradients all-reduced with `allreduce_fn`, then the same update.

    allreduce_fn, fuse_grads, graph: None takes the fast step's choice (manual_dp.config.FAST_STEP),
    or the lesson's with lesson=True. conv_pad: the graph's channel padding (manual_dp.fast.graph);
    None takes this machine's measured choice (manual_dp.fast.autotune). bucket_mb: None keeps one
    flat buffer (or none); a size in MB takes buckets of it instead (manual_dp.fast.buckets).
    model: the network (manual_dp.models; None: the lesson's LeNet of the parameters' width). A
    model with running statistics (BatchNorm) normalises with each context's statistics, in the
    cached graph too, or with sync_batchnorm across them: then every context's forward runs at
    once, imperatively (models.batchnorm). stats_reduce: the exact all-reduce their sums take
    (None: allreduce_fn; --compress gives the uncompressed one, the statistics must stay exact).
    sums: None, the gradients all-reduced as above; or --deterministic's FixedSums
    (strategies/sums/fixed_sums.py): each context computes the whole model's gradient of each of its
    run of the batch's pieces, added in the one tree (across processes by the policy's exchange), the
    same bits on any layout (data_sums.py). Its leaves run on the fused flat buffers, through the
    cached graph unpadded (the kernels a pipeline stage runs), or imperatively (graph=False, split
    layers in pieces, BatchNorm); allreduce_fn, fuse_grads and conv_pad are not read, buckets and
    the lesson's step refused.
    """

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, allreduce_fn=None,
                 fuse_grads=None, graph=None, lesson=False, conv_pad=None, bucket_mb=None, model=None,
                 sync_batchnorm=False, stats_reduce=None, sums=None):
        if sums and (lesson or bucket_mb is not None):
            raise ValueError("--deterministic's fixed tree takes the fused step: no buckets, not the lesson's step")
        choice = LESSON_STEP if lesson else FAST_STEP
        fuse_grads = choice["fuse_grads"] if fuse_grads is None else fuse_grads
        graph = choice["graph"] if graph is None else graph
        self.ctx, self.optimizer, self.net = list(ctx), optimizer, as_model(model, params)
        self.allreduce_fn = allreduce_fn or make_allreduce(choice["allreduce"])
        self.keep_running(sync_batchnorm, stats_reduce or self.allreduce_fn)
        graph = graph and not self.sync_batchnorm   # statistics across contexts: no one context's graph
        if sums:                                    # the tree's leaves: one flat gradient, unpadded kernels
            fuse_grads, conv_pad, graph = True, 1, leaf_graph(graph, sums, self.net)
        if graph and conv_pad is None:
            conv_pad = autotune.conv_pad()
        self.buckets = Buckets(params, self.ctx, bucket_mb, optimizer, self.net.names()) if bucket_mb is not None else None
        several = self.buckets is not None and len(self.buckets.plan) > 1
        # several buckets: the graph's backward unbulked, so that each bucket is ready on its own
        self.graph = ModelGraph(conv_pad, [p.shape for p in params], not several, self.net) if graph else None
        self.flat = [FlatReplica(params, c) for c in self.ctx] if fuse_grads and not self.buckets else None
        if self.buckets:
            self.replicas = [r.params for r in self.buckets.replicas]
            self.states = [r.states for r in self.buckets.replicas]
        elif self.flat:
            self.replicas = [f.params for f in self.flat]
            self.flat_states = [init_states([f.flat], optimizer)[0] for f in self.flat]
            self.states = [f.state_views(s) for f, s in zip(self.flat, self.flat_states)]
        else:
            self.replicas = [get_params(params, c) for c in self.ctx]
            for p in (p for W in self.replicas for p in W):
                p.attach_grad(grad_req="add")     # backward adds up, update zeroes
            self.states = [init_states(W, optimizer) for W in self.replicas]
        self.states_of = {id(W): S for W, S in zip(self.replicas, self.states)}   # for train_batch's update
        self.t, self.tracer, self.sums = 0, None, sums
        if sums:
            self.keep_fixed()

    def trace(self, path, skip=2, steps=3, algorithm=None):
        """Record updates skip+1 .. skip+steps as a Chrome trace in `path` (manual_dp.fast.trace;
        `algorithm` names the all-reduce for the cost model); needs buckets (bucket_mb=float("inf")
        is the one fused buffer)."""
        if not self.buckets:
            raise ValueError("tracing a step needs its gradients in buckets: give bucket_mb")
        self.tracer = Tracer(path, self.ctx, self.buckets, skip, steps, algorithm)
        self.buckets.marks = self.tracer.bucket

    @property
    def lesson_path(self):
        return not (self.graph or self.flat or self.buckets)

    def step(self, X, y, lr):
        """The lesson's train_batch on the lesson's path; backward + update on the fast one."""
        if not self.lesson_path or self.running:
            return super().step(X, y, lr)
        self.t += 1
        return train_batch(X, y, self.replicas, self.ctx, lr, self.allreduce_fn, update=self.lesson_update,
                           net=self.net.forward, loss=example_loss, correct=count_correct)

    def lesson_update(self, W, lr, n):
        """train_batch's update of replica W (every gradient already all-reduced): the first
        replica's call counts the examples (--clip-norm), every replica's applies the same step."""
        if W is self.replicas[0]:
            self.n_counted = self.counted(n)
        apply_update_and_clear(W, self.states_of[id(W)], self.optimizer, lr, self.t, self.n_counted)

    def backward(self, X, y):
        if self.sums:
            return self.fixed_backward(X, y)
        X_shards, y_shards = split_and_load(host(X), self.ctx), split_and_load(host(y), self.ctx)
        if self.tracer:
            self.tracer.step_begins(X_shards)
        if self.graph:
            metrics = graph_forward_backward(self.graph, X_shards, y_shards, self.replicas,
                                             self.tracer and self.tracer.forward_done)
            if self.running:
                self.fold_graph([m[2] for m in metrics])
            return [m[:2] for m in metrics]
        if self.running:
            return self.grouped_forward_backward(X_shards, y_shards, self.replicas)
        return forward_backward(X_shards, y_shards, self.replicas, self.net.forward, example_loss, count_correct)

    def update(self, lr, n_examples):
        self.t += 1
        if self.sums:
            self.fixed_update(lr, n_examples)
            return
        if self.buckets:
            self.bucket_update(lr, n_examples)
            return
        if self.flat:
            self.allreduce_fn([f.grad for f in self.flat])
            n_examples = self.counted(n_examples)
            for f, s in zip(self.flat, self.flat_states):
                apply_update_and_clear([f.flat], [s], self.optimizer, lr, self.t, n_examples)
            return
        for i in range(len(self.replicas[0])):
            self.allreduce_fn([W[i].grad for W in self.replicas])
        n_examples = self.counted(n_examples)
        for W, S in zip(self.replicas, self.states):
            apply_update_and_clear(W, S, self.optimizer, lr, self.t, n_examples)

    def bucket_update(self, lr, n_examples):
        """The buckets' all-reduces and updates, overlapping the backward; under --clip-norm or
        fp16 every bucket is summed before any is updated (the norm needs them all)."""
        self.norm_log = self.norm_log or NormLog()
        clipping = self.norm_log.needs_norm
        parts = []
        self.buckets.reduce_and_update(self.allreduce_fn, lr, self.t, n_examples,
                                       count=self.counted if clipping else None,
                                       reduced=lambda b, grads: parts.append(squares(grads[0])))
        if parts:
            self.norm_log.add(parts, n_examples)
        if self.tracer:
            self.tracer.step_ends()

    def grad_buffers(self, i):
        """The arrays holding context i's gradients: its flat buffer, one per bucket, or one per parameter."""
        if self.buckets:
            return [g.grad for g in self.buckets.replicas[i].groups]
        return [self.flat[i].grad] if self.flat else [p.grad for p in self.replicas[i]]

    def reduced_grads(self):
        """The first replica's gradients (every replica holds the same sums): its one flat
        gradient when fused (one reduction for the norm, not one per parameter); with sums the
        tree's total gradient (the same bits on any layout)."""
        if self.sums:
            return [self.held[:self.n]]
        return [self.flat[0].grad] if self.flat else [p.grad for p in self.replicas[0]]

    def correct(self, X, y):
        """Correct predictions on (X, y), sharded over every context (idle ones if X is tiny)."""
        ctx = self.ctx[:min(len(self.ctx), len(X))]
        Xs, ys = split_and_load(X, ctx), split_and_load(y, ctx)
        with autograd.train_mode():        # oneDNN's inference mode reorders weight views in place (loop.evaluate)
            scores = self.net.forward_group(Xs, self.replicas[:len(ctx)], self.moments(False, len(ctx))) \
                if self.running else [self.net.forward(Xc, W) for Xc, W in zip(Xs, self.replicas)]
        counts = [count_correct(s, yc).copyto(ctx[0]) for s, yc in zip(scores, ys)]
        return nd.add_n(*counts) if len(counts) > 1 else counts[0]

    def fingerprints(self):
        return {"replica": [fingerprint(c, W, self.net.names()) for c, W in zip(self.ctx, self.replicas)],
                **self.running_fingerprints()}

    def layout(self, batch_size):
        """Every context runs both stages on its shard of the batch."""
        sizes = shard_sizes(batch_size, len(self.ctx))
        return [(c, s, n) for c, n in zip(self.ctx, sizes) for s in (0, 1)]

    def arrays(self):
        params = [p for W in self.replicas for p in W]
        states = [s for S in self.states for st in S for s in st] + self.running_arrays()
        return {"param": params, "grad": [p.grad for p in params], "state": states}

    def state_dict(self):
        """Replica 0's parameters and optimiser state (every replica holds the same), and its
        running statistics, if the model keeps any."""
        return host_state(self.replicas[0], self.states[0], self.t, **self.running_state())

    def load_state_dict(self, state):
        self.load_running(state)
        for W, S in zip(self.replicas, self.states):
            load_into(W, S, state)
        self.t = state["t"]

