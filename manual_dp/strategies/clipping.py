"""Gradient clipping by the global norm, and the norm every update logs (issue 23, item 3).

The global L2 norm is that of the whole model's mean gradient (the reduced gradient summed over the
batch, over n_examples), every parameter counted exactly once whatever the layout: a strategy hands
its reduced gradient over as Strategy.reduced_grads(), one array per parameter of the model, in
the model's order (replicas: the first one's; ZeRO: its shards, which cover the flat vector once;
tensor parallelism: the split parameters' shards joined, the replicated ones once; pipelines:
every stage's). The gradient is then scaled by min(1, C / norm) before the optimiser, written as
an update on a larger count: g / n x min(1, C / norm) = g / (n max(1, norm / C)).

    clipping   the norm on the host, in float64, over the gradient in the model's order: the same
               value whatever the layout gives identical gradients (so --deterministic layouts keep
               one bit pattern); it costs one copy of the gradient to the host per update
    logging    without --clip-norm the norm is summed on the devices and read at the epoch's end
    fp16       the gradient carries the loss scale S (manual_dp.precision): the norm is read on the
               host, an inf or NaN skips the update (count None), else the count is multiplied by S
"""

import math

import numpy as np
from mxnet import nd


class NormLog:
    """The global gradient norm of every update since the last `epoch_stats`, and the clipping."""

    def __init__(self, clip_norm=None, scaler=None, watch=None):
        self.clip_norm, self.scaler, self.watch, self.norms = clip_norm, scaler, watch, []

    @property
    def needs_norm(self):
        """Whether `count` reads the whole reduced gradient before any update (clipping, fp16,
        a watcher such as --digests)."""
        return self.clip_norm is not None or self.scaler is not None or self.watch is not None

    def count(self, grads, n_examples):
        """The count to divide the summed gradient by: n_examples, or more when the mean gradient's
        norm exceeds the clip norm, times the loss scale; None to skip the update (an overflow).
        `grads`: the model's reduced gradient, once per parameter."""
        if self.watch is not None:
            self.watch(grads)
        if not self.needs_norm:
            self.add([squares(g) for g in grads], n_examples)
            return n_examples
        norm, scale = host_norm(grads), 1.0
        if self.scaler is not None:
            scale = self.scaler.scale
            if not self.scaler.update(math.isfinite(norm)):
                return None
        norm = norm / scale / n_examples
        self.norms.append(norm)
        return n_examples * scale * (max(1.0, norm / self.clip_norm) if self.clip_norm is not None else 1.0)

    def add(self, parts, n_examples):
        """Log the norm whose square is the sum of `parts` (squares(g) of the reduced gradient's
        pieces, enqueued before anything overwrote them), read at the epoch's end."""
        home = parts[0].context
        self.norms.append(nd.sqrt(nd.add_n(*[p.as_in_context(home) for p in parts])) / n_examples)

    def epoch_stats(self):
        """{"grad_norm_mean", "grad_norm_max"} of the updates since the last call ({} if none)."""
        norms, self.norms = [float(n.asscalar()) if hasattr(n, "asscalar") else n for n in self.norms], []
        out = {"grad_norm_mean": float(np.mean(norms)), "grad_norm_max": float(np.max(norms))} if norms else {}
        return dict(out, **self.scaler.epoch_stats()) if self.scaler is not None else out


def squares(g):
    """The sum of g's squared elements, on its device, as a (1,) NDArray."""
    return nd.sum(nd.square(g)).reshape((1,))


def host_norm(grads):
    """The L2 norm of the arrays `grads` together, in float64 on the host, in their order."""
    v = np.concatenate([g.asnumpy().ravel() for g in grads]).astype(np.float64)
    return math.sqrt(float(v @ v))
