"""--deterministic for model, pipeline and hybrid parallelism: every stage's per-piece gradients are
leaves of strategies/sums/fixed_sums.py's one tree.

Each pipeline replica takes its run of the batch's pieces (FixedSums.cut); its micro-batches are
runs of whole pieces, and each stage runs a micro-batch piece by piece (the same kernels on a
piece's shape as a context of --deterministic --mode sync runs the whole model on it), so stage s
makes, per piece, exactly the slice of that piece's leaf that its parameters own (the last stage
also the piece's loss sum and correct count). A stage's leaves are added in the tree where its
replicas ran them, then across replicas and processes (FixedSums.total), and every replica's copy
of the stage takes the total: the bits of --deterministic --mode sync, on any cut, schedule,
micro-batch count, recompute, replica and process count.

A model with BatchNorm normalises each piece with its own statistics, as --deterministic --mode sync
does (fixed_sums.stats_width): stage s's leaf of a piece ends with the statistics of
the stage's BatchNorms on it, and after the tree the stages' sums, in stage order, are the whole
model's, folded as sync folds them: the running statistics take sync's bits too.
"""
from mxnet import nd

from ...fast.prefetch import host
from ..sums.fixed_sums import fold_pieces, leaf, stat_elements


class FixedPipeline:
    """The --deterministic half of PipelineParallel (strategies/pipeline/pipeline.py), whose attributes it reads."""

    def fixed_backward(self, X, y):
        """Every replica's run of pieces through its stages; afterwards held[s] adds stage s's tree
        total (its gradient, the last stage's then loss sum and correct count) on replica 0's place."""
        bounds, runs, mine = self.sums.cut(len(X), len(self.grid))
        leaves = [{} for _ in self.stages]                       # leaves[s][piece]
        self.batch_moments = []                                  # a replica's pieces' Moments, in run order
        for row, places, P, (lo, hi) in zip(self.grid, self.places, self.params, mine):
            if hi > lo:
                start, stop = bounds[lo][0], bounds[hi - 1][1]
                parts = [(a - start, b - start) for a, b in bounds[lo:hi]]

                def collect(s, q, arrays, first=lo):
                    leaves[s][first + q] = leaf(arrays + self.piece_stats(s, q))
                self.run_replica(row, places, P, host(X[start:stop]).as_in_context(places[0]),
                                 host(y[start:stop]).as_in_context(places[-1]), parts, collect)
        totals = [self.stage_total(s, leaf_s, runs, mine, len(bounds)) for s, leaf_s in enumerate(leaves)]
        self.held = totals if self.held is None else [h + t for h, t in zip(self.held, totals)]
        n = sum(p.size for p in self.params[0][-1])
        loss, correct = totals[-1][n:n + 1], totals[-1][n + 1:n + 2]
        if self.running:
            fold_pieces(self.running, self.stat_sums(totals), len(bounds))
        return [(loss.zeros_like(), correct.zeros_like())] if self.sums.rank else [(loss, correct)]   # rank 0's

    def piece_stats(self, s, q):
        """[mean, variance of each of stage s's BatchNorms] on piece q of this replica's run (none
        without BatchNorm): its Moments (PipelineParallel.namespaces) met them in the stage's forward."""
        if not self.running:
            return []
        moments = self.batch_moments[-1][q]
        return [x for per_norm in moments.batch[self.norms[s]:self.stat_norms(s)] for x in per_norm[0]]

    def stat_norms(self, s):
        """The number one past stage s's last BatchNorm."""
        return self.norms[s + 1] if s + 1 < len(self.norms) else len(self.net.stats()) // 2

    def stat_width(self, s):
        """Elements of stage s's BatchNorm statistics in its leaf of a piece (0 without BatchNorm)."""
        return stat_elements(self.net.stats()[2 * self.norms[s]:2 * self.stat_norms(s)])

    def stat_sums(self, totals):
        """The pieces' statistics summed in the tree: the tail of each stage's total, in stage order
        (the model's stat order), on the first running statistics' context."""
        home = self.running[0][0].context
        tails = [total[total.size - self.stat_width(s):].as_in_context(home)
                 for s, total in enumerate(totals) if self.stat_width(s)]
        return nd.concat(*tails, dim=0) if len(tails) > 1 else tails[0]

    def stage_total(self, s, leaves, runs, mine, m):
        """Stage s's tree total on replica 0's place of it, from its leaves {piece: vector}."""
        home = self.places[0][s]
        width = sum(p.size for p in self.params[0][s]) + (2 if s == len(self.stages) - 1 else 0) + self.stat_width(s)
        have = self.sums.subtrees(leaves, mine, m, home)
        return self.sums.total(have, runs, m, width, home, f"pipe{s}-")

    def place_totals(self):
        """Every replica's copy of every stage takes the tree's gradient in its parameters' grads."""
        for row in self.params:
            for P, total in zip(row, self.held):
                at = 0
                for p in P:
                    total[at:at + p.size].reshape(p.shape).copyto(p.grad)
                    at += p.size
