"""--deterministic --mode sync: data parallelism whose every sum is strategies/sums/fixed_sums.py's.

Each context owns a contiguous run of the batch's pieces and computes each piece's leaf, the whole
model's [gradient, loss sum, correct] on the piece, with the model's own layers (the cached graph
without LeNet's channel padding, which would change the kernels, or the same layers imperatively:
the same bits, as a pipeline stage computes them); the leaves are added in the fixed tree
(FixedSums), and every replica takes the same elementwise update. A model with BatchNorm normalises
each piece with the piece's own statistics, carried in its leaf and folded after the tree
(WholeBatch.stats_width), and runs imperatively: MXNet's cached graph of a BatchNorm gives other
bits than its imperative pass (most of ResNet's arrays differ in their last bits after one step),
and the imperative pass is the one a pipeline stage runs.
"""
from mxnet import nd

from ...config import PIECE_ROWS
from ...fast.prefetch import host
from ...lesson import forward_backward
from ...models import as_model
from ...models.batchnorm import Batch, Moments
from ...optim import apply_update_and_clear
from .data_parallel import DataParallel, graph_forward_backward
from ..sums.fixed_sums import (FixedSums, WholeBatch, cover, pieces, root_of, spans, tree_sum,  # noqa: F401 (their home)
                         refuse_running_pieces, whole_leaves_backward)
from ..tensor.tensor_pieces import piece_forward


def piece_pass(graph, X, y, W, net, running):
    """(loss sum, correct, [each BatchNorm's batch mean and variance]) of one piece on its context,
    its backward run: through the cached graph, or imperatively through net(X, W, F)."""
    if graph:                                  # (a model with BatchNorm runs imperatively here)
        (loss, correct), = graph_forward_backward(graph, [X], [y], [W])
        return loss, correct, []
    moments = Moments(train=True) if running else None
    forward = (lambda X, W: net(X, W, Batch(nd, moments))) if running else net
    (loss, correct), = forward_backward([X], [y], [W], forward)
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


class DeterministicDataParallel(WholeBatch, DataParallel):
    """Data parallelism whose every sum is in one fixed order (see the module docstring).

    tensor_pieces Q > 1: every split layer in Q pieces added in the tree (strategies/tensor/tensor_pieces.py),
    the leaves of --deterministic --mode tensor with any T dividing Q (no cached graph then).
    rank, size: this process's place among the job's processes; exchange(array, key): afterwards
    `array` holds the elementwise sum of every process's (the job's all-reduce; size > 1 only).
    The fused flat buffers and the cached graph of DataParallel (convolutions unpadded: the kernels
    a pipeline stage runs); no all-reduce algorithm to choose.
    """

    def __init__(self, params, ctx, optimizer, piece=PIECE_ROWS, graph=True, rank=0, size=1, exchange=None,
                 model=None, tensor_pieces=1):
        super().__init__(params, ctx, optimizer, allreduce_fn=lambda arrays: None, fuse_grads=True,
                         graph=graph and tensor_pieces == 1 and not as_model(model, params).stats(), conv_pad=1,
                         model=model)
        self.leaf_forward = piece_forward(self.net, tensor_pieces)
        refuse_running_pieces(self.running, tensor_pieces)
        for f in self.flat:
            f.mark("write")                              # each piece's backward overwrites
        self.sums = FixedSums(piece, rank, size, exchange)
        self.n = self.flat[0].flat.size                  # parameters; a leaf is [gradient, loss, correct]
        self.held = None

    def backward(self, X, y):
        return whole_leaves_backward(self, X, y, len(self.ctx), "tree")

    def leaves(self, X, y, bounds, runs):
        """{piece: [gradient, loss sum, correct] (n + 2,)} on the context that owns the piece."""
        return {j: leaf for _, j, leaf in piece_leaves(self.ctx, self.replicas, [f.grad for f in self.flat],
                                                       self.graph, X, y, bounds, runs, self.leaf_forward,
                                                       bool(self.running))}

    def update(self, lr, n_examples):
        """The tree's gradient on every replica, then the same elementwise update on each."""
        self.t += 1
        gradient = self.held[:self.n]
        n_examples = self.counted(n_examples)
        for f, s in zip(self.flat, self.flat_states):
            gradient.copyto(f.grad)
            apply_update_and_clear([f.flat], [s], self.optimizer, lr, self.t, n_examples)
        self.held = None

    def reduced_grads(self):
        """The tree's total gradient (the same bits on any layout)."""
        return [self.held[:self.n]]
