"""--digests around any strategy (manual_dp.digests): after every update, one line of digests of
the reduced gradient the update used and of the parameters and optimiser state it left."""
from ...digests import record
from ..base import Wrapper


class Digested(Wrapper):
    """`model` whose every update writes a line to `out` (a digests.DigestFile; None on a process
    that does not write: every process still takes part in state_dict, which may gather)."""

    def __init__(self, model, out):
        super().__init__(model)
        self.out, self.grads = out, None
        self.names, self.shapes = model.net.names(), [s for _, s in model.net.shapes()]
        model.observe(self.seen)

    def seen(self, grads):
        self.grads = [g.asnumpy() for g in grads]

    def after(self, t0):
        if self.model.t != t0:
            state = self.model.state_dict()
            if self.out:
                self.out.write(record(self.model.t, self.names, self.shapes, self.grads, state))
            self.grads = None

    def step(self, X, y, lr):
        t0 = self.model.t
        metrics = self.model.step(X, y, lr)
        self.after(t0)
        return metrics

    def update(self, lr, n_examples):
        t0 = self.model.t
        self.model.update(lr, n_examples)
        self.after(t0)

    def end_epoch(self, lr):
        t0 = self.model.t
        out = self.model.end_epoch(lr)
        self.after(t0)
        return out
