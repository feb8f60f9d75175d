"""One synchronous data-parallel step: the lesson's train_batch, and the replicas that take it."""
import numpy as np
from mxnet import autograd, nd

from .flat import FlatReplica
from .graph import LeNetGraph
from .model import cross_entropy, lenet
from .optim import apply_update, init_states
from .parallel import allreduce, get_params, split_and_load


def n_correct(scores, y):
    """Number of rows of `scores` whose argmax equals `y`, as a 1-element NDArray."""
    return (scores.argmax(axis=1) == y.astype(scores.dtype)).sum()


def host(a):
    """A numpy batch as an NDArray, without waiting for the devices.

    nd.array copies synchronously, and that copy first waits until cpu(0)'s queue has run dry:
    the host would stall on the devices every batch. Here numpy copies the batch into a private
    buffer (the caller may reuse its own at once) that MXNet then takes over without a copy;
    the copies from it to the devices are queued like any other operation.
    """
    if not isinstance(a, np.ndarray):
        return a
    return nd.from_numpy(np.array(a, order="C", copy=True), zero_copy=True)


def forward_backward(X_shards, y_shards, device_params):
    """Record every context's forward pass, then run each backward; the gradients are of loss sums."""
    with autograd.record():
        scores = [lenet(X, W) for X, W in zip(X_shards, device_params)]
        losses = [cross_entropy(s, y) for s, y in zip(scores, y_shards)]
    for l in losses:
        l.backward()
    return [(l.sum(), n_correct(s, y)) for l, s, y in zip(losses, scores, y_shards)]


def graph_forward_backward(graph, X_shards, y_shards, device_params):
    """forward_backward through LeNet's cached graph: one call per context, one backward for all."""
    with autograd.record():
        metrics = [graph(X, y, W) for X, y, W in zip(X_shards, y_shards, device_params)]
    autograd.backward([loss_sum for loss_sum, _ in metrics])
    return metrics


def train_batch(X, y, device_params, ctx, lr, allreduce_fn=allreduce,
                optimizer="sgd", states=None, t=1):
    """One synchronous step: afterwards every replica equals one optimiser step on the whole batch.

    Returns per-context (loss sum, number correct) NDArrays, left on their devices.
    """
    X_shards, y_shards = split_and_load(X, ctx), split_and_load(y, ctx)
    metrics = forward_backward(X_shards, y_shards, device_params)
    for i in range(len(device_params[0])):
        allreduce_fn([W[i].grad for W in device_params])
    states = states or [init_states(W, optimizer) for W in device_params]
    for W, s in zip(device_params, states):
        apply_update(W, s, optimizer, lr, t, X.shape[0])
    return metrics


def load_into(params, states, state):
    """Overwrite one replica's `params` and optimiser `states` in place with saved host values."""
    for p, value in zip(params, state["params"]):
        p[:] = nd.array(value, ctx=p.context)
    for st, values in zip(states, state["opt_state"]):
        for s, value in zip(st, values):
            s[:] = nd.array(value, ctx=s.context)


class DataParallel:
    """A replica of the parameters on every context, updated in lock-step.

    By default a step is the lesson's train_batch. Two options make the same step faster:
    fuse_grads keeps each replica's parameters, gradients and optimiser state as views of flat
    buffers (manual_dp.flat), so a step does one allreduce_fn call and one optimiser update per
    device instead of one per parameter; graph runs forward and backward as LeNet's cached
    graph (manual_dp.graph) instead of layer by layer.
    """

    def __init__(self, params, ctx, optimizer="sgd", allreduce_fn=allreduce,
                 fuse_grads=False, graph=False):
        self.ctx, self.optimizer, self.allreduce_fn = list(ctx), optimizer, allreduce_fn
        self.graph = LeNetGraph() if graph else None
        self.flat = [FlatReplica(params, c) for c in self.ctx] if fuse_grads else None
        if self.flat:
            self.replicas = [f.params for f in self.flat]
            self.flat_states = [init_states([f.flat], optimizer)[0] for f in self.flat]
            self.states = [f.state_views(s) for f, s in zip(self.flat, self.flat_states)]
        else:
            self.replicas = [get_params(params, c) for c in self.ctx]
            self.states = [init_states(W, optimizer) for W in self.replicas]
        self.t = 0

    def step(self, X, y, lr):
        self.t += 1
        if not (self.graph or self.flat):
            return train_batch(X, y, self.replicas, self.ctx, lr, self.allreduce_fn,
                               self.optimizer, self.states, self.t)
        X_shards, y_shards = split_and_load(host(X), self.ctx), split_and_load(host(y), self.ctx)
        if self.graph:
            metrics = graph_forward_backward(self.graph, X_shards, y_shards, self.replicas)
        else:
            metrics = forward_backward(X_shards, y_shards, self.replicas)
        if self.flat:
            self.allreduce_fn([f.grad for f in self.flat])
            for f, s in zip(self.flat, self.flat_states):
                apply_update([f.flat], [s], self.optimizer, lr, self.t, X.shape[0])
        else:
            for i in range(len(self.replicas[0])):
                self.allreduce_fn([W[i].grad for W in self.replicas])
            for W, s in zip(self.replicas, self.states):
                apply_update(W, s, self.optimizer, lr, self.t, X.shape[0])
        return metrics

    def correct(self, X, y):
        """Correct predictions on (X, y), sharded over every context (idle ones if X is tiny)."""
        ctx = self.ctx[:min(len(self.ctx), len(X))]
        counts = [n_correct(lenet(Xs, W), ys).copyto(ctx[0]) for Xs, ys, W in
                  zip(split_and_load(X, ctx), split_and_load(y, ctx), self.replicas)]
        return nd.add_n(*counts) if len(counts) > 1 else counts[0]

    def state_dict(self):
        """Host copies of the parameters and optimiser state (all replicas are identical)."""
        return {"params": [p.asnumpy() for p in self.replicas[0]],
                "opt_state": [[s.asnumpy() for s in st] for st in self.states[0]], "t": self.t}

    def load_state_dict(self, state):
        for W, S in zip(self.replicas, self.states):
            load_into(W, S, state)
        self.t = state["t"]
