"""Running statistics (BatchNorm's means and variances) in a data-parallel strategy: what
DataParallel, ZeroRedundancy and AsyncDataParallel (whose master folds when it applies the step)
share for a model that keeps them (models.batchnorm).

Every replica keeps the whole running statistics (a few numbers a channel: never sharded, also
not by ZeRO), the same bits on every context. A training step normalises with the batch's
statistics, per context or with --sync-batchnorm over every context (and process); afterwards the
mean of every context's batch statistics is folded into the running ones. Evaluation normalises
with the running ones. `stats_reduce` is the strategy's all-reduce over its contexts, across
processes too when the job has several, so that both sums count every context of the job.
"""
from mxnet import autograd, nd

from ..errors import CheckpointError
from ..fast.tensor_ops import sum_everywhere
from ..models.contract import example_loss, count_correct
from ..models.batchnorm import Moments
from ..replicas import fingerprint


class RunningStats:
    """A mixin: set self.net and self.ctx, then call keep_running (see the module docstring)."""

    def keep_running(self, sync_batchnorm, stats_reduce):
        """Afterwards self.running[c] holds context c's running statistics (None: the model keeps
        none); sync_batchnorm: the batch statistics over every context; stats_reduce(arrays): an
        all-reduce of one array per context (and across the job's processes)."""
        self.running = [self.net.init_stats(c) for c in self.ctx] if self.net.stats() else None
        self.sync_batchnorm = sync_batchnorm and self.running is not None
        self.stats_reduce = stats_reduce

    def moments(self, train, n=None, first=0):
        """How this step's BatchNorms normalise (models.batchnorm): batch statistics, summed over
        the contexts with sync_batchnorm, or (evaluation) the first n replicas' running ones;
        first: the first BatchNorm met (a layer recomputed on its own)."""
        join = (lambda xs, key: sum_everywhere(xs, self.stats_reduce, key)) if self.sync_batchnorm else None
        return Moments(train, None if train else self.running[:n], join, first)

    def fold(self, moments):
        """Afterwards every replica's running statistics took the step's batch statistics."""
        moments.fold(self.running, self.stats_reduce)

    def fold_graph(self, stats):
        """fold of the batch statistics a cached graph gave (fast.graph): stats[c] context c's
        [mean, variance of each BatchNorm]."""
        self.fold_batch([[(s[2 * i], s[2 * i + 1]) for s in stats] for i in range(len(stats[0]) // 2)])

    def fold_batch(self, batch):
        """fold of batch statistics given as a Moments holds them: batch[i][c] context c's (mean,
        variance) of BatchNorm i."""
        moments = Moments()
        moments.batch = batch
        self.fold(moments)

    def grouped_forward_backward(self, X_shards, y_shards, replicas, each=False):
        """Every context's forward at once (its BatchNorms may sum across contexts), one backward
        for all, then the fold: into every replica alike, or with each=True into each replica its
        own context's statistics (local SGD's replicas, apart between syncs). Returns per context
        (loss sum, number correct)."""
        metrics, moments = self.unfolded_forward_backward(X_shards, y_shards, replicas)
        if each:
            moments.fold_each(self.running)
        else:
            self.fold(moments)
        return metrics

    def unfolded_forward_backward(self, X_shards, y_shards, replicas):
        """grouped_forward_backward without the fold: (per context (loss sum, number correct), the
        step's Moments, whose batch statistics the caller folds when it chooses)."""
        moments = self.moments(True)
        with autograd.record():
            scores = self.net.forward_group(X_shards, replicas, moments)
            losses = [example_loss(s, y) for s, y in zip(scores, y_shards)]
        autograd.backward(losses)
        return [(l.sum(), count_correct(s, y)) for l, s, y in zip(losses, scores, y_shards)], moments

    def running_fingerprints(self):
        """{"running statistics": per context fingerprints}, or {} for a model without them."""
        if not self.running:
            return {}
        names = [p.name for p in self.net.stats()]
        return {"running statistics": [fingerprint(c, R, names) for c, R in zip(self.ctx, self.running)]}

    def running_arrays(self):
        return [r for R in self.running or [] for r in R]

    def running_state(self):
        """A state_dict's extra: the first replica's running statistics (every replica's are the same)."""
        return {"running": [r.asnumpy() for r in self.running[0]]} if self.running else {}

    def load_running(self, state):
        """Every replica's running statistics from a state_dict's extra "running"; CheckpointError
        if they are missing or do not fit the model."""
        if not self.running:
            return
        values = state.get("extra", {}).get("running")
        shapes = [p.shape for p in self.net.stats()]
        if values is None or [tuple(v.shape) for v in values] != shapes:
            raise CheckpointError(f"the checkpoint holds no running statistics of {self.net.name}'s "
                                  f"{len(shapes)} BatchNorm arrays")
        for R in self.running:
            for r, v in zip(R, values):
                r[:] = nd.array(v, ctx=r.context)
