"""--deterministic Megatron-SP: TensorParallel(..., sequence_parallel=True, sums=FixedSums) with the
bits of one context's --deterministic step given the same --sequence-pieces K and --tensor-pieces Q
(T dividing both).

Megatron-SP keeps, between the split layers, only a block of the tokens on each context of a tensor
group: the layer norms, residual adds, biases and dropout run on 1/T of the sequence, f gathers the
blocks, g reduce-scatters the partial sums, and a layer norm's gradient is a sum over the group's
blocks of tokens (one kernel on one context). Made the leaves of the fixed trees:

    tokens      the sequence is K pieces ("lanes", strategies/context/sequence_pieces.py), lane b's token-wise
                work (embedding, layer norms, residual adds, biases, the pooling's share) on its home
                context row[b // (K/T)]: the sequence-sharded region of Megatron-SP, in K/T lanes a
                context instead of one block
    f, g        per lane, f copies its home's layer-norm output to the Q pieces (on the group's
                contexts, Q/T each; backward: the tree sum of the pieces' gradients, sent home), g adds
                the pieces' partial products in the tree and sends the sum home (backward: a copy to
                every piece): PieceJoin's tree sums, delivered to one context instead of every one
    the sums    a layer norm's (every unsplit parameter's) gradient is the tree sum over the lanes of
                each lane's, computed on its home (tree_reduce over the homes); a split piece's is the
                tree sum over the lanes on its context; attention folds the lanes of each piece in one
                order (FixedAttention) and the pooling adds them in the tree (LaneSum)

It is strategies/context/grid_sums.py's grid with C = 1 (each tensor group one row) whose lanes are
placed at home. Every lane runs the same kernels on the same shapes as there (one context: all K
lanes, all Q pieces), the same trees add the same values, so the bits are --mode sync --cpus 1
--deterministic --sequence-pieces K --tensor-pieces Q's, and --mode context cp x tp's.
"""
from mxnet import autograd, nd

from ..sums.fixed_sums import leaf
from ..context.grid_sums import FixedGrid
from ..context.sequence_pieces import Lanes
from .tensor_pieces import PieceJoin, as_list, tree_reduce


class HomeF(autograd.Function):
    """f of a lane held on one context: a copy of x for each of the pieces (k on each context of
    `row`); backward, the tree sum of the pieces' gradients, on x's context."""

    def __init__(self, row, k):
        super().__init__()
        self.row, self.k = row, k

    def forward(self, x):
        self.home = x.context
        return tuple(x.copyto(self.row[q // self.k]) for q in range(len(self.row) * self.k))

    def backward(self, *dys):
        return tree_reduce(dys, self.row, self.k).copyto(self.home)


class HomeG(autograd.Function):
    """g of a lane held on `home`: the tree sum of the pieces' partials, on home; backward, a copy
    of the gradient for each piece."""

    def __init__(self, row, k, home):
        super().__init__()
        self.row, self.k, self.home = row, k, home

    def forward(self, *parts):
        return tree_reduce(parts, self.row, self.k).copyto(self.home)

    def backward(self, dy):
        return tuple(dy.copyto(self.row[q // self.k]) for q in range(len(self.row) * self.k))


class HomeJoin(PieceJoin):
    """The join of one lane (a grid row of one context, its home) whose split layers run in the
    pieces of the tensor group `row`, k on each context; for_row(c) of a HomeJoin of the group gives
    lane c's (homes[c])."""

    def __init__(self, row, k, homes, home=None):
        super().__init__(row, k)
        self.homes, self.home = homes, home

    def for_row(self, c):
        return HomeJoin(self.row, self.k, self.homes, self.homes[c])

    def f(self, xs):
        return as_list(HomeF(self.row, self.k)(*xs))

    def g(self, parts):
        return [HomeG(self.row, self.k, self.home)(*parts)]

    def leads(self, per_piece):
        return [per_piece[0]]                          # piece 0's view: its unsplit arrays are the home's


class FixedSequence(FixedGrid):
    """The --deterministic Megatron-SP half of TensorParallel (strategies/tensor/tensor.py): len(ctx) // T
    tensor groups of T contexts (data parallel), each lane's token-wise work on its home (see the
    module docstring); FixedGrid's lane methods with the lanes placed at home."""

    def hold_sequence(self, params, ctx, optimizer, T, K, model):
        """Afterwards FixedGrid's storage with C = 1, lanes K/T at home on each context; ValueError
        where T does not divide K."""
        if K % T:
            raise ValueError(f"tensor degree {T} must divide the {K} sequence pieces (each context the home "
                             f"of as many)")
        self.kh = K // T                                           # lanes a context is home to
        self.hold_grid(params, ctx, optimizer, 1, T, "ring", K, model)
        self.cut_at = sum(a is not None for a in self.split) * self.k     # a context's piece arrays, then unsplit

    def group_lanes(self, grid):
        """The Lanes of a group (one row): K/T at home on each of its contexts."""
        return Lanes(self.net.tokens, self.K, grid[0], causal=self.net.causal)

    def homes(self, r):
        """Group r's home context of each lane: K/T lanes on each of its contexts, in order."""
        return [self.grid[r][b // self.kh] for b in range(self.K)]

    def lane_views(self, weights):
        """Each lane's pieces: the split arrays of every context's copy, the unsplit of its home's."""
        n = self.cut_at
        return super().lane_views([[Wt[:n] + W[b // self.kh][n:] for Wt in W] for b, W in enumerate(weights)])

    def lane_forward(self, r, X, weights):
        """Class scores [[on its home] per lane]: each lane's tokens on its home only."""
        homes = self.homes(r)
        return self.net.grid_forward([[X.as_in_context(h)] for h in homes], self.lane_views(weights),
                                     HomeJoin(self.grid[r], self.k, homes), self.lanes[r])

    def lane_sums(self, r, weights):
        """Per context t: the lanes' gradients of its pieces added in the tree on it, then the unsplit
        parameters': each lane's from its home, added in the tree over the homes."""
        n, row = self.cut_at, self.grid[r]
        whole = tree_reduce([leaf([w.grad for w in W[b // self.kh][n:]]) for b, W in enumerate(weights)], row, self.kh)
        return [nd.concat(tree_reduce([leaf([w.grad for w in W[t][:n]]) for W in weights], [c], self.K),
                          whole.as_in_context(c), dim=0) for t, c in enumerate(row)]
