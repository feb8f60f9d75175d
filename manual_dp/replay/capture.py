"""Every layer's output, and the gradient of the loss with respect to it, captured during one step
of any strategy that runs the model's layers through `Layer.forward` (models.contract).

`Recorder.installed(net)` replaces, for the length of a with-block, the model's layers by copies
whose forward calls the real one and, while the recorder is capturing, keeps a host copy of the
output and puts a `Tap` after it: an identity node whose backward keeps the gradient that passes
through it, unchanged (MXNet cannot attach_grad to an array in the middle of a recorded graph).
A copy forward and a copy backward change no value, so the step computes the bits it would.

Strategies call a layer once per piece of the batch they hold: data parallelism once per
context's shard, --deterministic once per piece of PIECE_ROWS rows, a pipeline once per micro-batch,
tensor parallelism once per context of a group on the same rows (layers it does not split).
`Recorder.whole` puts the pieces back in the batch's row order: the rows of a call to the first
layer are found by their content (its input is the images), and the k-th call of every other layer
holds the rows of the k-th call of the first. What cannot be captured this way is said, not
guessed: a layer run through another function (a split layer's split_forward, a context-parallel
layer's sequence_forward, a user's Gluon block inside its own cached graph) or inside a symbolic
graph (--mode sync's cached graph builds every layer with F=mx.sym) has no calls; a layer called
a different number of times than the first cannot be mapped to rows.
"""
import contextlib
import dataclasses

import numpy as np
from mxnet import autograd, nd


class Tap(autograd.Function):
    """The identity, forward and backward; its backward keeps a host copy of the gradient it passes
    on in sink[key]."""

    def __init__(self, sink, key):
        super().__init__()
        self.sink, self.key = sink, key

    def forward(self, x):
        return x.copy()

    def backward(self, dy):
        self.sink[self.key] = dy.asnumpy()
        return dy.copy()


class Recorder:
    """Layer outputs (host arrays) by (layer, call), the first layer's inputs by call, and the
    gradients the Taps kept, from the steps run inside `capturing()`."""

    def __init__(self):
        self.active = False
        self.clear()

    def clear(self):
        self.outputs, self.grads, self.inputs, self.calls = {}, {}, [], {}

    def wrap(self, i, layer):
        """`layer` whose forward records, as layer i, while the recorder captures."""
        def forward(h, params, F=nd, shapes=None):
            out = layer.forward(h, params, F, shapes)
            if not self.active or not isinstance(out, nd.NDArray):    # a Symbol: a graph being built
                return out
            k = self.calls[i] = self.calls.get(i, 0) + 1
            if i == 0:
                self.inputs.append(h.asnumpy())
            self.outputs[(i, k - 1)] = out.asnumpy()
            return Tap(self.grads, (i, k - 1))(out) if autograd.is_recording() else out
        return dataclasses.replace(layer, forward=forward)

    @contextlib.contextmanager
    def installed(self, net):
        """`net`'s layers recording inside the with-block (strategies built inside it keep them);
        its own layers back afterwards."""
        own = net.layers
        net.layers = tuple(self.wrap(i, layer) for i, layer in enumerate(own))
        try:
            yield self
        finally:
            net.layers = own

    @contextlib.contextmanager
    def capturing(self):
        """Record the steps run inside the with-block (what was recorded before is dropped)."""
        self.clear()
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def whole(self, X, n_layers):
        """(outputs, grads, notes): per layer, its output and its output's gradient over the whole
        batch X (host, the rows the step took) in X's row order, or None with a note saying why."""
        rows = [find_rows(x, X) for x in self.inputs]
        outputs, grads, notes = [None] * n_layers, [None] * n_layers, [None] * n_layers
        if not self.inputs:
            return outputs, grads, ["no call of Layer.forward was recorded"] * n_layers
        if None in rows:
            return outputs, grads, ["the first layer's input is not a run of the batch's rows"] * n_layers
        for i in range(n_layers):
            calls = self.calls.get(i, 0)
            if calls != len(rows):
                notes[i] = ("not run through Layer.forward (split or sequence layer, or a graph)" if not calls else
                            f"called {calls} times, the first layer {len(rows)}: its rows are unknown")
                continue
            outputs[i] = assemble([self.outputs[(i, k)] for k in range(calls)], rows, len(X))
            grads[i] = assemble([self.grads.get((i, k)) for k in range(calls)], rows, len(X))
            if outputs[i] is None:
                notes[i] = "its calls do not cover every row of the batch"
        return outputs, grads, notes


def find_rows(x, X):
    """(start, stop): the run of X's rows equal to x (the first such run); None if none is."""
    n = len(x)
    for start in np.flatnonzero((X.reshape(len(X), -1) == x[0].reshape(1, -1)).all(axis=1)):
        if start + n <= len(X) and np.array_equal(X[start:start + n], x):
            return int(start), int(start + n)
    return None


def assemble(pieces, rows, n):
    """One (n, ...) array from pieces[k] holding rows[k] (a row given twice: the first copy kept);
    None if a piece is missing (no gradient reached it) and its rows are held by no other."""
    shape = next((p.shape[1:] for p in pieces if p is not None), None)
    if shape is None:
        return None
    out, seen = np.zeros((n,) + shape, dtype=np.float32), np.zeros(n, dtype=bool)
    for piece, (start, stop) in zip(pieces, rows):
        if piece is None or piece.shape[0] != stop - start:
            continue
        fresh = ~seen[start:stop]
        out[start:stop][fresh] = piece[fresh]
        seen[start:stop] = True
    return out if seen.all() else None
