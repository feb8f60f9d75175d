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


def forward(X_shards, fetch, n_layers=N_LAYERS - 1):
    """Per context, the input of layers 0..n_layers-1 and, last, the output of layer n_layers-1,
    nothing recorded. fetch(l) gives layer l's [W, b] per context (dropped after the layer ran)."""
    acts = [[X] for X in X_shards]
    for l in range(n_layers):
        params = fetch(l)
        with autograd.train_mode():       # oneDNN's inference mode reorders weights in place (loop.evaluate)
            for h, (W, b) in zip(acts, params):
                h.append(layer(l, h[-1], W, b))
        del params
    return acts


def scores(X_shards, fetch):
    """Class scores (B, 10) per context (fewer X_shards than contexts: the first ones only)."""
    return [h[-1] for h in forward(X_shards, fetch, N_LAYERS)]


def attach_layer_grad(W, b):
    """A new zero flat gradient (W.size + b.size,) on W's context, whose views W's and b's
    gradients are written into."""
    grad = nd.zeros((W.size + b.size,), ctx=W.context, dtype=W.dtype)
    autograd.mark_variables([W, b], views(grad, [W.shape, b.shape]), grad_reqs="write")
    return grad


def record_layer(l, acts, params, y_shards):
    """Layer l recorded on every context from its kept input: (what to differentiate, scores or None)."""
    outs, last = [], l == N_LAYERS - 1
    with autograd.record():
        for h, (W, b), y in zip(acts, params, y_shards):
            if l:
                h[l].attach_grad()
            out = layer(l, h[l], W, b)
            outs.append((cross_entropy(out, y), out) if last else (out, None))
    return outs


def forward_backward(X_shards, y_shards, fetch, reduce):
    """Forward and backward of the batch shards, layer by layer; reduce(l, params, grads) receives
    layer l's parameters and their gradients (one flat array per context, the gradient of the loss
    summed over the shard). Returns per context (loss sum, number correct), left on the devices."""
    acts = forward(X_shards, fetch)
    heads, metrics = None, None
    for l in reversed(range(N_LAYERS)):
        params = fetch(l)
        grads = [attach_layer_grad(W, b) for W, b in params]
        outs = record_layer(l, acts, params, y_shards)
        for c, (out, scores_) in enumerate(outs):
            out.backward(None if heads is None else heads[c])
        if metrics is None:
            metrics = [(loss.sum(), n_correct(s, y)) for (loss, s), y in zip(outs, y_shards)]
        heads = [h[l].grad for h in acts] if l else None
        reduce(l, params, grads)
        del params, grads, outs
    return metrics
