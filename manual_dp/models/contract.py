"""The model contract: how a network describes itself to the parallel code, in one place.

A model is an ordered list of layers. Each layer owns a consecutive run of the model's flat
parameter list and declares:

    params    its parameters: name, shape, initialiser, and the axis tensor parallelism cuts
              (None: replicated on every context of a tensor group)
    forward   forward(h, params, F=nd, shapes=None) -> h: a pure function of its parameters and its
              input; F=mx.sym builds the same layer as a symbol (shapes then say the parameters')
    flops     forward FLOPs per example (2 per multiply-add), for balancing a pipeline and the planner
    inputs    elements per example of its input (what a pipeline stage starting at it receives)
    acts      activation elements per example that its ops output and its recorded forward keeps
              for the backward (its input not included)
    kind      what a strategy may do with it by hand: "conv" and "dense" (a weight and a bias, the
              lesson's layouts), anything else ("block", "embed", "head", "gluon") is run through
              autograd as a whole
    stats     running statistics (Params of init "zeros" or "ones"): state that no gradient trains,
              BatchNorm's running means and variances (models.batchnorm); a model with any runs
              a step on all its contexts at once (Model.forward_group)
    split_forward   split_forward(hs, shards, join, F=nd) -> hs: the layer on the T contexts of a
              tensor group, each holding its shards of the layer's parameters (Param.split), joined
              by Megatron's f and g (join.f, join.g); None: the layer runs whole on every context
    sequence_forward   sequence_forward(hs, params, seq, F=nd) -> hs: the layer on the C contexts
              of a context-parallel group, context j holding tokens seq.bounds[j]:seq.bounds[j+1]
              of every example and the whole parameters (params[j], on its context); seq.attend
              (ring or Ulysses attention) and seq.sum (the sum over the group) join the blocks
              (strategies/context/context.py); None: a token-wise layer, run on each block as it is
    grid_forward   grid_forward(hs, params, join, seq, F=nd) -> hs: a split layer on a grid of C x T
              contexts, hs[c][t] block c of the tokens on tensor rank t (params[c][t] its shards):
              each row a tensor group (join), each column a context-parallel group (seq)
    expert_forward   expert_forward(hs, params, group, Fs) -> hs: an MoE layer on the N contexts of
              an expert-parallel group, hs[j] context j's own rows, params[j] its parameters with
              those of Layer.extra["expert_params"] cut along axis 0 (its E/N experts), Fs[j] its
              namespace; group.send and group.back are the all-to-alls (strategies/expert/)

A model with dropout holds `noise` (models.dropout.Noise): its layers call dropout(h, site, F), whose
masks depend on the batch and the example, never on the layout; the model's forward and its group
forms start F from noisy(F, X), and a strategy that runs layers stage by stage does the same for
each micro-batch.

Everything that used to read LeNet's shapes reads a Model instead: the flat buffers and buckets
(shapes), checkpoints (describe), ZeRO's per-layer gathers (slices), pipeline stages (layers, cut),
memory and FLOP counts (inputs, acts, flops). A layer is what a pipeline cuts between and what ZeRO-3
gathers at once (PyTorch FSDP2's unit). No strategy names a model.
"""
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import numpy as np
from mxnet import nd

from .dropout import noisy
from ..datasets import IMAGES
from ..lesson import cross_entropy, n_correct
from ..precision import float32_ops

IMAGE = (1, 28, 28)        # Fashion-MNIST, as every model here reads it
CLASSES = 10


@dataclass(frozen=True)
class Param:
    """One parameter: `init` is "he" (normal, std sqrt(2 / fan_in)), "lecun" (std sqrt(1 / fan_in)),
    "normal" (std `std`), "zeros", "ones" or "given" (the model supplies values); --init-scale
    replaces the std of "he" and "lecun". `split`: the axis tensor parallelism cuts, or None."""
    name: str
    shape: Tuple[int, ...]
    init: str = "zeros"
    fan_in: int = 0
    std: float = 0.0
    split: Optional[int] = None

    @property
    def size(self):
        return int(np.prod(self.shape))


@dataclass(frozen=True)
class Layer:
    """One layer: its parameters and its pure forward function (see the module's table)."""
    name: str
    params: Tuple[Param, ...]
    forward: Callable
    flops: int = 0
    inputs: int = 0
    acts: int = 0
    kind: str = "block"
    extra: dict = field(default_factory=dict, compare=False)
    split_forward: Optional[Callable] = None
    stats: Tuple[Param, ...] = ()
    sequence_forward: Optional[Callable] = None
    grid_forward: Optional[Callable] = None
    expert_forward: Optional[Callable] = None


def draw(param, rng, scale=None):
    """Initial float32 values of `param`, drawn from `rng` (nothing drawn for zeros and ones)."""
    if param.init in ("zeros", "ones"):
        return (np.zeros if param.init == "zeros" else np.ones)(param.shape, dtype=np.float32)
    if param.init in ("he", "lecun"):
        std = scale if scale is not None else np.sqrt((2.0 if param.init == "he" else 1.0) / param.fan_in)
    elif param.init == "normal":
        std = param.std
    else:
        raise ValueError(f"parameter {param.name}: the model gives its values (init {param.init!r})")
    return rng.normal(0.0, std, size=param.shape).astype(np.float32)


class Model:
    """A network as an ordered list of layers (set `name`, `config` and `layers` in a subclass).

    The class scores of images X (B, 1, 28, 28) are the layers applied in order; the loss is the
    lesson's cross-entropy. `config` holds the sizes that define the model (saved in checkpoints).
    """
    name = "model"
    spec = IMAGES       # what one example is (datasets.Spec): Fashion-MNIST's images unless the model says
    config = {}
    layers = ()
    noise = None               # models.dropout.Noise of a model with dropout sites
    causal = False             # attention only to earlier tokens (the GPT's): a context-parallel group
                               # then cuts the sequence in balanced chunks (fast/causal_attention.py)
    aux = False                # its scores (B, T + 1, vocab) end in a row of each example's auxiliary loss
                               # (an MoE GPT's load balancing, models/moe.py): example_loss adds it
    largest = float("inf")     # the largest magnitude its products hold: a parameter past it has diverged
                               # (models/precise.py: fp16's 65504)

    def noisy(self, F, X):
        """The namespace for a forward from images X: F, drawing this batch's dropout masks for X's
        examples when the model has dropout and a training batch is on (models.dropout)."""
        return noisy(F, self.noise, X)

    def dropout_sites(self):
        """How many dropout sites its layers hold (models.dropout): none by default."""
        return 0

    def drop(self, noise):
        """Afterwards its dropout sites draw `noise`'s masks; ValueError (one line) if it has none."""
        if not self.dropout_sites():
            raise ValueError(f"--dropout: {self.name} has no dropout sites (the transformer has, and a Gluon "
                             f"block with Dropout children)")
        self.noise = noise
        return self

    # -- the parameter table ------------------------------------------------------------------
    def param_table(self):
        """Every Param, layer after layer: the model's flat order."""
        return [p for layer in self.layers for p in layer.params]

    def shapes(self):
        """[(name, shape)] in the flat order (for LeNet: the lesson's LENET_SHAPES)."""
        return [(p.name, p.shape) for p in self.param_table()]

    def names(self):
        return [p.name for p in self.param_table()]

    def slices(self):
        """The slice of the flat parameter list each layer owns."""
        out, start = [], 0
        for layer in self.layers:
            out.append(slice(start, start + len(layer.params)))
            start += len(layer.params)
        return out

    def stats(self):
        """Every running statistic, layer after layer (none for most models)."""
        return [p for layer in self.layers for p in layer.stats]

    def init_stats(self, ctx=None):
        """The running statistics' initial values on `ctx` (zeros and ones: nothing is drawn)."""
        import mxnet as mx
        return [nd.array(draw(p, None), ctx=ctx or mx.cpu(0)) for p in self.stats()]

    def forward_group(self, Xs, shards, moments):
        """Class scores on every context of a data-parallel step at once, from each context's
        images and parameters; `moments` (models.batchnorm.Moments) is what BatchNorms normalise
        with. A model with running statistics runs layer by layer (layer_group), one without each
        context on its own."""
        if not self.stats():
            return [self.forward(X, P) for X, P in zip(Xs, shards)]
        hs, Fs = Xs, [self.noisy(nd, X) for X in Xs]
        for l, s in enumerate(self.slices()):
            hs = self.layer_group(l, hs, [P[s] for P in shards], moments, Fs)
        return hs

    def layer_group(self, l, hs, own, moments, Fs=None):
        """Layer l on every context of a data-parallel step at once (ZeRO's layer-at-a-time
        forward of a model with running statistics): hs[c] its input, own[c] its parameters on
        context c, `moments` as in forward_group, Fs[c] context c's namespace (Model.noisy: its
        dropout masks; default nd). By default each context on its own."""
        layer, Fs = self.layers[l], Fs or [nd] * len(hs)
        return [layer.forward(h, P, F, [p.shape for p in P]) for h, P, F in zip(hs, own, Fs)]

    def n_params(self):
        return sum(p.size for p in self.param_table())

    def summary(self):
        """"N parameters in L layers", naming those without parameters (a Flatten): every layout
        runs them, and ZeRO gathers and reduce-scatters nothing for them."""
        bare = [layer.name for layer in self.layers if not layer.params]
        return (f"{self.n_params():,} parameters in {len(self.layers)} layers"
                + (f" ({', '.join(bare)} without parameters: nothing for ZeRO to gather or reduce)" if bare else ""))

    def flops_per_example(self):
        """(forward, forward + backward) FLOPs of one example: backward two products per layer,
        one for the first (its input needs no gradient)."""
        fwd = [layer.flops for layer in self.layers]
        return sum(fwd), sum(fwd) + fwd[0] + 2 * sum(fwd[1:]) if fwd else 0

    def describe(self):
        """What a checkpoint and a log record keep of the model: its name, sizes and table."""
        out = {"name": self.name, "config": dict(self.config),
               "params": [[name, list(shape)] for name, shape in self.shapes()]}
        if self.stats():
            out["stats"] = [[p.name, list(p.shape)] for p in self.stats()]
        return out

    # -- values -------------------------------------------------------------------------------
    def init_params(self, seed=0, scale=None, ctx=None):
        """Fresh parameters on `ctx` (default cpu(0)), reproducible from `seed`: one RandomState
        drawn from in the flat order (see `draw`)."""
        import mxnet as mx
        ctx = ctx or mx.cpu(0)
        rng = np.random.RandomState(seed)
        return [nd.array(draw(p, rng, scale), ctx=ctx) for p in self.param_table()]

    # -- the function -------------------------------------------------------------------------
    def forward(self, X, params, F=nd, shapes=None):
        """Class scores (B, 10) of images X (B, 1, 28, 28); params in the flat order, on X's
        context. F=mx.sym: symbols, whose shapes are `shapes`."""
        shapes = shapes or [p.shape for p in params]
        h, F = X, self.noisy(F, X)
        for layer, s in zip(self.layers, self.slices()):
            h = layer.forward(h, params[s], F, shapes[s])
        return h

    def split_forward(self, Xs, shards, join, F=nd):
        """Class scores on every context of a tensor group (Megatron's split) from copies of the
        images Xs, one per context, and shards[j], context j's pieces of the parameters (cut by
        Param.split); join.f and join.g are the conjugate operators (fast.tensor_ops); F: the
        operators' namespace (nd, or manual_dp.precision's). By default each layer's
        split_forward, or the whole layer on every context; a run of split layers is entered
        through join.shard and left through join.unshard (Megatron-SP cuts the sequence there;
        plain tensor parallelism does nothing)."""
        hs, inside, F = Xs, False, self.noisy(F, Xs[0])
        for layer, s in zip(self.layers, self.slices()):
            own = [P[s] for P in shards]
            if bool(layer.split_forward) != inside:
                hs, inside = (join.unshard(hs) if inside else join.shard(hs)), not inside
            hs = layer.split_forward(hs, own, join, F) if layer.split_forward else \
                [layer.forward(h, q, F, [p.shape for p in q]) for h, q in zip(hs, join.leads(own))]
        return join.unshard(hs) if inside else hs

    def sequence_forward(self, Xs, params, seq, F=nd):
        """Class scores on every context of a context-parallel group (each the same) from copies of
        the images Xs, one per context, and params[j], context j's copy of the whole parameters:
        each layer's sequence_forward, or a token-wise layer on each context's block of tokens."""
        hs, F = Xs, self.noisy(F, Xs[0])
        for layer, s in zip(self.layers, self.slices()):
            own = [P[s] for P in params]
            hs = layer.sequence_forward(hs, own, seq, F) if layer.sequence_forward else \
                [layer.forward(h, q, F, [p.shape for p in q]) for h, q in zip(hs, own)]
        return hs

    def grid_forward(self, Xs, params, join, seq, F=nd):
        """Class scores on a C x T grid (context x tensor parallel): Xs[c][t] copies of the images,
        params[c][t] tensor shard t of the parameters; each layer's grid_forward, a layer with a
        sequence_forward on each column (a context-parallel group), a token-wise one on each block."""
        hs, F = Xs, self.noisy(F, Xs[0][0])
        for layer, s in zip(self.layers, self.slices()):
            hs = grid_layer(layer, hs, [[P[s] for P in row] for row in params], join, seq, F)
        return hs

    def expert_forward(self, Xs, params, group):
        """Scores on every context of an expert-parallel group, each of its own rows Xs[j], from
        params[j], context j's parameters (its shards of the experts): each layer's
        expert_forward, or the layer on each context alone."""
        hs, Fs = Xs, [self.noisy(nd, X) for X in Xs]
        for layer, s in zip(self.layers, self.slices()):
            own = [P[s] for P in params]
            hs = layer.expert_forward(hs, own, group, Fs) if layer.expert_forward else \
                [layer.forward(h, q, F, [p.shape for p in q]) for h, q, F in zip(hs, own, Fs)]
        return hs

    def expert_params(self):
        """Flat indices of the parameters expert parallelism cuts along axis 0 (an MoE's experts)."""
        return [s.start + i for layer, s in zip(self.layers, self.slices()) for i in layer.extra.get("expert_params", ())]

    def grid_refusal(self, C, T, attention):
        """Why the model cannot run on a C x T grid, or None: every split layer needs a grid_forward."""
        if any(layer.split_forward and not layer.grid_forward for layer in self.layers):
            return f"{self.name} has split layers without a grid_forward: cp with tp is not built for it"
        return self.tensor_refusal(T) or self.sequence_refusal(C, attention)

    def sequence_refusal(self, C, attention):
        """Why the model's sequence cannot be cut into C blocks for `attention` ("ring" or
        "ulysses"; None: Megatron-SP's cut, attention run whole after an all-gather), in a few
        words; None if it can. By default: a model without a sequence (no
        layer with a sequence_forward) refuses."""
        if not any(layer.sequence_forward for layer in self.layers):
            return f"{self.name} has no sequence of tokens to cut"
        return None

    def splits_by_layer(self):
        """True if tensor parallelism splits the model layer by layer (each Layer.split_forward, so
        a pipeline may cut between them); False for a model that splits as a whole (LeNet's pairs)."""
        return type(self).split_forward is Model.split_forward

    def tensor_traffic(self):
        """[(what, elements per example, "forward" | "backward")]: what Megatron's f and g of
        split_forward all-reduce per example and step (g sums partial outputs in the forward, f
        the input gradients in the backward), so that communication is counted, not estimated.
        By default each splitting layer's Layer.extra["traffic"]."""
        return [t for layer in self.layers for t in layer.extra.get("traffic", ())]

    def tensor_refusal(self, T):
        """Why the model cannot be split over T contexts, in a few words; None if it can. By
        default: a split axis that T does not divide, or no layer that splits (a model that
        overrides split_forward splits itself)."""
        if type(self).split_forward is Model.split_forward and not any(layer.split_forward for layer in self.layers):
            return f"{self.name} has no layer that tensor parallelism splits"
        bad = [p.name for p in self.param_table() if p.split is not None and p.shape[p.split] % T]
        return f"{T} does not divide the split axis of {', '.join(bad)}" if bad else None

    def graph_params(self, params, shapes, pad):
        """(params, shapes) as the cached graph should see them: a model may pad channels to the
        CPU's vector block (LeNet does; see fast.graph); the rest ignore `pad`."""
        return params, shapes

    def cuts(self, n_stages):
        """The layers of each of `n_stages` pipeline stages (tuples of layer indices), balanced by
        the layers' FLOPs: the cut whose most expensive stage is cheapest, earliest on ties."""
        return balanced_cuts([max(layer.flops, 1) for layer in self.layers], n_stages)


def grid_layer(layer, hs, own, join, seq, F=nd):
    """One layer on a C x T grid (Model.grid_forward): hs[c][t] its input on each context, own[c] the
    layer's parameters as each piece of row c sees them (join.k a context); its grid_forward, or its sequence_forward on
    each column (a context-parallel group), or the layer on each block as it is."""
    if layer.grid_forward:
        return layer.grid_forward(hs, own, join, seq, F)
    own = [join.for_row(c).leads(prow) for c, prow in enumerate(own)]   # each context's view (k pieces a context)
    if layer.sequence_forward:
        cols = [layer.sequence_forward([row[t] for row in hs], [row[t] for row in own], seq, F)
                for t in range(len(hs[0]))]
        return [[col[c] for col in cols] for c in range(len(hs))]
    return [[layer.forward(h, q, F, [p.shape for p in q]) for h, q in zip(row, prow)] for row, prow in zip(hs, own)]


def balanced_cuts(costs, n_stages):
    """Consecutive runs of len(costs) items in n_stages non-empty groups minimising the largest
    group's cost (dynamic programming over the cut points)."""
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"{n} layers cannot be cut into {n_stages} stages")
    prefix = np.concatenate([[0], np.cumsum(costs)])
    best = {(0, 0): (0, ())}                          # (items used, stages) -> (max cost, cut ends)
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            options = [(max(best[(j, s - 1)][0], prefix[i] - prefix[j]), best[(j, s - 1)][1] + (i,))
                       for j in range(s - 1, i) if (j, s - 1) in best]
            best[(i, s)] = min(options, key=lambda o: (o[0], o[1]))
    ends = (0,) + best[(n, n_stages)][1]
    return tuple(tuple(range(a, b)) for a, b in zip(ends, ends[1:]))


def pair_roles(n_layers, splittable):
    """Megatron's plan for consecutive splittable dense layers: {layer: "column" | "row"}, pairs
    of a column-parallel layer and the row-parallel layer after it; the rest stay whole."""
    roles, i = {}, 0
    while i + 1 < n_layers:
        if splittable(i) and splittable(i + 1):
            roles[i], roles[i + 1] = "column", "row"
            i += 2
        else:
            i += 1
    return roles


def pair_traffic(layers, roles, outputs):
    """tensor_traffic of dense pairs: f on a column layer's input gradient (but the first layer's,
    the images need none), g on a row layer's output; outputs[l]: layer l's output elements."""
    out = []
    for l, role in sorted(roles.items()):
        if role == "column" and l:
            out.append((f"f: {layers[l].name}'s input gradient", layers[l].inputs, "backward"))
        elif role == "row":
            out.append((f"g: {layers[l].name}'s partial output", outputs[l], "forward"))
    return out


def split_pairs(hs, shards, join, layers, slices, roles, column, row, F=nd):
    """Class scores on a tensor group for a model of dense pairs (pair_roles): a column layer
    entered through f, column(l, h, params, F=F) on each piece's shard; a row layer's partial
    products row(l, h, params, True, F=F) summed by g, then row(l, s, params, False, F=F) adds its
    bias and activation on each context; other layers whole on every context. shards: one per
    piece (join.k a context). F: the operators' namespace, or a list of one per context (each
    context's BatchNorms their own Moments)."""
    def each(n):
        return F if isinstance(F, list) else [F] * n
    for l, (layer, s) in enumerate(zip(layers, slices)):
        own = [P[s] for P in shards]
        if roles.get(l) == "column":
            ins = join.f(hs) if l else join.spread(hs)
            hs = [column(l, h, q, F=Fj) for h, q, Fj in zip(ins, own, each(len(ins)))]
        elif roles.get(l) == "row":
            parts = [row(l, h, q, True, F=Fj) for h, q, Fj in zip(hs, own, each(len(hs)))]
            hs = [row(l, h, q, False, F=Fj) for h, q, Fj in zip(join.g(parts), join.leads(own), each(len(parts)))]
        else:
            hs = [layer.forward(h, q, Fj, [p.shape for p in q]) for h, q, Fj in zip(hs, join.leads(own), each(len(hs)))]
    return hs


def example_loss(scores, y, F=nd, tokens=None, aux=False):
    """Each example's loss (B,): the lesson's cross-entropy of class scores (B, classes) and labels
    (B,); of next-token scores (B, T, vocab) and tokens y (B, T) (the data contract's two tasks),
    the mean of the T positions' cross-entropies, a product with ones / T (MXNet 1.9's mean over
    an axis differentiates through a slow reduce). `tokens`: T, for symbols, whose shape F cannot
    read. Scores of T + 1 rows (a Model with `aux`; `aux` says so for symbols) end in a row whose
    column 0 is the example's auxiliary loss, added to it (models/moe.py)."""
    if aux or carries_aux(scores, y):
        T = tokens or y.shape[1]
        extra = F.reshape(F.slice(scores, begin=(None, T, 0), end=(None, T + 1, 1)), shape=(-1,))   # (B,)
        return example_loss(F.slice_axis(scores, axis=1, begin=0, end=T), y, F, T) + extra
    T = tokens or (scores.shape[1] if isinstance(scores, nd.NDArray) and scores.ndim == 3 else None)
    per = cross_entropy(scores, y, F)                                     # (B,) or (B, T)
    if not T:
        return per
    where = {"ctx": scores.context} if isinstance(scores, nd.NDArray) else {}
    mean = F.FullyConnected(per, F.ones(shape=(1, T), **where) / T, no_bias=True, num_hidden=1)   # (B, 1)
    return F.reshape(mean, shape=(-1,))


def carries_aux(scores, y):
    """Whether next-token scores (NDArrays) hold one row more than the tokens y: the aux row."""
    return isinstance(scores, nd.NDArray) and scores.ndim == 3 and y.ndim == 2 and scores.shape[1] == y.shape[1] + 1


def count_correct(scores, y):
    """Correct predictions, a 1-element NDArray: examples whose class scores' argmax is y; for
    next-token scores (B, T, vocab), the tokens predicted right over T (per-token accuracy, counted
    in examples); the aux row of an MoE GPT's scores not counted."""
    if scores.ndim != 3:
        return n_correct(scores, y)
    if carries_aux(scores, y):
        scores = scores[:, :y.shape[1]]
    return (scores.argmax(axis=-1) == y.astype(scores.dtype)).sum() * (1 / scores.shape[1])


def fc(h, W, b, F=nd, shape=None, flatten=False):
    """h W^T + b on the last axis, W of shape (out, in) (Gluon's and Megatron's layout)."""
    shape = shape or W.shape
    return F.FullyConnected(data=h, weight=W, bias=b, num_hidden=shape[0], flatten=flatten)


def outer(column, v, n, F=nd):
    """column (..., 1) times the n values of v as a row: v broadcast along column's rows and scaled
    by them, as a product, whose gradients (into v: a sum over the rows) are products too."""
    return F.FullyConnected(column, F.reshape(v, shape=(-1, 1)), no_bias=True, num_hidden=n, flatten=False)


def add_bias(h, b, F=nd):
    """h (..., n) plus the bias b (n,) in every row (a row-parallel layer's, after g), as a product
    of ones (..., 1) with b, so that b's gradient is a product too: MXNet 1.9's broadcast_add
    differentiates through a slow generic reduce (fwd + bwd, one thread: 2.08 ms on (128, 28, 64)
    against 0.37 here; 0.32 against 0.13 on (128, 256); docs/performance.md). In float32 under
    any --precision, as autocast keeps additions (the product with ones is exact)."""
    F = float32_ops(F)
    ones = F.ones_like(F.slice_axis(h, axis=-1, begin=0, end=1))                            # (..., 1)
    return h + outer(ones, b, b.shape[0], F)


def rows_of(h, F=nd):
    """h (B, C, ...) as (B, C, S), S the product of the rest (1 for (B, C)), and ones shaped from it:
    a column (B, 1) and a row (1, S), which a symbol, whose shape is not known, can build too
    (outer's FullyConnected needs its width as a number; spread's dot does not)."""
    x = F.reshape(h, shape=(0, 0, -1))
    first = F.slice_axis(x, axis=1, begin=0, end=1)                                       # (B, 1, S)
    column = F.reshape(F.ones_like(F.slice_axis(first, axis=2, begin=0, end=1)), shape=(0, 1))
    row = F.reshape(F.ones_like(F.slice_axis(first, axis=0, begin=0, end=1)), shape=(1, -1))
    return x, F.BlockGrad(column), F.BlockGrad(row)


def spread(v, column, row, F=nd):
    """v (1, C) in every (b, c, s) of a (B, C, S) array: two products with ones, so that its
    gradient (a sum over B and S) is a product too."""
    return F.dot(F.expand_dims(F.dot(column, v), axis=2), row)                           # (B, C, S)


def add_channel_bias(h, b, F=nd):
    """h (B, C, ...) plus the bias b (C,) of each channel (a row-parallel convolution's, after g),
    as products with ones (spread), so that b's gradient is a product too. In float32 under any
    --precision, as add_bias."""
    F = float32_ops(F)
    _, column, row = rows_of(h, F)
    return h + F.reshape_like(spread(F.reshape(b, shape=(1, -1)), column, row, F), h)
