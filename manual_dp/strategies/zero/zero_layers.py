"""A model one layer at a time (models.contract: a layer is the unit), on every context in lock-step, for ZeRO stages 2 and 3: a layer's
parameters are fetched just before it runs and let go after it; a layer's gradient is handed on,
a shard's piece at a time, as soon as its backward is done.

    forward    layers 0 .. L-2 run without recording; each context keeps each layer's input
    backward   layer L-1, ..., 1, 0: its parameters fetched again, the layer recorded from its kept
               input and differentiated with the gradient arriving from the layer above; the
               strategy's reduce(l, grad_of) asks grad_of(lo, hi) for each shard's piece of the
               layer's parameter gradient, per context

MXNet's autograd keeps every array a recorded operation read until the backward pass, so a layer
recorded during the forward pass would keep its (gathered) parameters and gradient buffers alive
for the whole step. Recording each layer again during the backward pass (activation recomputation
at the granularity of a layer: one more forward of layers 0..L-2) is what lets them go. The last
layer's forward is recorded once, in the backward pass, since its backward follows at once.
A layer of kind "dense" (the lesson's dense, then a ReLU or the loss) is recorded with its
parameters as constants, for its input's gradient only; its parameters' gradient (h^T g and the
sum of g) is computed by hand afterwards, a piece at a time, once the parameters are gone. Every
other layer's gradients (convolutions, transformer blocks, a user's Gluon layers) come from
autograd, the layer's parameters and gradient held together. The gradients equal the one-context
pass's up to the order of float additions.

A model with running statistics (BatchNorm) runs each layer on every context at once
(Model.layer_group), so that --sync-batchnorm can sum a layer's statistics across them: the
forward with the step's Moments (whose batch statistics become the running ones), a layer recomputed
in the backward with a Moments of its own starting at its first BatchNorm (the same statistics
again, from the same input, not counted twice); the last layer, first run in the backward, with the
step's.
"""
from mxnet import autograd, nd

from ...fast.flat import views
from ...lesson import dense, relu
from ...models.contract import example_loss, count_correct
from ...models.batchnorm import first_norm


def hand_made(layer, last):
    """Whether `layer`'s parameter gradient is made by hand (a dense layer, then ReLU or the loss)."""
    return layer.kind == "dense" and (last or layer.extra.get("relu", False))


def run_layer(l, layers, hs, params, Fs, group=None):
    """Layer l's output per context from its input hs[c] and parameters params[c]: each context on
    its own in its namespace Fs[c], or all at once by group(l, hs, params, Fs) (running statistics)."""
    if group is not None:
        return group(l, hs, params, Fs)
    return [layers[l].forward(h, P, F, [p.shape for p in P]) for h, P, F in zip(hs, params, Fs)]


def forward(X_shards, fetch, layers, note=lambda params, grads: None, n_layers=None, Fs=None, group=None):
    """Per context, the input of layers 0..n_layers-1 and, last, the output of layer n_layers-1,
    nothing recorded (default: all but the last layer). fetch(l) gives layer l's parameters per
    context (dropped after the layer ran); Fs[c]: context c's namespace (Model.noisy: dropout);
    group: see run_layer."""
    n_layers = len(layers) - 1 if n_layers is None else n_layers
    acts, Fs = [[X] for X in X_shards], Fs or [nd] * len(X_shards)
    for l in range(n_layers):
        params = fetch(l)[:len(acts)]
        note(params, [])
        with autograd.train_mode():       # oneDNN's inference mode reorders weights in place (loop.evaluate)
            outs = run_layer(l, layers, [h[-1] for h in acts], params, Fs, group)
        for h, out in zip(acts, outs):
            h.append(out)
        del params
    return acts


def scores(X_shards, fetch, layers, group=None):
    """Class scores (B, 10) per context (fewer X_shards than contexts: the first ones only)."""
    return [h[-1] for h in forward(X_shards, fetch, layers, n_layers=len(layers), group=group)]


def attach_layer_grad(P):
    """A new zero flat gradient (sum of sizes,) on P's context, whose views P's gradients are
    written into."""
    grad = nd.zeros((sum(p.size for p in P),), ctx=P[0].context, dtype=P[0].dtype)
    autograd.mark_variables(list(P), views(grad, [p.shape for p in P]), grad_reqs="write")
    return grad


def autograd_backward(l, layers, acts, params, heads, y_shards, last, Fs, group=None):
    """Layer l recorded from its kept inputs and differentiated (with the loss if it is the last):
    its parameters' gradient per context (flat), while the parameters are still held; the inputs'
    gradients in acts[c][l].grad; for the last layer also (loss sum, number correct) per context.
    Fs[c]: context c's namespace, as in the forward (dropout draws the same masks again); group:
    see run_layer."""
    grads = [attach_layer_grad(P) for P in params] if layers[l].params else []
    outs, metrics = [], []
    with autograd.record():
        for h in acts if l else ():
            h[l].attach_grad()
        for h, out, y in zip(acts, run_layer(l, layers, [h[l] for h in acts], params, Fs, group), y_shards):
            if last:
                loss = example_loss(out, y)
                metrics.append((loss.sum(), count_correct(out, y)))
                out = loss
            outs.append(out)
    if group is not None:          # the contexts' outputs may share a statistic: one backward for all
        autograd.backward(outs, heads)
    for out, head in zip(outs, heads) if group is None else ():
        out.backward(head)
    return grads, metrics or None


def dense_input_grads(l, acts, params, heads, y_shards, last):
    """Dense layer l recorded with its parameters as constants: afterwards acts[c][l].grad holds the
    input's gradient. Returns per context the gradient at the layer's output before its ReLU (or
    loss) and, for the last layer, (loss sum, number correct)."""
    pres = []
    with autograd.record():
        for h, (W, b) in zip(acts, params):
            h[l].attach_grad()
            pres.append(dense(h[l], W, b))                     # (B, out)
    leaves = [p.detach() for p in pres]
    for leaf in leaves:
        leaf.attach_grad()
    with autograd.record():
        tails = [example_loss(x, y) if last else relu(x) for x, y in zip(leaves, y_shards)]
    for tail, head in zip(tails, heads):
        tail.backward(head)
    for pre, leaf in zip(pres, leaves):
        pre.backward(leaf.grad)
    metrics = [(t.sum(), count_correct(x, y)) for t, x, y in zip(tails, leaves, y_shards)] if last else None
    return [leaf.grad for leaf in leaves], metrics


def dense_grad_piece(h, g, lo, hi):
    """Elements [lo, hi) of the flat gradient [W's (in, out) | b's (out,)] of dense(h, W, b), from
    its input h and the gradient g (B, out) at its output, computed for those rows only: row r of
    W's is h[:, r]^T g, b's the sum of g over the batch."""
    h = h.reshape((h.shape[0], -1))                                    # (B, in)
    n_w, n_out = h.shape[1] * g.shape[1], g.shape[1]
    parts = []
    if min(hi, n_w) > lo:
        r0, r1 = lo // n_out, -(-min(hi, n_w) // n_out)
        rows = nd.dot(nd.slice_axis(h, axis=1, begin=r0, end=r1), g, transpose_a=True)   # (r1 - r0, out)
        parts.append(rows.reshape((-1,))[lo - r0 * n_out:min(hi, n_w) - r0 * n_out])
    if hi > n_w:
        parts.append(nd.sum(g, axis=0)[max(lo - n_w, 0):hi - n_w])
    return parts[0] if len(parts) == 1 else nd.concat(*parts, dim=0)


def layer_backward(l, layers, acts, heads, y_shards, sink, Fs, group=None):
    """Layer l's backward on every context. Its parameters' gradient goes to
    sink.reduce(l, grad_of), where grad_of(lo, hi) gives elements [lo, hi) of the layer's flat
    gradient per context. A dense layer's parameters are let go first: its parameter gradient
    needs only its input and output gradient, and is made a piece at a time, so at most one
    layer's parameters or a piece of its gradient is held (other layers hold both).
    group: see run_layer. Returns (the input gradient per context or None for layer 0, metrics of
    the last layer or None)."""
    if l == 0 and not layers[0].params:            # a Flatten first: nothing before it, nothing to differentiate
        return None, None
    params, last = sink.fetch(l), l == len(layers) - 1
    if not hand_made(layers[l], last):
        grads, metrics = autograd_backward(l, layers, acts, params, heads, y_shards, last, Fs, group)
        sink.note(params, grads)
        if layers[l].params:                       # (a Flatten has no gradient to hand on)
            sink.reduce(l, lambda lo, hi: [g[lo:hi] for g in grads])
        return ([h[l].grad for h in acts] if l else None), metrics
    outs, metrics = dense_input_grads(l, acts, params, heads, y_shards, last)
    sink.note(params, [])
    del params
    sink.reduce(l, lambda lo, hi: [dense_grad_piece(h[l], g, lo, hi) for h, g in zip(acts, outs)])
    return ([h[l].grad for h in acts] if l else None), metrics


def forward_backward(X_shards, y_shards, sink):
    """Forward and backward of the batch shards, layer by layer, with `sink` (a ZeRO strategy):
    sink.net is the model, sink.fetch(l) gives layer l's parameters per context, sink.reduce(l,
    grad_of) takes their gradients (of the loss summed over each shard), sink.note(params, grads)
    learns what is held at a moment; for a model with running statistics sink.moments(train,
    first=...) gives a Moments and sink.fold(moments) takes the step's batch statistics. Returns
    per context (loss sum, number correct), left on the devices."""
    layers, Fs = sink.net.layers, [sink.net.noisy(nd, X) for X in X_shards]
    stats = sink.moments(True) if sink.net.stats() else None
    step = (lambda l, hs, P, Fs: sink.net.layer_group(l, hs, P, stats, Fs)) if stats else None

    def again(l, hs, P, Fs):       # a layer recomputed: its statistics again, counted once (the docstring)
        moments = stats if l == len(layers) - 1 else sink.moments(True, first=first_norm(layers, l))
        return sink.net.layer_group(l, hs, P, moments, Fs)
    acts = forward(X_shards, sink.fetch, layers, sink.note, Fs=Fs, group=step)
    heads, metrics = [None] * len(acts), None
    for l in reversed(range(len(layers))):
        heads, last = layer_backward(l, layers, acts, heads, y_shards, sink, Fs, again if stats else None)
        metrics = metrics or last
    if stats is not None:
        sink.fold(stats)
    return metrics
