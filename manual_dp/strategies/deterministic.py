"""--deterministic: the same bits on any number of contexts and processes.

A float sum depends on its order, and data parallelism's order depends on the placement: on 2
contexts a gradient is (sum of rows 0..127) + (sum of rows 128..255), on 3 it is three other partial
sums. Here the order is fixed by the batch alone:

    1. cut every global batch into pieces of `piece` rows (the last may be shorter)
    2. each piece's gradient, loss sum and correct count is one vector, a leaf; whichever context
       holds the piece computes it, with the same kernel on the same shape
    3. the leaves are added in one binary tree over the piece numbers:

            root                   node(l, i) = node(l-1, 2i) + node(l-1, 2i+1)
           /    \\                  (or node(l-1, 2i) alone where 2i+1 is past the last piece)
         n10     n11
        /  \\    /  \\
       p0  p1  p2  p3

Each global context owns a contiguous run of pieces and adds up the largest whole subtrees inside
its run (`cover`) where it computed them; what is left of the tree is added on each process's first
context, after the processes have swapped their subtrees (an exact exchange: every process sums an
array that is zero except for its own slots). The tree is the same for 1 context, 3 contexts or
2 processes x 2 contexts, so is every sum, and so are the bits: of the gradients, of the loss and
of the parameters after the update (elementwise, the same on every replica).

A condition no sum order can remove: a kernel's own result may depend on how many threads split
it (oneDNN's convolution backward does), so every process must run its ops with the same thread
count; the command line gives one thread per op with --deterministic.
"""
import math

from mxnet import nd

from ..config import PIECE_ROWS
from ..fast.prefetch import host
from ..lesson import forward_backward
from ..optim import apply_update_and_clear
from .data_parallel import DataParallel, graph_forward_backward


def pieces(n, piece):
    """[(start, stop)]: rows of each piece of a batch of n."""
    return [(s, min(s + piece, n)) for s in range(0, n, piece)]


def spans(m, k):
    """[(first, stop)]: the contiguous run of m pieces each of k owners holds (some may be empty)."""
    return [(i * m // k, (i + 1) * m // k) for i in range(k)]


def cover(lo, hi, m):
    """The tree nodes (level, index) whose pieces exactly make up pieces lo..hi-1 of m, largest first:
    node (l, i) holds pieces i*2**l .. min((i+1)*2**l, m) - 1."""
    nodes, top = [], math.ceil(math.log2(m)) if m > 1 else 0
    while lo < hi:
        level = top
        while level and (lo % (1 << level) or min(lo + (1 << level), m) > hi):
            level -= 1
        nodes.append((level, lo >> level))
        lo = min(lo + (1 << level), m)
    return nodes


def tree_sum(node, m, have, add):
    """The value of `node` over m pieces: have[node] where known, else its children's, added with
    add(left, right) in the tree's fixed order."""
    if node in have:
        return have[node]
    level, i = node
    left = tree_sum((level - 1, 2 * i), m, have, add)
    if (2 * i + 1) << (level - 1) >= m:                  # no right child: past the last piece
        return left
    return add(left, tree_sum((level - 1, 2 * i + 1), m, have, add))


def root_of(m):
    return (math.ceil(math.log2(m)) if m > 1 else 0, 0)


def piece_leaves(ctx, params, grads, graph, X, y, bounds, runs, net=None):
    """Yields (context index, piece, leaf): each piece's [gradient, loss sum, correct] (n + 2,) on
    the context that owns it, pushed a piece per context in turn so that every context starts at
    once. params[i]: the model's arrays on ctx[i], views of the flat grads[i] (n,) that their
    backward writes (grad_req "write"); graph: a ModelGraph, or None for the imperative pass
    through `net` (the model's forward)."""
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
                (loss, correct), = graph_forward_backward(graph, [Xc[a:b]], [yc[a:b]], [W]) \
                    if graph else forward_backward([Xc[a:b]], [yc[a:b]], [W], net)
                # + 0 turns -0 into +0: then no sum in the tree is -0, and the exchange's adding
                # of zeros changes no bit
                yield i, j, nd.concat(g, loss.reshape((1,)), correct.reshape((1,)), dim=0) + 0


class WholeBatch:
    """What every --deterministic strategy tells the loop and the world: each process takes the
    whole global batch and picks its own pieces (the tree needs every piece's number), and a
    context without a piece waits."""

    @property
    def min_batch(self):
        return 1

    def rows(self, n, rank, size):
        """Every row: each process picks its pieces of the global batch itself."""
        return 0, n


class DeterministicDataParallel(WholeBatch, DataParallel):
    """Data parallelism whose every sum is in one fixed order (see the module docstring).

    rank, size: this process's place among the job's processes; exchange(array): afterwards
    `array` holds the elementwise sum of every process's (the job's all-reduce; size > 1 only).
    The fused flat buffers and the cached graph of DataParallel; no all-reduce algorithm to choose.
    """

    def __init__(self, params, ctx, optimizer, piece=PIECE_ROWS, graph=True, conv_pad=None,
                 rank=0, size=1, exchange=None, model=None):
        super().__init__(params, ctx, optimizer, allreduce_fn=lambda arrays: None, fuse_grads=True,
                         graph=graph, conv_pad=conv_pad, model=model)
        if self.running:
            raise ValueError("--deterministic cuts the batch into pieces of its own, whose BatchNorm "
                             "statistics would differ: not for models with running statistics")
        for f in self.flat:
            f.mark("write")                              # each piece's backward overwrites
        self.piece, self.rank, self.size, self.exchange = piece, rank, size, exchange
        self.n = self.flat[0].flat.size                  # parameters; a leaf is [gradient, loss, correct]
        self.held = None

    def backward(self, X, y):
        bounds = pieces(len(X), self.piece)
        m, k = len(bounds), len(self.ctx)
        runs = spans(m, self.size * k)
        have = self.subtrees(X, y, bounds, runs[self.rank * k:(self.rank + 1) * k])
        if self.size > 1:
            have = self.swap(have, runs, m)
        total = tree_sum(root_of(m), m, have, lambda a, b: a + b)
        self.held = total if self.held is None else self.held + total
        home = self.ctx[0]
        if self.rank:                                    # the job's metrics come from rank 0 alone
            return [(nd.zeros((1,), ctx=home), nd.zeros((1,), ctx=home))]
        return [(total[self.n:self.n + 1], total[self.n + 1:self.n + 2])]

    def subtrees(self, X, y, bounds, runs):
        """{node: value on ctx[0]} of the whole subtrees in each of this process's contexts' runs."""
        leaves = self.leaves(X, y, bounds, runs)
        home, have, m = self.ctx[0], {}, len(bounds)
        for c, (lo, hi) in zip(self.ctx, runs):
            mine = {(0, j): leaves[j] for j in range(lo, hi)}
            for node in cover(lo, hi, m):
                have[node] = tree_sum(node, m, mine, lambda a, b: a + b).as_in_context(home)
        return have

    def leaves(self, X, y, bounds, runs):
        """{piece: [gradient, loss sum, correct] (n + 2,)} on the context that owns the piece."""
        return {j: leaf for _, j, leaf in piece_leaves(self.ctx, self.replicas, [f.grad for f in self.flat],
                                                       self.graph, X, y, bounds, runs, self.net.forward)}

    def swap(self, have, runs, m):
        """Every process's subtrees, on every process: each fills its own rows of one zero array
        (every process knows every run, so every slot), and the job sums the arrays."""
        slots = [node for lo, hi in runs for node in cover(lo, hi, m)]
        table = nd.zeros((len(slots), self.n + 2), ctx=self.ctx[0])
        for i, node in enumerate(slots):
            if node in have:
                table[i] = have[node]
        self.exchange(table)
        return {node: table[i] for i, node in enumerate(slots)}

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
