"""A model's forward (models.contract) and `cross_entropy`, traced once into a symbolic graph and run as a cached op.

Imperatively every layer is a separate call from Python into MXNet (shape checks, allocation,
an engine push, an autograd node): about 30 calls forward and as many backward per device and
step. Built once with F=mx.sym, the network is one CachedOp call forward and one backward, with
memory planned once (static_alloc) and the backward ops pushed to the engine in bulk.

conv_pad: MXNet 1.9's oneDNN convolution takes only memory layouts of exactly the array's size,
so with 20 and 50 channels, not multiples of the CPU's vector block (8 floats with AVX2, 16 with
AVX-512), it cannot use its blocked (nChw8c) kernels: every convolution falls back to im2col and
GEMM, and the average pooling after it to a plain loop. Inside the graph the channels can be
zero-padded to a multiple of `conv_pad`: extra filters of zeros, whose outputs are 0 after ReLU and
pooling and meet zero rows of W3. The function and the gradients of the real parameters are the
same (concat's backward hands each its slice); only the order of float additions changes. Which
multiple is fastest depends on the CPU, so manual_dp.fast.autotune measures it.

A model with BatchNorm (models.batchnorm) normalises with each context's batch statistics inside
the graph (the namespace Batch hands its layers a symbolic Moments); the statistics, one (mean,
variance) per BatchNorm, are the graph's further outputs, which the strategy folds into the running
ones. --sync-batchnorm's statistics cross contexts mid-forward: that step stays imperative.

bulk: MXNet runs a cached graph's backward in segments of up to 15 operators, each one engine
operation, whose outputs (the gradients among them) are released only when the whole segment is
done: fewer engine pushes, but no gradient is ready before its segment ends. bulk=False runs
every backward operator on its own, so that gradient buckets can be all-reduced while the rest
of the backward runs (manual_dp.fast.buckets). timed=True unbulks the forward too, so that
MXNet's profiler times every operator (manual_dp.bench.kernels).
"""
import functools

import mxnet as mx
import numpy as np
from mxnet import autograd, nd

from ..models.contract import example_loss
from ..models import as_model
from ..models.batchnorm import Batch, Moments, moments_of
from ..models.dropout import Sites, row_keys

FLAGS = [("static_alloc", "true"), ("static_shape", "true")]
UNBULKED = [("backward_bulk_size", "0")]
TIMED = UNBULKED + [("forward_bulk_size", "0")]      # every operator its own engine operation


def loss_symbol(model, conv_pad=1, shapes=None, F=mx.sym):
    """Outputs (sum of the batch's losses, number correct), of inputs X, y and the model's
    parameters of `shapes` (default: the model's table), as `model.graph_params` lays them out.
    F: mx.sym, or models.dropout.Sites over it (then the dropout masks are inputs too), over
    models.batchnorm.Batch if the model has BatchNorms (then each one's batch mean and variance,
    (C,) each, are outputs too, after those two)."""
    X, y = mx.sym.var("X"), mx.sym.var("y")
    params = [mx.sym.var(name) for name in model.names()]
    params, shapes = model.graph_params(params, shapes or [shape for _, shape in model.shapes()], conv_pad)
    scores = model.forward(X, params, F=F, shapes=shapes)                  # (B, 10) or (B, T, vocab)
    T = model.spec.targets[0] if model.spec.targets else None              # next-token: T positions an example
    loss_sum = mx.sym.sum(example_loss(scores, y, F=mx.sym, tokens=T, aux=model.aux))     # (1,)
    if model.aux:                                                          # the aux row is no position
        scores = mx.sym.slice_axis(scores, axis=1, begin=0, end=T)
    correct = mx.sym.sum(mx.sym.argmax(scores, axis=-1) == mx.sym.cast(y, "float32")) * (1 / (T or 1))
    stats = [s for per_norm in (moments_of(F).batch if moments_of(F) else []) for s in per_norm[0]]
    return mx.sym.Group([mx.sym.make_loss(loss_sum), mx.sym.BlockGrad(correct)] + stats)


def lenet_loss_symbol(conv_pad=1, shapes=None):
    """loss_symbol of the lesson's LeNet of `shapes` (default width 1)."""
    return loss_symbol(as_model(None, [np.empty(s) for s in shapes] if shapes else None), conv_pad, shapes)


class ModelGraph:
    """Call as graph(X, y, params) under autograd.record(): (loss sum, correct) on X's context, and
    for a model with BatchNorms a third item, [mean, variance of each BatchNorm] of the batch;
    backward from the loss sum fills the parameters' gradients, as the imperative pass does.
    model: a models.Model (None: the lesson's LeNet of `shapes`); shapes: the parameters' shapes
    (default: the model's table)."""

    def __init__(self, conv_pad=1, shapes=None, bulk=True, model=None, timed=False):
        model = as_model(model, [np.empty(s) for s in shapes] if shapes else None)
        base = Batch(mx.sym, Moments(train=True, F=mx.sym)) if model.stats() else mx.sym
        self.sites = Sites(base, model.noise) if model.noise is not None else None
        self.symbol = loss_symbol(model, conv_pad, shapes, self.sites or base)
        self.stats = bool(model.stats())
        self.conv_pad, self.bulk, self.param_names = conv_pad, bulk, model.names()
        self.names = self.symbol.list_inputs()
        self.op = nd.CachedOp(self.symbol, FLAGS + (TIMED if timed else [] if bulk else UNBULKED))

    def __call__(self, X, y, params):
        inputs = dict(zip(self.param_names, params), X=X, y=y)
        if self.sites is not None and self.sites.inputs:
            inputs.update(self.masks(X, params))
        outs = self.op(*[inputs[name] for name in self.names])
        return (outs[0], outs[1], outs[2:]) if self.stats else (outs[0], outs[1])

    @functools.lru_cache(maxsize=8)
    def input_shapes(self, X_shape, param_shapes):
        """{input name: shape} of the graph for images of X_shape (the masks' shapes inferred)."""
        return dict(zip(self.names, self.symbol.infer_shape(X=X_shape, **dict(zip(self.param_names, param_shapes)))[0]))

    def masks(self, X, params):
        """{mask input: the dropout masks of X's examples} for this call (ones outside a training
        batch), drawn as models.dropout draws them in any other layout."""
        shapes = self.input_shapes(X.shape, tuple(p.shape for p in params))
        noise, keys = self.sites.noise, None
        out = {}
        for name, (site, rate) in self.sites.inputs.items():
            if noise.batch is None:
                out[name] = nd.ones(shapes[name], ctx=X.context)
                continue
            keys = row_keys(X) if keys is None else keys
            out[name] = noise.mask(keys, site, shapes[name][1:], 0, X.context, rate)
        return out


def graph_forward_backward(graph, X_shards, y_shards, device_params, on_forward=None):
    """forward_backward through the model's cached graph: one call per context, one backward for all
    (on_forward(losses), if given, is called in between)."""
    with autograd.record():
        metrics = [graph(X, y, W) for X, y, W in zip(X_shards, y_shards, device_params)]
    if on_forward:
        on_forward([m[0] for m in metrics])
    autograd.backward([m[0] for m in metrics])
    return metrics
