"""Batch normalisation by hand, for layers with state: the statistics a forward normalises with, and
the running statistics it leaves behind.

A model whose layers declare `stats` (models.contract: running means and variances) is run on all
contexts of a data-parallel step at once, layer by layer (Model.forward_group), with one Moments:

    training    each BatchNorm normalises with the batch's mean and (biased) variance over every
                axis but the channels: per context (Gluon's default: each replica sees its shard)
                or, with `join` (--sync-batchnorm), over every context's shard, summed by an
                all-reduce whose backward is an all-reduce too: then k contexts compute what one
                context computes on the whole batch
    inference   the running statistics instead (evaluation)

Per context, a BatchNorm is a function of one context's arrays, so it runs inside the fast step's
cached graph too (fast.graph): Moments(F=mx.sym) builds it from symbols, and the namespace
Batch(F, moments) hands the graph's BatchNorms that Moments, whose batch statistics become
outputs of the graph. With `join` the statistics cross contexts mid-forward: no graph.

After the step the strategy folds the batch statistics into the running ones (`fold`): the mean over
every context (of every process: `gather`, the job's all-reduce) of each context's batch mean and
variance, running = m running + (1 - m) batch, the same on every replica (with join, every context
already holds the same statistics). join and gather cross processes when the strategy's all-reduce
does, so --sync-batchnorm's statistics are the whole global batch's, counted across processes.
"""
from mxnet import nd

from .contract import rows_of, spread

MOMENTUM = 0.9          # Gluon's BatchNorm default: running = 0.9 running + 0.1 batch
EPS = 1e-5


def first_norm(layers, l):
    """The number of layer l's first BatchNorm: those of the layers before it (each keeps two
    running statistics, a mean and a variance)."""
    return sum(len(layer.stats) for layer in layers[:l]) // 2


class Batch:
    """The operators' namespace F of a cached graph whose BatchNorms normalise with `moments`
    (Moments(F=mx.sym)): each call's batch statistics, collected in moments.batch as symbols."""

    def __init__(self, F, moments):
        self.F, self.moments = F, moments

    def __getattr__(self, name):
        return getattr(self.F, name)


def moments_of(F):
    """The Moments of the Batch under F (through dropout's and a precision's namespaces), or None."""
    while F is not None and not isinstance(F, Batch):
        F = getattr(F, "F", None)
    return F and F.moments


def single(group_forward):
    """forward(h, params, F, shapes) of a layer that runs on a group of contexts (group_forward(hs,
    params per context, moments), its operators moments.F's): one context, the batch's own
    statistics, those of F's Batch in a cached graph."""
    def forward(h, params, F=nd, shapes=None):
        return group_forward([h], [params], moments_of(F) or Moments(train=True))[0]
    return forward


def norm_group(hs, params, moments):
    """One BatchNorm on every context at once: params[c] = [gamma, beta] of context c."""
    return moments.normalize(hs, [P[0] for P in params], [P[1] for P in params])


def channel_sums(x, column, row, F=nd):
    """(the sum per channel of x (B, C, S), (1, C); the values summed per channel, (1,)): a product
    with ones over S, then a sum over the B rows of the small (B, C) result."""
    per_example = F.reshape(F.dot(x, row, transpose_b=True), shape=(0, -1))             # (B, C)
    return F.sum(per_example, axis=0, keepdims=True), F.sum(column) * F.sum(row)


class Moments:
    """What a forward's BatchNorms normalise with (see the module docstring). running[c]: context
    c's running statistics in the model's stat order (mean, var of each BatchNorm), or None
    (training without them); join(arrays, key): a sum across the contexts whose backward sums too
    (sync), `key` naming each BatchNorm's sums apart (an engine across processes sums by name);
    first: the number of the first BatchNorm it meets (a layer run again on its own, by ZeRO's
    recomputation: first_norm)."""

    def __init__(self, train=True, running=None, join=None, first=0, F=nd):
        self.train, self.running, self.join, self.F = train, running, join, F
        self.start = self.index = first
        self.batch = []                         # batch: per context (mean, var) of each BatchNorm met

    def seek(self, first):
        """The next BatchNorm met is number `first` (a pipeline stage starts at its own; one run
        again by --recompute meets its BatchNorms twice, and the second time replaces the first's
        statistics, which are the same)."""
        self.index = first

    def normalize(self, hs, gammas, betas):
        """BatchNorm of each context's h (B, C, ...) with its gamma, beta (C,): (h - mean) x gamma /
        sqrt(var + EPS) + beta per channel, every mean and every broadcast over the batch and the
        map a product with ones (MXNet 1.9's mean over axes and its broadcast ops differentiate
        through a slow generic reduce: on (128, 8, 28, 28), forward and backward, one thread,
        89 ms against 11; docs/performance.md)."""
        i, self.index, F = self.index, self.index + 1, self.F
        rows = [rows_of(h, F) for h in hs]                            # (x (B, C, S), column, row) each
        if self.train:
            means, counts = self.means(rows, f"bn{i}m")               # each (1, C), (1,)
        else:
            means = [F.reshape(r[2 * i], shape=(1, -1)) for r in self.running]
        centred = [x - spread(m, column, row, F) for (x, column, row), m in zip(rows, means)]
        if self.train:
            variances = self.variances(centred, rows, counts, f"bn{i}v")
            met = [(F.BlockGrad(F.reshape(m, shape=(-1,))), F.BlockGrad(F.reshape(v, shape=(-1,))))
                   for m, v in zip(means, variances)]
            if i - self.start < len(self.batch):
                self.batch[i - self.start] = met                      # met again (seek)
            else:
                self.batch.append(met)
        else:
            variances = [F.reshape(r[2 * i + 1], shape=(1, -1)) for r in self.running]
        out = []
        for h, c, (_, column, row), v, g, b in zip(hs, centred, rows, variances, gammas, betas):
            scale = F.broadcast_div(F.reshape(g, shape=(1, -1)), F.sqrt(v + EPS))        # (1, C)
            y = c * spread(scale, column, row, F) + spread(F.reshape(b, shape=(1, -1)), column, row, F)
            out.append(F.reshape_like(y, h))
        return out

    def means(self, rows, key):
        """Per context the mean per channel (1, C) of its shard (rows: rows_of each) and the number
        of values it is over, (1,); with join, of every shard together (the sums and counts summed
        across the contexts, under the name `key`)."""
        F, sums = self.F, [channel_sums(*r, self.F) for r in rows]   # (sum (1, C), count (1,)) each
        if self.join is not None:
            joined = self.join([nd.concat(total.reshape((-1,)), n, dim=0) for total, n in sums], key)
            sums = [(s[:-1].reshape((1, -1)), s[-1:]) for s in joined]                  # every shard's
        return [F.broadcast_div(total, n) for total, n in sums], [n for _, n in sums]

    def variances(self, centred, rows, counts, key):
        """Per context the (biased) variance per channel (1, C): the mean square of its `centred`
        values (B, C, S), over `counts` values; with join, the squares summed across the contexts
        under the name `key` (the second pass, after the means)."""
        F = self.F
        squares = [channel_sums(F.square(c), column, row, F)[0] for c, (_, column, row) in zip(centred, rows)]
        if self.join is not None:
            squares = [q.reshape((1, -1)) for q in self.join([q.reshape((-1,)) for q in squares], key)]
        return [F.broadcast_div(q, n) for q, n in zip(squares, counts)]

    def fold_each(self, running):
        """Afterwards each context's running statistics (running[c]) took its own batch statistics
        alone: m running + (1 - m) batch (local SGD's replicas, apart between syncs)."""
        for c, R in enumerate(running):
            own = Moments()
            own.batch = [[per_context[c]] for per_context in self.batch]
            own.fold([R])

    def fold(self, running, gather=None):
        """Afterwards every replica's running statistics (running[c], in stat order) hold
        m running + (1 - m) x (the mean over every context of its batch statistics), the same bits
        on every context (computed on the first, copied to the others). gather(arrays): afterwards
        each of the arrays (one per context) holds their sum over every context and process."""
        home = running[0][0].context
        rows = [nd.concat(*[x for per_context in self.batch for x in per_context[c]], nd.ones((1,), ctx=ctx), dim=0)
                for c, ctx in enumerate(r[0].context for r in running)]
        if gather is not None:
            gather(rows)
            total = rows[0].as_in_context(home)
        else:
            total = nd.add_n(*[r.as_in_context(home) for r in rows]) if len(rows) > 1 else rows[0]
        fold_mean(running, nd.broadcast_div(total[:-1], total[-1:]))


def fold_mean(running, batch):
    """Afterwards every running[c][i] holds m running[0][i] + (1 - m) (its slice of `batch`, the
    batch statistics' mean, every BatchNorm's (mean, var) in stat order, on running[0]'s context)."""
    at = 0
    for i, stat in enumerate(running[0]):
        new = MOMENTUM * stat + (1 - MOMENTUM) * batch[at:at + stat.size]
        at += stat.size
        for r in running:
            new.copyto(r[i])
