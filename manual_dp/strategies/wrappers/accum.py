"""Gradient accumulation for any strategy: N batches' gradients added up, then one update.

Every strategy's backward adds to the gradients it holds and its update normalises by the examples
it is told (manual_dp.strategies.base), so accumulating is only a matter of when update is called.
"""
from ..base import Wrapper


class GradAccum(Wrapper):
    """Wraps `model`: one update per `every` batches, normalised by all their examples.

    A window still open at the end of an epoch is applied by `end_epoch`, so epochs (and the
    checkpoints taken after them) never carry gradients over.
    """

    def __init__(self, model, every):
        if every < 1:
            raise ValueError(f"accumulate over at least one batch, got {every}")
        super().__init__(model)
        self.every, self.batches, self.examples = every, 0, 0

    def backward(self, X, y):
        metrics = self.model.backward(X, y)
        self.batches, self.examples = self.batches + 1, self.examples + X.shape[0]
        return metrics

    def update(self, lr, n_examples):
        """Apply the window: every held gradient, over `n_examples` examples."""
        self.model.update(lr, n_examples)
        self.batches = self.examples = 0

    def step(self, X, y, lr):
        """backward; update once `every` batches are in."""
        metrics = self.backward(X, y)
        if self.batches == self.every:
            self.update(lr, self.examples)
        return metrics

    def end_epoch(self, lr):
        if self.batches:
            self.update(lr, self.examples)
        return self.model.end_epoch(lr)
