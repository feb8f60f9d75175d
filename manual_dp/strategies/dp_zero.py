"""ZeRO stage 1 over a mesh's data dimension (`--zero-stage 1` with tensor, context and mesh modes):
each of the D copies of a parameter keeps the optimiser state of 1/D of it.

A copy group is the arrays that hold the same parameter (or the same tensor shard of it) on D
contexts, whose gradients are summed: the data-parallel replicas, or under sequence and context
parallelism the whole data x group. Instead of an all-reduce and D identical updates, each group's
gradients are reduce-scattered (context r receives the sum of chunk r of the flat gradient), each
context updates its chunk of the parameter with its chunk of the state, and the updated chunks are
all-gathered into every copy: the same arithmetic per element as the all-reduce and the update,
so the same parameters (to the rounding of the sum's order), and 1/D of the state per context.
"""
import numpy as np
from mxnet import nd

from ..fast.collectives import chunk_bounds
from ..optim import OPTIMIZERS


class DataShardedOptimizer:
    """The optimiser of every copy group: groups[g] the D arrays (one per context, equal shapes)
    whose gradients are summed; they must have .grad (grad_req "add")."""

    def __init__(self, groups, optimizer):
        self.groups, self.optimizer = groups, optimizer
        init, self.rule = OPTIMIZERS[optimizer]
        self.bounds = [chunk_bounds(int(np.prod(g[0].shape)), len(g)) for g in self.groups]
        # states[g][r]: the state of chunk r of group g, on copy r's context (None for an empty chunk)
        self.states = [[init(nd.zeros((b - a,), ctx=p.context, dtype=p.dtype)) if b > a else None
                        for p, a, b in zip(group, bounds, bounds[1:])]
                       for group, bounds in zip(self.groups, self.bounds)]

    def step(self, lr, t, n_examples):
        """Reduce-scatter, update each chunk where its state lives, all-gather; then zero the
        gradients. n_examples None: a skipped update (the gradients only zeroed)."""
        for group, bounds, states in zip(self.groups, self.bounds, self.states):
            if n_examples is not None:
                flats = [p.reshape((-1,)) for p in group]
                grads = [p.grad.reshape((-1,)) for p in group]
                for r, (p, a, b, state) in enumerate(zip(flats, bounds, bounds[1:], states)):
                    if b > a:
                        total = nd.add_n(*[g[a:b].as_in_context(p.context) for g in grads])    # chunk r, summed
                        self.rule(p[a:b], total / n_examples, state, lr, t)
                for r, (a, b) in enumerate(zip(bounds, bounds[1:])):
                    if b > a:
                        for p in flats:
                            if p is not flats[r]:
                                p[a:b] = flats[r][a:b].as_in_context(p.context)
            for p in group:
                p.grad[:] = 0

    def state_arrays(self):
        """Every state array (for the memory report)."""
        return [s for states in self.states for state in states if state for s in state]

    def whole_state(self, g):
        """Group g's optimiser state, whole: one host array per state slot, in the parameter's shape."""
        shape = self.groups[g][0].shape
        slots = next((len(s) for s in self.states[g] if s is not None), 0)
        return [np.concatenate([s[k].asnumpy() for s in self.states[g] if s is not None]).reshape(shape)
                for k in range(slots)]

    def load_state(self, g, values):
        """Group g's state from whole host arrays (one per slot)."""
        for state, a, b in zip(self.states[g], self.bounds[g], self.bounds[g][1:]):
            if state is not None:
                for s, v in zip(state, values):
                    s[:] = nd.array(np.asarray(v).reshape(-1)[a:b], ctx=s.context)
