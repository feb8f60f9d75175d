"""Gradient fusion: one flat buffer per device whose slices are the parameters, gradients and
optimiser state, so one all-reduce and one optimiser step cover all of them.

    flat buffer   [ W1 | b1 | W2 | b2 | W3 | b3 | W4 | b4 ]     (129,068 floats for LeNet)
    views          W1 = flat[0:180].reshape(20, 1, 3, 3), b1 = flat[180:200], ...

A view shares its buffer's memory: backward writes each gradient into its slice, and the flat
gradient is then already there to reduce, without copying anything in or out.
"""
import numpy as np
from mxnet import autograd, nd


def offsets(shapes):
    """Start offsets of each shape in a flat buffer, plus the total size at the end."""
    return [0] + list(np.cumsum([int(np.prod(s)) for s in shapes]))


def views(flat, shapes):
    """Arrays of `shapes` that are consecutive slices of the 1-D array `flat` (same memory)."""
    o = offsets(shapes)
    return [flat[o[i]:o[i + 1]].reshape(s) for i, s in enumerate(shapes)]


def flatten(arrays, ctx):
    """A new 1-D array on `ctx` holding `arrays` one after the other."""
    return nd.concat(*[a.reshape((-1,)).as_in_context(ctx) for a in arrays], dim=0)


class FlatReplica:
    """One device's parameters and gradients as views of two flat buffers, `flat` and `grad`.

    `params` are the views the forward pass reads; backward adds each parameter's gradient
    into its slice of `grad`, which is also `flat`'s gradient (for a single fused update).
    """

    def __init__(self, params, ctx):
        self.shapes = [p.shape for p in params]
        self.flat = flatten(params, ctx)                  # (N,)
        self.grad = nd.zeros(self.flat.shape, ctx=ctx, dtype=self.flat.dtype)
        self.params = views(self.flat, self.shapes)
        self.mark("add")

    def mark(self, grad_req):
        """Backward `grad_req`s ("add" or "write") the gradients into `grad`."""
        autograd.mark_variables(self.params, views(self.grad, self.shapes), grad_reqs=grad_req)
        autograd.mark_variables([self.flat], [self.grad], grad_reqs=grad_req)

    def state_views(self, flat_states):
        """Per parameter, the views of the flat optimiser state arrays (each shaped like `flat`)."""
        per_state = [views(s, self.shapes) for s in flat_states]
        return [list(vs) for vs in zip(*per_state)] if per_state else [[] for _ in self.shapes]
