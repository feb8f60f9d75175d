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

After the step the strategy folds the batch statistics into the running ones (`fold`): the mean over
the contexts of each context's batch mean and variance, running = m running + (1 - m) batch, the
same on every replica (with join, every context already holds the same statistics).
"""
from mxnet import nd

MOMENTUM = 0.9          # Gluon's BatchNorm default: running = 0.9 running + 0.1 batch
EPS = 1e-5


def channel_axes(h):
    """The axes a BatchNorm averages over: all but axis 1 (the channels)."""
    return (0,) + tuple(range(2, h.ndim))


def per_channel(v, h):
    """A (C,) array shaped to broadcast against h (B, C, ...)."""
    return v.reshape((1, -1) + (1,) * (h.ndim - 2))


class Moments:
    """What a forward's BatchNorms normalise with (see the module docstring). running[c]: context
    c's running statistics in the model's stat order (mean, var of each BatchNorm), or None
    (training without them); join: a sum across the contexts whose backward sums too (sync)."""

    def __init__(self, train=True, running=None, join=None):
        self.train, self.running, self.join = train, running, join
        self.index, self.batch = 0, []          # batch[i]: per context (mean, var) of BatchNorm i

    def normalize(self, hs, gammas, betas):
        """BatchNorm of each context's h (B, C, ...) with its gamma, beta (C,)."""
        i, self.index = self.index, self.index + 1
        if self.train:
            means, variances = self.moments(hs)
            self.batch.append([(m.detach(), v.detach()) for m, v in zip(means, variances)])
        else:
            means = [r[2 * i] for r in self.running]
            variances = [r[2 * i + 1] for r in self.running]
        return [nd.broadcast_add(nd.broadcast_mul(nd.broadcast_div(
                    nd.broadcast_sub(h, per_channel(m, h)), per_channel(nd.sqrt(v + EPS), h)),
                    per_channel(g, h)), per_channel(b, h))
                for h, m, v, g, b in zip(hs, means, variances, gammas, betas)]

    def moments(self, hs):
        """Per context the (mean, variance) per channel of its shard, or with join of every
        shard together (two passes: the mean, then the squared deviations from it)."""
        axes = channel_axes(hs[0])
        if self.join is None:
            means = [nd.mean(h, axis=axes) for h in hs]
            return means, [nd.mean(nd.square(nd.broadcast_sub(h, per_channel(m, h))), axis=axes)
                           for h, m in zip(hs, means)]
        n = sum(h.size // h.shape[1] for h in hs)
        means = [s / n for s in self.join([nd.sum(h, axis=axes) for h in hs])]
        return means, [s / n for s in self.join([nd.sum(nd.square(nd.broadcast_sub(h, per_channel(m, h))), axis=axes)
                                                  for h, m in zip(hs, means)])]

    def fold(self, running):
        """Afterwards every replica's running statistics (running[c], in stat order) hold
        m running + (1 - m) x (the contexts' mean batch statistics), the same bits on every
        context (computed on the first, copied to the others)."""
        home = running[0][0].context
        for i, per_context in enumerate(self.batch):
            for j in (0, 1):
                values = [pair[j].as_in_context(home) for pair in per_context]
                batch = nd.add_n(*values) / len(values) if len(values) > 1 else values[0]
                new = MOMENTUM * running[0][2 * i + j] + (1 - MOMENTUM) * batch
                for r in running:
                    new.copyto(r[2 * i + j])
