"""--deterministic --mode sync: DataParallel (data_parallel.py) given a FixedSums, whose every sum is
strategies/sums/fixed_sums.py's.

Each context owns a contiguous run of the batch's pieces and computes each piece's leaf, the whole
model's [gradient, loss sum, correct] on the piece, with the model's own layers (the cached graph
without LeNet's channel padding, which would change the kernels, or the same layers imperatively:
the same bits, as a pipeline stage computes them); the leaves are added in the fixed tree
(FixedSums), and every replica takes the same elementwise update. A model with BatchNorm normalises
each piece with the piece's own statistics, carried in its leaf and folded after the tree
(fixed_sums.stats_width), and runs imperatively: MXNet's cached graph of a BatchNorm gives other
bits than its imperative pass (most of ResNet's arrays differ in their last bits after one step),
and the imperative pass is the one a pipeline stage runs.
"""
from mxnet import nd

from ...fast.graph import graph_forward_backward
from ...fast.prefetch import host
from ...lesson import forward_backward
from ...models.contract import count_correct, example_loss
from ...models.batchnorm import Batch, Moments
from ...optim import apply_update_and_clear
from ..sums.fixed_sums import refuse_running_pieces, whole_leaves_backward
from ..tensor.tensor_pieces import piece_forward


def piece_pass(graph, X, y, W, net, running):
    """(loss sum, correct, [each BatchNorm's batch mean and variance]) of one piece on its context,
    its backward run: through the cached graph, or imperatively through net(X, W, F)."""
    if graph:                                  # (a model with BatchNorm runs imperatively here)
        (loss, correct), = graph_forward_backward(graph, [X], [y], [W])
        return loss, correct, []
    moments = Moments(train=True) if running else None
    forward = (lambda X, W: net(X, W, Batch(nd, moments))) if running else net
    (loss, correct), = forward_backward([X], [y], [W], forward, example_loss, count_correct)
    return loss, correct, [s for per_norm in moments.batch for s in per_norm[0]] if running else []


def piece_leaves(ctx, params, grads, graph, X, y, bounds, runs, net=None, running=False):
    """Yields (context index, piece, leaf): each piece's [gradient, loss sum, correct] (n + 2,) on
    the context that owns it, pushed a piece per context in turn so that every context starts at
    once; with `running` (a model with BatchNorm) followed by the piece's batch statistics.
    params[i]: the model's arrays on ctx[i], views of the flat grads[i] (n,) that their backward
    writes (grad_req "write"); graph: a ModelGraph, or None for the imperative pass through `net`
    (the model's forward)."""
    shards = []
    for c, (lo, hi) in zip(ctx, runs):
        start, stop = (bounds[lo][0], bounds[hi - 1][1]) if hi > lo else (0, 0)
        shards.append((lo, hi, start, host(X[start:stop]).as_in_context(c) if hi > lo else None,
                       host(y[start:stop]).as_in_context(c) if hi > lo else None))
    for step in range(max(hi - lo for lo, hi in runs)):
        for i, ((lo, hi, start, Xc, yc), W, g) in enumerate(zip(shards, params, grads)):
            j = lo + step
            if j < hi:
                a, b = bounds[j][0] - start, bounds[j][1] - start
                loss, correct, stats = piece_pass(graph, Xc[a:b], yc[a:b], W, net, running)
                # + 0 turns -0 into +0: then no sum in the tree is -0, and the exchange's adding
                # of zeros changes no bit
                yield i, j, nd.concat(g, loss.reshape((1,)), correct.reshape((1,)),
                                      *[s.reshape((-1,)) for s in stats], dim=0) + 0


def leaf_graph(graph, sums, net):
    """Whether the leaves run the cached graph (asked for by `graph`): not for split layers in
    pieces, nor for a model with BatchNorm (see the module docstring)."""
    return bool(graph) and sums.tensor_pieces == 1 and not net.stats()


def refuse_sync_batchnorm(sync_batchnorm):
    """ValueError (one line) for --sync-batchnorm under the fixed tree: each piece normalises with
    its own statistics."""
    if sync_batchnorm:
        raise ValueError("--deterministic normalises each piece with its own statistics, not --sync-batchnorm's")


class FixedData:
    """The --deterministic half of DataParallel (data_parallel.py), whose attributes it reads."""

    def keep_fixed(self):
        """Afterwards the leaves' forward is ready (tensor_pieces: split layers in pieces), every
        flat gradient is overwritten by each piece's backward, and no tree total is held."""
        refuse_running_pieces(self.running, self.sums.tensor_pieces)
        refuse_sync_batchnorm(self.sync_batchnorm)
        self.leaf_forward = piece_forward(self.net, self.sums.tensor_pieces)
        for f in self.flat:
            f.mark("write")                              # each piece's backward overwrites
        self.n = self.flat[0].flat.size                  # parameters; a leaf is [gradient, loss, correct]
        self.held = None

    def fixed_backward(self, X, y):
        """The tree's total of the batch's leaves added into self.held on the first context."""
        return whole_leaves_backward(self, X, y, len(self.ctx), "tree")

    def leaves(self, X, y, bounds, runs):
        """{piece: [gradient, loss sum, correct] (n + 2,)} on the context that owns the piece."""
        return {j: leaf for _, j, leaf in piece_leaves(self.ctx, self.replicas, [f.grad for f in self.flat],
                                                       self.graph, X, y, bounds, runs, self.leaf_forward,
                                                       bool(self.running))}

    def fixed_update(self, lr, n_examples):
        """The tree's gradient on every replica, then the same elementwise update on each."""
        gradient = self.held[:self.n]
        n_examples = self.counted(n_examples)
        for f, s in zip(self.flat, self.flat_states):
            gradient.copyto(f.grad)
            apply_update_and_clear([f.flat], [s], self.optimizer, lr, self.t, n_examples)
        self.held = None

