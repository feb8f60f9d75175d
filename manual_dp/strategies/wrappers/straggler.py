"""A straggler (`--straggler I:FACTOR`): context I's forward and backward take FACTOR times as long.

After every backward, context I's gradient buffers (the strategy's grad_buffers(I): one flat buffer,
one per bucket, or one per parameter) pass through manual_dp.fast.link's delay in place: whatever
reads them waits (FACTOR - 1) x that context's compute time more, on MXNet's engine, while the other
contexts' work goes on: sync's all-reduce (and so every replica), async's push to the master (taken
when the next backward or update begins), local SGD's own inner step (the others wait at the sync).
The compute time is measured on the first MEASURED backward passes (issue to I's gradients ready,
alongside the other contexts; the smallest kept), which wait for it and are not delayed (a delay
would hold up the next pass's start and be timed with it); the later ones are delayed and do not
wait. The values are untouched: a straggler changes when, never what.

The flight recorder (manual_dp.flight) records collectives of processes, not of contexts within
one: it does not name the late context.
"""
import time

from mxnet import nd

from ...fast.link import delayed
from ..base import Wrapper, innermost

MEASURED = 3          # backward passes timed (the first also compiles the graph: the smallest is kept)


class Straggler(Wrapper):
    """Wraps a strategy `model` (sync, async, local SGD: one with grad_buffers(i)): context `index`
    slowed by `factor` (>= 1); compute_s: its compute time a step, if known (default: measured);
    moving: the slow context moves on by one every update (index + t mod k: each slow 1 step in k)."""

    def __init__(self, model, index, factor, compute_s=None, moving=False):
        if not (factor >= 1 and 0 <= index < len(model.ctx)):
            raise ValueError(f"a straggler needs a context of 0..{len(model.ctx) - 1} and a factor >= 1, "
                             f"got {index}:{factor}")
        super().__init__(model)
        self.index, self.factor, self.moving = index, factor, moving
        self.compute_s, self.timed, self.ports = float("inf"), 0, {}
        if compute_s is not None:
            self.compute_s, self.timed = compute_s, MEASURED

    @property
    def delay_s(self):
        """Seconds added after each backward of the slow context."""
        return (self.factor - 1) * self.compute_s

    def backward(self, X, y):
        start = time.perf_counter()
        metrics = self.model.backward(X, y)
        buffers = innermost(self.model).grad_buffers(self.slow_context())
        if self.timed < MEASURED:             # undelayed: a delay would hold up the next step's start
            for g in buffers:
                g.wait_to_read()
            self.compute_s = min(self.compute_s, time.perf_counter() - start)
            self.timed += 1
        elif self.delay_s > 0:
            for i, g in enumerate(buffers):
                delayed(g, self.delay_s, *self.ports_of(i, g.context), out=g)
        return metrics

    def slow_context(self):
        """The context slowed in this step's backward."""
        return (self.index + self.t) % len(self.ctx) if self.moving else self.index

    def ports_of(self, i, ctx):
        """Buffer i's own two ports on ctx (1-element arrays): the buffers are delayed at the same time."""
        if (i, str(ctx)) not in self.ports:
            self.ports[i, str(ctx)] = (nd.zeros((1,), ctx=ctx), nd.zeros((1,), ctx=ctx))
        return self.ports[i, str(ctx)]
