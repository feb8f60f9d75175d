"""LeNet one layer at a time, on every context in lock-step, for ZeRO stages 2 and 3: a layer's
parameters are fetched just before it runs and let go after it; a layer's gradient is handed on,
a shard's piece at a time, as soon as its backward is done.

    forward    layers 0, 1, 2 run without recording; each context keeps each layer's input
    backward   layer 3, 2, 1, 0: its parameters fetched again, the layer recorded from its kept
               input and differentiated with the gradient arriving from the layer above; the
               strategy's reduce(l, grad_of) asks grad_of(lo, hi) for each shard's piece of the
               layer's parameter gradient, per context

MXNet's autograd keeps every array a recorded operation read until the backward pass, so a layer
recorded during the forward pass would keep its (gathered) parameters and gradient buffers alive
for the whole step. Recording each layer again during the backward pass (activation recomputation
at the granularity of a layer: one more forward of layers 0..2) is what lets them go. The last
layer's forward is recorded once, in the backward pass, since its backward follows at once.
A dense layer is recorded with its parameters as constants, for its input's gradient only; its
parameters' gradient (h^T g and the sum of g) is computed by hand afterwards, a piece at a time,
once the parameters are gone. The convolutions' gradients come from autograd. The gradients equal
lesson.lenet's up to the order of float additions.
"""
from mxnet import autograd, nd

from ..fast.flat import views
from ..lesson import conv_block, cross_entropy, dense, n_correct, relu

N_LAYERS = 4          # conv, conv, dense, dense: lenet's parameters (W, b) 2l and 2l+1


def layer(l, h, W, b):
    """Layer l of lesson.lenet applied to h."""
    if l < 2:
        return conv_block(h, W, b)                # (B, 20, 13, 13), then (B, 50, 4, 4)
    if l == 2:
        return relu(dense(h, W, b))               # (B, 128)
    return dense(h, W, b)                         # (B, 10)


def forward(X_shards, fetch, note=lambda params, grads: None, n_layers=N_LAYERS - 1):
    """Per context, the input of layers 0..n_layers-1 and, last, the output of layer n_layers-1,
    nothing recorded. fetch(l) gives layer l's [W, b] per context (dropped after the layer ran)."""
    acts = [[X] for X in X_shards]
    for l in range(n_layers):
        params = fetch(l)
        note(params, [])
        with autograd.train_mode():       # oneDNN's inference mode reorders weights in place (loop.evaluate)
            for h, (W, b) in zip(acts, params):
                h.append(layer(l, h[-1], W, b))
        del params
    return acts


def scores(X_shards, fetch):
    """Class scores (B, 10) per context (fewer X_shards than contexts: the first ones only)."""
    return [h[-1] for h in forward(X_shards, fetch, n_layers=N_LAYERS)]


def attach_layer_grad(W, b):
    """A new zero flat gradient (W.size + b.size,) on W's context, whose views W's and b's
    gradients are written into."""
    grad = nd.zeros((W.size + b.size,), ctx=W.context, dtype=W.dtype)
    autograd.mark_variables([W, b], views(grad, [W.shape, b.shape]), grad_reqs="write")
    return grad


def conv_backward(l, acts, params, heads):
    """Conv layer l recorded from its kept inputs and differentiated: its W, b gradient per context
    (flat), while the parameters are still held; the inputs' gradients in acts[c][l].grad."""
    grads, outs = [attach_layer_grad(W, b) for W, b in params], []
    with autograd.record():
        for h, (W, b) in zip(acts, params):
            if l:
                h[l].attach_grad()
            outs.append(layer(l, h[l], W, b))
    for out, head in zip(outs, heads):
        out.backward(head)
    return grads


def dense_input_grads(l, acts, params, heads, y_shards):
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
        tails = [relu(x) if l < N_LAYERS - 1 else cross_entropy(x, y) for x, y in zip(leaves, y_shards)]
    for tail, head in zip(tails, heads):
        tail.backward(head)
    for pre, leaf in zip(pres, leaves):
        pre.backward(leaf.grad)
    metrics = [(t.sum(), n_correct(x, y)) for t, x, y in zip(tails, leaves, y_shards)] \
        if l == N_LAYERS - 1 else None
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


def layer_backward(l, acts, heads, y_shards, sink):
    """Layer l's backward on every context. Its parameters' gradient goes to
    sink.reduce(l, grad_of), where grad_of(lo, hi) gives elements [lo, hi) of the layer's flat
    gradient per context. A dense layer's parameters are let go first: its parameter gradient
    needs only its input and output gradient, and is made a piece at a time, so at most one
    layer's parameters or a piece of its gradient is held (the small convolutions hold both).
    Returns (the input gradient per context or None for layer 0, metrics of the last layer or None)."""
    params = sink.fetch(l)
    if l < 2:
        grads = conv_backward(l, acts, params, heads)
        sink.note(params, grads)
        sink.reduce(l, lambda lo, hi: [g[lo:hi] for g in grads])
        return ([h[l].grad for h in acts] if l else None), None
    outs, metrics = dense_input_grads(l, acts, params, heads, y_shards)
    sink.note(params, [])
    del params
    sink.reduce(l, lambda lo, hi: [dense_grad_piece(h[l], g, lo, hi) for h, g in zip(acts, outs)])
    return [h[l].grad for h in acts], metrics


def forward_backward(X_shards, y_shards, sink):
    """Forward and backward of the batch shards, layer by layer, with `sink` (a ZeRO strategy):
    sink.fetch(l) gives layer l's [W, b] per context, sink.reduce(l, grad_of) takes their
    gradients (of the loss summed over each shard), sink.note(params, grads) learns what is held
    at a moment. Returns per context (loss sum, number correct), left on the devices."""
    acts = forward(X_shards, sink.fetch, sink.note)
    heads, metrics = [None] * len(acts), None
    for l in reversed(range(N_LAYERS)):
        heads, last = layer_backward(l, acts, heads, y_shards, sink)
        metrics = metrics or last
    return metrics
