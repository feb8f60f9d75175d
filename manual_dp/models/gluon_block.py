"""The user's own Gluon block under the model contract: `--model PATH.py:FUNCTION`, where FUNCTION()
returns a HybridBlock that maps images (B, 1, 28, 28) to 10 class scores.

A HybridBlock's hybrid_forward is already a pure function of its parameters (Gluon 1.9): calling
a child on a symbol gives a graph whose free inputs are "data" and the child's parameters. So
each child of a HybridSequential (or the whole block, if it is not one) becomes one layer whose
parameters are read off that graph, whose shapes are inferred from one forward of a dummy batch,
and whose forward runs the graph as a CachedOp (nd) or composes it (sym) with the strategy's own
arrays. The initial values are the block's own initialisation, seeded.

Tensor parallelism (AutoTP, as DeepSpeed does for layer kinds it knows): consecutive Dense children
are split in pairs, the first by output units (column-parallel), the second by input units
(row-parallel, its bias and activation after g); every other child runs whole on every context.

A Dropout child becomes a dropout site of its own rate (models/dropout.py): its masks are drawn per
(batch, example), the same in every layout, where MXNet's Dropout would draw from each device's
generator. --dropout does not apply: the block's rates are its own.

A BatchNorm child becomes a layer with running statistics (models/batchnorm.py), its gamma and beta
the block's own, its running mean and variance the layer's stats: normalised by hand, per context
or with --sync-batchnorm over every context, in every strategy that carries ResNet's (sync, ZeRO,
local SGD, across processes). Its settings must be Gluon's defaults, which models/batchnorm.py
computes (axis 1, eps 1e-5, momentum 0.9, a trained gamma and beta).

Refused, in one line: a file that is missing or does not define FUNCTION, a file or FUNCTION that
raises or calls sys.exit, a FUNCTION that returns no HybridBlock, a child Gluon cannot hybridise
(its forward reads x.shape or values: checked on symbols before any array is made), a block too
large for the machine (models/room.py, before it allocates), a block that fails on a dummy batch of
two of the data's examples (Fashion-MNIST's (1, 28, 28) images by default) or does not give one score
per class for each, a Dropout of rate 1, a BatchNorm with other settings or
inside another child (its running statistics would be hidden in that child's graph).
"""
import importlib.util
import os

import numpy as np

from ..errors import UsageError
from .batchnorm import EPS, MOMENTUM, Batch, norm_group, single
from .contract import IMAGE, Layer, Model, Param, add_bias, pair_roles, pair_traffic, split_pairs
from .dropout import Noise, dropout


def load_block(spec):
    """FUNCTION() of the file in "PATH.py:FUNCTION": the user's HybridBlock, or UsageError."""
    from mxnet import gluon
    path, sep, func = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not func:
        raise UsageError(f"--model {spec}: name a built-in model or PATH.py:FUNCTION")
    if not os.path.isfile(path):
        raise UsageError(f"--model {spec}: no file {path}")
    try:
        module_spec = importlib.util.spec_from_file_location(f"manual_dp_user_{abs(hash(path))}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    except SystemExit as e:
        raise UsageError(f"--model {spec}: {path} called sys.exit({e.code!r}) as it loaded: a model file must not exit") from None
    except Exception as e:                   # the user's code: any error is theirs, reported in one line
        raise UsageError(f"--model {spec}: {path} failed to load ({why(e)})") from None
    fn = getattr(module, func, None)
    if not callable(fn):
        raise UsageError(f"--model {spec}: {path} defines no function {func}")
    try:
        block = fn()
    except SystemExit as e:
        raise UsageError(f"--model {spec}: {func}() called sys.exit({e.code!r}): a model function must not exit") from None
    except Exception as e:
        raise UsageError(f"--model {spec}: {func}() raised {why(e)}") from None
    if not isinstance(block, gluon.HybridBlock):
        raise UsageError(f"--model {spec}: {func}() returned {type(block).__name__}, not a Gluon HybridBlock")
    return block


def why(e):
    """An exception of the user's code in a few words, on one line (sys.exit(n) as what it is)."""
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r}), which a model must not do"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}".rstrip(": ")


def symbolic_sizes(spec, kids, shape=IMAGE):
    """The parameters of the block (children `kids`) and its running statistics, counted from a
    pass over symbols (no array made), or None where their shapes cannot be inferred. UsageError,
    naming the child and why, for a child Gluon cannot hybridise (one that reads x.shape or calls
    asnumpy(): its hybrid_forward is given symbols, which have neither)."""
    import mxnet as mx
    h = mx.sym.var("data")
    for i, child in enumerate(kids):
        try:
            h = child(h)
        except (Exception, SystemExit) as e:
            raise UsageError(f"--model {spec}: layer {i} ({child.name}, a {type(child).__name__}) cannot be hybridised: "
                             f"its forward must run on symbols, which have no shape or values ({why(e)})") from None
    try:
        args, _, aux = h.infer_shape(data=(2,) + tuple(shape))
    except Exception:                                       # noqa: BLE001 (MXNetError: shapes left open)
        return None
    if args is None or any(0 in s for s in args + aux):
        return None
    return sum(int(np.prod(s)) for n, s in zip(h.list_arguments(), args) if n != "data") + \
        sum(int(np.prod(s)) for s in aux)


def children(block):
    """The layers: a HybridSequential's children, else the block as one layer."""
    from mxnet import gluon
    if isinstance(block, gluon.nn.HybridSequential) and len(block):
        return [block[i] for i in range(len(block))]
    return [block]


def io_sizes(kids, block, shape=IMAGE):
    """[(input, output elements, forward FLOPs) per example] of each child, from one pass of a
    dummy batch: a dense or convolution layer's FLOPs are 2 x its outputs x its weight's fan-in
    (kinds it does not know count 0)."""
    import mxnet as mx
    from mxnet import nd
    h, out = nd.zeros((2,) + tuple(shape), ctx=mx.cpu(0)), []
    for child in kids if len(kids) > 1 else [block]:
        n_in = h.size // 2
        h = child(h)
        weight = getattr(child, "weight", None)
        fan_in = int(np.prod(weight.shape[1:])) if weight is not None and None not in weight.shape else 0
        out.append((n_in, h.size // 2, 2 * (h.size // 2) * fan_in))
    return out


def make_forward(symbol, names):
    """forward(h, params, F, shapes) running `symbol` (inputs "data" and `names`) on arrays or
    symbols."""
    from mxnet import nd
    order = symbol.list_inputs()
    op = nd.CachedOp(symbol)

    def forward(h, params, F=nd, shapes=None):
        given = dict(zip(names, params), data=h)
        if isinstance(h, nd.NDArray):                      # F: nd, or nd drawing dropout masks
            return op(*[given[name] for name in order])
        return symbol(**given)
    return forward


def dropout_layer(i, child, site, size):
    """Layer i, the Dropout `child` as dropout site `site` at the child's rate; size: its elements
    per example."""
    from mxnet import nd
    if child._axes:
        raise UsageError(f"layer {i}: Dropout with axes {child._axes} (a mask shared along axes) is not supported")
    if not 0 <= child._rate < 1:
        raise UsageError(f"layer {i}: Dropout({child._rate}) would drop every unit: a rate must be in [0, 1)")

    def forward(h, params, F=nd, shapes=None):
        return dropout(h, site, F, rate=child._rate)
    return Layer(f"{i}:Dropout", (), forward, 0, size, size, kind="gluon", extra={"type": "Dropout"})


def batchnorm_layer(i, child, size):
    """Layer i, the BatchNorm `child`: its gamma and beta as parameters (the block's values), its
    running mean and variance as stats; size: its elements per example. UsageError for settings
    other than Gluon's defaults (see the module's docstring)."""
    kw = child._kwargs
    given = dict(axis=kw["axis"], eps=kw["eps"], momentum=kw["momentum"], fix_gamma=kw["fix_gamma"],
                 use_global_stats=kw["use_global_stats"], center=child.beta.grad_req != "null",
                 scale=child.gamma.grad_req != "null")
    if given != dict(axis=1, eps=EPS, momentum=MOMENTUM, fix_gamma=False, use_global_stats=False, center=True, scale=True):
        raise UsageError(f"layer {i}: BatchNorm({', '.join(f'{k}={v}' for k, v in given.items())}): only Gluon's "
                         f"defaults are supported (axis=1, eps={EPS}, momentum={MOMENTUM}, center and scale)")
    shape = tuple(child.gamma.shape)
    params = tuple(Param(stable_name(i, child, p.name), shape, "given") for p in (child.gamma, child.beta))
    stats = (Param(stable_name(i, child, child.running_mean.name), shape, "zeros"),
             Param(stable_name(i, child, child.running_var.name), shape, "ones"))
    return Layer(f"{i}:BatchNorm", params, single(norm_group), 8 * size, size, 2 * size, kind="gluon",
                 extra={"type": "BatchNorm"}, stats=stats)


def stable_name(i, child, name):
    """A parameter's name by its child's position: "2.weight" for the third child's dense0_weight
    (Gluon's prefixes number every block a process makes, so they differ between runs)."""
    return f"{i}.{name[len(child.prefix):] if name.startswith(child.prefix) else name}"


class GluonModel(Model):
    """The block of "PATH.py:FUNCTION" as layers (see the module's docstring)."""

    def __init__(self, spec, seed=0, room=None, data=None):
        """room: a models.room.Room, checked before the block allocates its parameters; data: the
        datasets.Spec of what it reads (default Fashion-MNIST's images; token ids arrive as floats,
        as Gluon's Embedding reads them)."""
        import mxnet as mx
        from mxnet import nd
        from ..datasets import IMAGES
        self.spec = data = data or IMAGES
        shape, classes = tuple(data.shape), data.classes
        self.name, self.config = spec, {"source": spec}
        block = load_block(spec)
        n = symbolic_sizes(spec, children(block), shape)
        if room is not None and n is not None:
            room.check(n, 0, own=2)           # the block's arrays and self.values, kept besides the run's
        mx.random.seed(seed)
        try:
            block.initialize(ctx=mx.cpu(0))
            out = block(nd.zeros((2,) + shape, ctx=mx.cpu(0)))
        except (Exception, SystemExit) as e:
            raise UsageError(f"--model {spec}: the block failed on a {(2,) + shape} batch ({why(e)})") from None
        if not isinstance(out, nd.NDArray) or out.shape != (2, classes):
            raise UsageError(f"--model {spec}: the block gives {getattr(out, 'shape', type(out).__name__)} "
                             f"for 2 examples of {data.describe()}, not (2, {classes}) class scores")
        values = {p.name: p.data().asnumpy() for p in block.collect_params().values()}
        self.values, layers = {}, []
        kids = children(block)
        self.dense = [child if isinstance(child, mx.gluon.nn.Dense) else None for child in kids]
        self.roles = pair_roles(len(kids), lambda i: self.dense[i] is not None)
        sizes = io_sizes(kids, block, shape)
        for i, child in enumerate(kids):
            if isinstance(child, mx.gluon.nn.Dropout):
                layers.append(dropout_layer(i, child, sum(layer.extra["type"] == "Dropout" for layer in layers),
                                            sizes[i][0]))
                continue
            if isinstance(child, mx.gluon.nn.BatchNorm):
                layers.append(batchnorm_layer(i, child, sizes[i][0]))
                self.values.update({p.name: values[q.name] for p, q in zip(layers[-1].params, (child.gamma, child.beta))})
                continue
            symbol = child(mx.sym.var("data"))
            if symbol.list_auxiliary_states():
                raise UsageError(f"--model {spec}: layer {child.name} keeps running statistics "
                                 f"({', '.join(symbol.list_auxiliary_states())}) inside it; a BatchNorm is "
                                 f"supported as a child of the HybridSequential itself")
            names = [n for n in symbol.list_arguments() if n != "data"]
            axes = self.split_axes(i)
            stable = [stable_name(i, child, n) for n in names]     # Gluon's own names count blocks made
            params = tuple(Param(s, tuple(values[n].shape), "given", split=axes.get(n)) for s, n in zip(stable, names))
            self.values.update({s: values[n] for s, n in zip(stable, names)})
            n_in, n_out, flops = sizes[i]
            layers.append(Layer(f"{i}:{type(child).__name__}", params, make_forward(symbol, names), flops,
                                n_in, 2 * n_out, kind="gluon", extra={"type": type(child).__name__}))
        self.layers = tuple(layers)
        self.outputs = [s[1] for s in sizes]
        self.noise = Noise(0.0, seed) if self.dropout_sites() else None

    def layer_group(self, l, hs, own, moments, Fs=None):
        """Layer l on every context at once: a BatchNorm child normalising with `moments`, a
        Dropout child with each context's masks (Fs[c])."""
        if self.layers[l].extra["type"] == "BatchNorm":
            return norm_group(hs, own, moments)
        return super().layer_group(l, hs, own, moments, Fs)

    def dropout_sites(self):
        return sum(layer.extra["type"] == "Dropout" for layer in self.layers)

    def drop(self, noise):
        raise ValueError("--dropout: a Gluon block's Dropout children keep their own rates (without "
                         "Dropout children it has no dropout sites)")

    def tensor_traffic(self):
        return pair_traffic(self.layers, self.roles, self.outputs)

    def split_axes(self, i):
        """{parameter name: axis} that tensor parallelism cuts in child i (a Dense of a pair)."""
        role, dense = self.roles.get(i), self.dense[i]
        if role is None:
            return {}
        bias = {dense.bias.name: 0} if dense.bias is not None and role == "column" else {}
        return {dense.weight.name: 0 if role == "column" else 1, **bias}

    def dense_forward(self, l, h, p, partial=None, F=None):
        """Dense child l on its shard: x W^T (+ b), then its activation; partial=True: the row
        layer's product alone (summed by g next), partial=False: its bias and activation after."""
        from mxnet import nd
        F, dense = F or nd, self.dense[l]
        if partial is False:
            out = add_bias(h, p[1], F) if len(p) > 1 else h
        else:
            w, b = p[0], (p[1] if len(p) > 1 and not partial else None)
            out = F.FullyConnected(h, w, b, no_bias=b is None, num_hidden=w.shape[0], flatten=dense._flatten)
            if partial:
                return out
        return F.Activation(out, act_type=dense.act._act_type) if dense.act is not None else out

    def split_forward(self, Xs, shards, join, F=None, moments=None):
        """Class scores on a tensor group (split_pairs); moments: one Moments per context, what its
        BatchNorms (whole on every context) normalise with."""
        from mxnet import nd
        F = [self.noisy(Batch(F or nd, M), X) for M, X in zip(moments, Xs)] if moments else self.noisy(F or nd, Xs[0])
        return split_pairs(Xs, shards, join, self.layers, self.slices(), self.roles,
                           self.dense_forward, self.dense_forward, F)

    def tensor_refusal(self, T):
        if not self.roles:
            return (f"{T}: {self.name} has no two consecutive Dense layers to split as a column/row "
                    f"pair (AutoTP splits only Dense pairs)")
        bad = [f"{p.name} {p.shape}" for layer in self.layers for p in layer.params
               if p.split is not None and p.shape[p.split] % T]
        return f"{T} does not divide the split units of {', '.join(bad)}" if bad else None

    def init_params(self, seed=0, scale=None, ctx=None):
        """The block's own initial values (seeded when it was built), copied to `ctx`."""
        import mxnet as mx
        from mxnet import nd
        return [nd.array(np.asarray(self.values[p.name], np.float32), ctx=ctx or mx.cpu(0))
                for p in self.param_table()]
