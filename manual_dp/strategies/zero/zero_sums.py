"""--deterministic --mode zero: ZeroRedundancy (zero.py) given a FixedSums, ZeRO's sharding with the
one fixed tree of strategies/sums/fixed_sums.py.

The leaves and the tree are --deterministic --mode sync's (strategies/data/data_sums.py): the batch
cut into pieces of `piece` rows, each piece's [gradient, loss, correct] (N + 2,) computed whole, on
full parameters, by the context that owns it, and added in the binary tree over the piece numbers.
What changes is where the sums end:

    1. full parameters for the step          stage 1: the replicas; stage 2: views of the full
                                             flats; stage 3: the shards all-gathered into a
                                             transient (N,) per context, dropped after the leaves
    2. each context's whole subtrees (cover) added on that context as its leaves arrive (Fold:
       a node is made as soon as its children are, so a context holds a partial sum per level,
       not a leaf per piece)
    3. a deterministic reduce-scatter: context i takes elements [ends[i], ends[i+1]) of every
       context's subtrees (across processes: of every process's, exchanged through a zero-slot
       table per shard, as FixedSums swaps whole vectors) and adds them in the tree's order;
       the last shard also holds the loss and correct count, elements N and N + 1 (and a model
       with BatchNorm's piece statistics after them, folded as data_sums.py folds them)
    4. each context updates its shard with apply_update_and_clear, the very call (and division by
       n_examples) DataParallel's fixed update makes on the full vector; stages 1 and 2 then
       all-gather the parameters (copies)

An addition of two vectors is elementwise, so element e of the tree's sum has the same bits
whether it is added in a whole vector or in a shard; so have the optimiser's elementwise updates.
The parameters after each step are therefore the bits of `--deterministic --mode sync` (the same
leaves, the same tree, the same update), on any context count, process count and stage.
"""
from mxnet import autograd, nd

from ...fast.flat import views
from ...fast.graph import ModelGraph
from ...fast.sharded import empty_shards
from ...optim import apply_update_and_clear
from ..data.data_sums import leaf_graph, piece_leaves, refuse_sync_batchnorm
from ..sums.fixed_sums import Fold, cover, fold_pieces, refuse_running_pieces, root_of, stats_width, tree_sum
from ..tensor.tensor_pieces import piece_forward


class FixedZero:
    """The --deterministic half of ZeroRedundancy (zero.py), whose attributes it reads."""

    def keep_fixed(self, graph):
        """Afterwards the leaves' graph (or None: imperative) and forward are ready, and each
        parameter shard's p.grad is its gradient shard, for apply_update_and_clear."""
        refuse_running_pieces(self.running, self.sums.tensor_pieces)
        refuse_sync_batchnorm(self.sync_batchnorm)
        self.graph = ModelGraph(1, self.shapes, model=self.net) if leaf_graph(graph, self.sums, self.net) else None
        self.leaf_forward = piece_forward(self.net, self.sums.tensor_pieces)
        self.n = int(self.offsets[-1])
        # shard i of a leaf; the last adds the loss, correct count and (BatchNorm) the piece's statistics
        self.ends = self.bounds[:-1] + [self.n + 2 + stats_width(self)]
        if self.stage == 1:
            for r in self.replicas:
                r.mark("write")                              # each piece's backward overwrites
            self.grad_shards = empty_shards(self.n, self.ctx)
        autograd.mark_variables(self.shards, self.grad_shards, grad_reqs="add")

    def fixed_backward(self, X, y):
        """The tree's sum of the batch's leaves added into each context's gradient shard."""
        k = len(self.ctx)
        bounds, runs, mine = self.sums.cut(len(X), k)
        m = len(bounds)
        have = self.subtrees(X, y, bounds, mine)
        totals = [self.shard_sum(i, have, runs, m) for i in range(k)]
        for g, total in zip(self.grad_shards, totals):
            nd.elemwise_add(g, total[:g.size], out=g)        # 0 + x is x: no sum in the tree is -0
        if stats_width(self):
            fold_pieces(self.running, totals[-1][self.grad_shards[-1].size + 2:], m)
        if self.sums.rank:                                   # the job's metrics come from rank 0 alone
            return [(nd.zeros((1,), ctx=self.ctx[0]), nd.zeros((1,), ctx=self.ctx[0]))]
        last, at = totals[-1], self.grad_shards[-1].size
        return [(last[at:at + 1], last[at + 1:at + 2])]

    def full_params(self):
        """(per context the model's full parameters whose backward writes into the flat gradient,
        those flat gradients (N,), the arrays gathered for this step alone)."""
        if self.stage == 1:
            return [r.params for r in self.replicas], [r.grad for r in self.replicas], []
        if self.stage == 2:
            flats, gathered = self.flats, []
        else:
            flats = gathered = [nd.empty((self.n,), ctx=c) for c in self.ctx]    # (N,) per context
            self.all_gather(gathered, self.shards)
        params = [views(f, self.shapes) for f in flats]
        grads = [nd.zeros((self.n,), ctx=c) for c in self.ctx]                    # (N,) per context
        for W, g in zip(params, grads):
            autograd.mark_variables(W, views(g, self.shapes), grad_reqs="write")
        return params, grads, gathered

    def subtrees(self, X, y, bounds, runs):
        """{node: value on the context that added it}: the whole subtrees of each context's run."""
        params, grads, gathered = self.full_params()
        folds = [Fold(lo, hi, len(bounds)) for lo, hi in runs]
        transient = [] if self.stage == 1 else grads
        for i, j, leaf in piece_leaves(self.ctx, params, grads, self.graph, X, y, bounds, runs,
                                       self.leaf_forward, bool(self.running)):
            folds[i].put(j, leaf)
            self.peak.note(gathered, transient + [v for f in folds for v in f.done.values()])
        return {node: value for f in folds for node, value in f.done.items()}

    def shard_sum(self, i, have, runs, m):
        """Elements [ends[i], ends[i+1]) of the tree's sum of every process's subtrees, on ctx[i]."""
        a, b, c = self.ends[i], self.ends[i + 1], self.ctx[i]
        part = {node: value[a:b].as_in_context(c) for node, value in have.items()}       # (b - a,)
        if self.sums.size > 1:
            part = self.swap(part, runs, m, i)
        self.peak.note([], list(have.values()) + list(part.values()))
        return tree_sum(root_of(m), m, part, lambda u, v: u + v)

    def swap(self, part, runs, m, i):
        """Every process's shard-i slices of its subtrees, on every process: each fills its own rows
        of one zero table (every process knows every run, so every slot), and the job sums them
        under the key "zero-tree{i}-" and the table's shape."""
        slots = [node for lo, hi in runs for node in cover(lo, hi, m)]
        table = nd.zeros((len(slots), self.ends[i + 1] - self.ends[i]), ctx=self.ctx[i])
        for s, node in enumerate(slots):
            if node in part:
                table[s] = part[node]
        self.sums.exchange(table, f"zero-tree{i}-")
        return {node: table[s] for s, node in enumerate(slots)}

    def fixed_update(self, lr, n_examples):
        """Each context's shard updated by apply_update_and_clear from its tree-summed gradient
        shard (then zero); stages 1 and 2 then all-gather the parameters."""
        n_examples = self.counted(n_examples)
        for p, state in zip(self.shards, self.states):
            apply_update_and_clear([p], [state], self.optimizer, lr, self.t, n_examples)
        if self.flats:
            self.all_gather(self.flats)                      # in place: shard i from context i

