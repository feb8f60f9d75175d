"""--deterministic: one policy for how every sum over the batch is taken, whatever the layout.

A float sum depends on its order, and a layout's order depends on its placement: on 2 contexts a
gradient is (sum of rows 0..127) + (sum of rows 128..255), on 3 three other partial sums, in a
pipeline a sum over micro-batches. Under FixedSums the order is fixed by the batch alone:

    1. cut every global batch into pieces of `piece` rows (the last may be shorter)
    2. each piece's gradient, loss sum and correct count is one vector, a leaf, computed by
       whichever place holds the piece, with the same operations on the same shapes (a context of
       data parallelism runs the whole model on it; a pipeline stage its layers, piece by piece)
    3. the leaves are added in one binary tree over the piece numbers:

            root                   node(l, i) = node(l-1, 2i) + node(l-1, 2i+1)
           /    \\                  (or node(l-1, 2i) alone where 2i+1 is past the last piece)
         n10     n11
        /  \\    /  \\
       p0  p1  p2  p3

Each place (a context, a pipeline replica) owns a contiguous run of pieces and adds up the largest
whole subtrees inside its run (`cover`) where it computed them; what is left of the tree is added
on the first place, after the processes have swapped their subtrees (an exact exchange: every
process sums an array that is zero except for its own slots). The tree is the same for 1 context,
3 contexts, a pipeline or 2 processes x 2 contexts, so is every sum, and so are the bits: of the
gradients, of the loss and of the parameters after the update (elementwise, the same on every
replica and on every shard). A vector of a pipeline stage's gradients is a slice of the whole
model's leaf, and adding vectors is elementwise: the same bits again.

A condition no sum order can remove: a kernel's own result may depend on how many threads split
it (oneDNN's convolution backward does), so every process must run its ops with the same thread
count; the command line gives one thread per op with --deterministic.
"""
import math

from mxnet import nd

from ...config import PIECE_ROWS
from ...models.batchnorm import fold_mean


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


def plus(a, b):
    return a + b


class Fold:
    """The whole subtrees of pieces lo..hi-1 of m (cover(lo, hi, m)), added up as the run's leaves
    arrive in order: afterwards `done` maps each cover node to tree_sum's value of it, its bits."""

    def __init__(self, lo, hi, m, add=plus):
        self.lo, self.hi, self.m, self.add, self.done = lo, hi, m, add, {}
        self.top = root_of(m)[0]

    def inside(self, level, i):
        """Whether node (level, i) holds only pieces of this run."""
        return i << level >= self.lo and min((i + 1) << level, self.m) <= self.hi

    def put(self, j, leaf):
        """Leaf j (the run's next) in; every node it completes made, its children let go."""
        level, i, value = 0, j, leaf
        while level < self.top and self.inside(level + 1, i >> 1):
            if i % 2:                                      # a right child: its left sibling is done
                value = self.add(self.done.pop((level, i - 1)), value)
            elif (i + 1) << level < self.m:                # a left child whose sibling is to come
                break
            level, i = level + 1, i >> 1                   # (a left child alone is its parent)
        self.done[(level, i)] = value


def leaf(arrays):
    """One piece's leaf: `arrays` (its gradients, maybe then its loss sum and correct count)
    flattened end to end, + 0: then no sum in the tree is -0, and the exchange's adding of zeros
    changes no bit."""
    parts = [a.reshape((-1,)) for a in arrays]
    return (nd.concat(*parts, dim=0) if len(parts) > 1 else parts[0]) + 0


class FixedSums:
    """The policy: the batch in pieces of `piece` rows added in the one tree; every split layer in
    `tensor_pieces` pieces added in the tree too (strategies/tensor/tensor_pieces.py; 1: whole). rank,
    size: this process's place in the job; exchange(table, key): afterwards `table` holds the
    elementwise sum of every process's table of that key (size > 1 only)."""

    def __init__(self, piece=PIECE_ROWS, rank=0, size=1, exchange=None, tensor_pieces=1):
        self.piece, self.rank, self.size, self.exchange = piece, rank, size, exchange
        self.tensor_pieces = tensor_pieces

    def cut(self, n, k):
        """(bounds, runs, mine) of a global batch of n over this process's k places: every piece's
        rows, every place's run of pieces in the job, and this process's places' runs."""
        bounds = pieces(n, self.piece)
        runs = spans(len(bounds), self.size * k)
        return bounds, runs, runs[self.rank * k:(self.rank + 1) * k]

    def subtrees(self, leaves, mine, m, home):
        """{node: value on home}: each place's whole subtrees of its leaves ({piece: value}), added
        on the place's own context, then moved home."""
        have = {}
        for lo, hi in mine:
            own = {(0, j): leaves[j] for j in range(lo, hi)}
            for node in cover(lo, hi, m):
                have[node] = tree_sum(node, m, own, plus).as_in_context(home)
        return have

    def total(self, have, runs, m, width, home, key=""):
        """The root of the tree, on `home`, from this process's subtrees `have` (values of `width`
        elements on home), after the swap across processes."""
        if self.size > 1:
            have = self.swap(have, runs, m, width, home, key)
        return tree_sum(root_of(m), m, have, plus)

    def swap(self, have, runs, m, width, home, key):
        """Every process's subtrees, on every process: each fills its own rows of one zero array
        (every process knows every run, so every slot), and the job sums the arrays."""
        slots = [node for lo, hi in runs for node in cover(lo, hi, m)]
        table = nd.zeros((len(slots), width), ctx=home)
        for i, node in enumerate(slots):
            if node in have:
                table[i] = have[node]
        self.exchange(table, key)
        return {node: table[i] for i, node in enumerate(slots)}


def stats_width(strategy):
    """Elements a leaf of `strategy` carries after [gradient, loss, correct]: its piece's batch
    statistics (each BatchNorm's mean and variance per channel, models.batchnorm), or 0 without
    BatchNorm.

    Under --deterministic every piece normalises with its own statistics ("ghost" batch
    normalisation over `piece` rows): a piece's statistics are a function of its rows alone, as its
    gradient is, so every layout computes the same ones; their tree sum over the m pieces, divided
    by m, is folded into the running statistics (fold_pieces)."""
    return stat_elements(strategy.net.stats()) if getattr(strategy, "running", None) else 0


def refuse_running_pieces(running, tensor_pieces):
    """ValueError (one line) for a model with running statistics whose layers are cut in pieces
    (--tensor-pieces: a split layer's pieces are not a BatchNorm's channels)."""
    if running and tensor_pieces > 1:
        raise ValueError(f"--tensor-pieces {tensor_pieces} cuts the split layers of the transformer, not a "
                         f"model with BatchNorm's running statistics")


def stat_elements(stats):
    """Elements of the running statistics `stats` (Params): what a piece's leaf carries of them."""
    return sum(int(math.prod(p.shape)) for p in stats)


def fold_pieces(running, sums, m):
    """Afterwards every replica's running statistics (running[c]) took the mean of the m pieces'
    batch statistics (`sums`: their sum in the tree): m running + (1 - m) sums / m, the same bits on
    any layout."""
    fold_mean(running, (sums / m).as_in_context(running[0][0].context))


def into_grads(total, P):
    """Afterwards each p.grad of the arrays P holds its slice of the flat `total` (P's sizes in
    order): the tree's sum handed to the optimiser, the same bits on every copy."""
    at = 0
    for p in P:
        total[at:at + p.size].reshape(p.shape).copyto(p.grad)
        at += p.size


def whole_leaves_backward(strategy, X, y, places, key):
    """The backward of a strategy whose leaf of a piece is one vector [every gradient, loss, correct]
    (strategy.n gradient elements; strategy.leaves(X, y, bounds, runs) computes them; then the
    piece's batch statistics, folded into the running ones, for a model with BatchNorm): the batch cut
    over `places`, this process's subtrees and the job's tree total (exchanged under `key`) added
    into strategy.held on the first context. Returns per (loss sum, correct) the job's, on rank 0
    (zeros elsewhere: the job's metrics come from rank 0 alone)."""
    sums, home = strategy.sums, strategy.ctx[0]
    bounds, runs, mine = sums.cut(len(X), places)
    m = len(bounds)
    have = sums.subtrees(strategy.leaves(X, y, bounds, mine), mine, m, home)
    width = stats_width(strategy)
    total = sums.total(have, runs, m, strategy.n + 2 + width, home, key)
    if width:
        fold_pieces(strategy.running, total[strategy.n + 2:], m)
    strategy.held = total if strategy.held is None else strategy.held + total
    if sums.rank:
        return [(nd.zeros((1,), ctx=home), nd.zeros((1,), ctx=home))]
    n = strategy.n
    return [(total[n:n + 1], total[n + 1:n + 2])]

