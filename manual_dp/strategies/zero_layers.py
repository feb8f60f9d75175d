"""LeNet one layer at a time, on every context in lock-step, for ZeRO stages 2 and 3: a layer's
parameters are fetched just before it runs and dropped after it; a layer's gradient is handed on
as soon as its backward is done, and dropped.

    forward    layers 0, 1, 2 run without recording; each context keeps each layer's input
    backward   layer 3, 2, 1, 0: its parameters fetched again, the layer recorded from its kept
               input and differentiated with the gradient arriving from the layer above; its
               parameters' gradient (one new flat array per context) goes to `reduce`

MXNet's autograd keeps every array a recorded operation read until the backward pass, so a layer
recorded during the forward pass would keep its (gathered) parameters and gradient buffers alive
for the whole step. Recording each layer again during the backward pass (activation recomputation
at the granularity of a layer: one more forward of layers 0..2) is what lets them go. The last
layer's forward is recorded once, in the backward pass, since its backward follows at once.
The same operations as lesson.lenet run on the same inputs, so the gradients are the same.
"""
import numpy as np
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


def dense_param_grad(h, g, shapes):
    """Flat gradient of dense(h, W, b) for W, b of `shapes`, from the gradient g (B, out) at its
    output: W's = h^T g (h flattened to (B, in)), b's = the sum of g over the batch."""
    grad = nd.empty((sum(int(np.prod(s)) for s in shapes),), ctx=g.context, dtype=g.dtype)
    gW, gb = views(grad, shapes)
    nd.dot(h.reshape((h.shape[0], -1)), g, transpose_a=True, out=gW)  # (in, out)
    nd.sum(g, axis=0, out=gb)                                          # (out,)
    return grad


def layer_backward(l, acts, fetch, heads, y_shards, note, reduce):
    """Layer l's backward on every context; its parameter gradient goes to reduce(l, grads,
    params still held). A dense layer's parameters are let go before its parameter gradient
    exists, as that needs only the layer's input and output gradient (so at most one layer's
    parameters or its gradient is held, except for the small convolutions). Returns (the input
    gradient per context or None for layer 0, metrics of the last layer or None)."""
    params = fetch(l)
    if l < 2:
        reduce(l, conv_backward(l, acts, params, heads), params)
        return ([h[l].grad for h in acts] if l else None), None
    shapes = [params[0][0].shape, params[0][1].shape]
    outs, metrics = dense_input_grads(l, acts, params, heads, y_shards)
    note(params, [])
    del params
    reduce(l, [dense_param_grad(h[l], g, shapes) for h, g in zip(acts, outs)], [])
    return [h[l].grad for h in acts], metrics


def forward_backward(X_shards, y_shards, fetch, reduce, note=lambda params, grads: None):
    """Forward and backward of the batch shards, layer by layer; fetch(l) gives layer l's [W, b]
    per context, reduce(l, grads, params) receives their gradients (one flat array per context, of
    the loss summed over the shard), note(params, grads) what is held at a moment. Returns per
    context (loss sum, number correct), left on the devices."""
    acts = forward(X_shards, fetch, note)
    heads, metrics = [None] * len(acts), None
    for l in reversed(range(N_LAYERS)):
        heads, last = layer_backward(l, acts, fetch, heads, y_shards, note, reduce)
        metrics = metrics or last
    return metrics
