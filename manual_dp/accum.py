"""Gradient accumulation: N batches' gradients summed, then one update, for any strategy.

A strategy that can accumulate splits its step in two: `backward(X, y)` adds the batch's gradients
to what it holds, `update(lr, n_examples)` takes one optimiser step on the sum / n_examples and
zeroes it. `step` is then backward + update; `GradAccum` calls update every N batches instead.
"""
from .memory import held_arrays, layout
from .optim import apply_update_and_clear
from .parallel import allreduce, split_and_load
from .step import DataParallel, forward_backward


class SyncPhases(DataParallel):
    """DataParallel split into backward (gradients add up on each device) and update (allreduce, step)."""

    def __init__(self, params, ctx, optimizer="sgd", allreduce_fn=allreduce):
        super().__init__(params, ctx, optimizer, allreduce_fn)
        for W in self.replicas:
            for p in W:
                p.attach_grad(grad_req="add")

    def backward(self, X, y):
        return forward_backward(split_and_load(X, self.ctx), split_and_load(y, self.ctx),
                                self.replicas)

    def update(self, lr, n_examples):
        for i in range(len(self.replicas[0])):
            self.allreduce_fn([W[i].grad for W in self.replicas])
        self.t += 1
        for W, S in zip(self.replicas, self.states):
            apply_update_and_clear(W, S, self.optimizer, lr, self.t, n_examples)

    def step(self, X, y, lr):
        metrics = self.backward(X, y)
        self.update(lr, X.shape[0])
        return metrics


class GradAccum:
    """Wraps a two-phase strategy: one update per `every` batches, normalised by all their examples.

    A window still open at the end of an epoch is applied by `end_epoch`, so epochs (and the
    checkpoints taken after them) never carry gradients over.
    """

    def __init__(self, model, every):
        if every < 1:
            raise ValueError(f"accumulate over at least one batch, got {every}")
        self.model, self.every, self.ctx = model, every, model.ctx
        self.batches = self.examples = 0

    @property
    def t(self):
        return self.model.t

    def step(self, X, y, lr):
        metrics = self.model.backward(X, y)
        self.batches, self.examples = self.batches + 1, self.examples + X.shape[0]
        if self.batches == self.every:
            self.flush(lr)
        return metrics

    def flush(self, lr):
        """Apply the open window, if any."""
        if self.batches:
            self.model.update(lr, self.examples)
            self.batches = self.examples = 0

    def end_epoch(self, lr):
        self.flush(lr)
        return self.model.end_epoch(lr) if hasattr(self.model, "end_epoch") else {}

    def correct(self, X, y):
        return self.model.correct(X, y)

    def layout(self, batch_size):
        return layout(self.model, batch_size)

    def arrays(self):
        return held_arrays(self.model)

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, state):
        self.model.load_state_dict(state)
