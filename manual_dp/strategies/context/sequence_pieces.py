"""The sequence in a fixed number of pieces, every sum over them in one fixed order: the token
arithmetic of --deterministic --mode context (strategies/context/context_sums.py), and of one
context's --deterministic step under the same --sequence-pieces K.

Where context parallelism's float sums depend on the placement, and what fixes each:

    attention     ring attention folds the key and value blocks into each query block's online
                  softmax in the ring's order, C of them; Ulysses computes one whole softmax per head
                  group. Here the sequence is always K pieces ("lanes", chunk_bounds(T, K) tokens
                  each) and every query piece folds key pieces 0, 1, ..., K-1 in that order (ring
                  attention's fold, fast/ring_attention.py); in the backward dq of a query piece is
                  added over key pieces 0..K-1, dk and dv of a key piece over query pieces 0..K-1
    weight sums   a weight's gradient is a sum over tokens; a kernel given a context's K/C pieces at
                  once would add them in its own order. Here each lane runs every layer on its own
                  piece with its own copy of the parameters, so its copy's gradient is one leaf, and
                  the K leaves are added in fixed_sums.py's binary tree over the lane numbers
                  (tensor_pieces.tree_reduce: each context its own whole subtrees, the first the rest)
    the pooling   the mean over tokens is the tree's sum of the lanes' shares (LaneSum), its
                  backward the tree's sum of every lane's gradient

A lane is placed on row[b // (K/C)] of its group of C contexts (C must divide K); one context holds
all K. The same kernels run on the same shapes for any C, so the bits do not depend on C: measured
(docs/design.md, 2026-11-26), MXNet's GEMM gives a row another result when the call has fewer rows,
so piecing only the weight-gradient sums would not do. Ulysses ("groups"): every context computes
the K pieces' attention of its H/C heads (the same fold, a batch of H/C heads instead of H: batch_dot
computes each batch entry alone), and sends each piece's output back.
"""
from mxnet import autograd, nd

from ...fast.attention import heads_first, heads_last
from ...fast.causal_attention import causal, chunk_grads
from ...fast.collectives import chunk_bounds
from ...fast.ring_attention import block_grads, fold, scores
from ..tensor.tensor_pieces import as_list, tree_reduce


def fixed_forward(q, k, v, is_causal=False):
    """([o_a], [lse_a]): each query piece q[a] (B*H, T_a, D) against key and value pieces 0..K-1
    folded in that order, on q[a]'s context; is_causal: pieces 0..a only, piece a's scores above
    the diagonal masked."""
    out, lse = [], []
    for a, qa in enumerate(q):
        state = None
        for b, (kb, vb) in enumerate(zip(k[:a + 1] if is_causal else k, v)):
            s = scores(qa, kb.as_in_context(qa.context))
            state = fold(state, causal(s) if is_causal and b == a else s, vb.as_in_context(qa.context))
        m, l, o = state
        out.append(nd.broadcast_div(o, l))
        lse.append(m + nd.log(l))
    return out, lse


def fixed_backward(q, k, v, o, lse, do, is_causal=False):
    """(dq, dk, dv): dq[a] added over key pieces 0..K-1 (is_causal: 0..a) in order on q[a]'s context,
    dk[b] and dv[b] over query pieces 0..K-1 (b..K-1) in order on k[b]'s."""
    dq, dk, dv = ([nd.zeros_like(x) for x in xs] for xs in (q, k, v))
    for a, (qa, c) in enumerate((x, x.context) for x in q):
        D = nd.sum(do[a] * o[a], axis=-1, keepdims=True)                        # (B*H, T_a, 1)
        for b in range(a + 1 if is_causal else len(k)):
            args = (qa, k[b].as_in_context(c), v[b].as_in_context(c), lse[a], do[a], D)
            gq, gk, gv = chunk_grads(*args, b == a) if is_causal else block_grads(*args)
            dq[a] += gq
            dk[b] += gk.as_in_context(dk[b].context)
            dv[b] += gv.as_in_context(dv[b].context)
    return dq, dk, dv


def to_groups(xs, groups):
    """[[piece a's heads of group j, head-first, on groups[j]] for each group j]: the all-to-all to
    head groups (groups None: one group, each piece where it is)."""
    if groups is None:
        return [[heads_first(x) for x in xs]]
    n = xs[0].shape[2] // len(groups)
    return [[heads_first(nd.slice_axis(x, axis=2, begin=j * n, end=(j + 1) * n).as_in_context(c)) for x in xs]
            for j, c in enumerate(groups)]


def from_groups(per_group, like):
    """Piece a's (B, T_a, H, D) on like[a]'s context from every group's head-first part: to_groups undone."""
    out = []
    for a, x in enumerate(like):
        n = x.shape[2] // len(per_group)
        parts = [heads_last(g[a], n).as_in_context(x.context) for g in per_group]
        out.append(nd.concat(*parts, dim=2) if len(parts) > 1 else parts[0])
    return out


class FixedAttention(autograd.Function):
    """Attention over K pieces as one autograd node: forward(*q, *k, *v), each (B, T_b, H, D) on its
    lane's context, returns the K outputs; groups: Ulysses' contexts (None: ring, each query piece on
    its own lane)."""

    def __init__(self, groups=None, is_causal=False):
        super().__init__()
        self.groups, self.is_causal = groups, is_causal

    def forward(self, *qkv):
        K = len(qkv) // 3
        self.like = [x.detach() for x in qkv]
        q, k, v = (to_groups(list(qkv[i * K:(i + 1) * K]), self.groups) for i in range(3))
        done = [fixed_forward(*g, self.is_causal) for g in zip(q, k, v)]
        self.kept = (q, k, v, [o for o, _ in done], [lse for _, lse in done])
        return tuple(from_groups([o for o, _ in done], self.like[:K]))

    def backward(self, *do):
        q, k, v, o, lse = self.kept
        K = len(do)
        grads = [fixed_backward(*g, dg, self.is_causal)
                 for g, dg in zip(zip(q, k, v, o, lse), to_groups(list(do), self.groups))]
        self.kept = ()
        return tuple(x for i in range(3) for x in from_groups([g[i] for g in grads], self.like[i * K:(i + 1) * K]))


def add_up(where, row, k):
    """xs -> the tree's sum of xs (lanes on `where`, k on each context of `row`), a copy on each
    lane's context."""
    def total(xs):
        s = tree_reduce(list(xs), row, k)
        return tuple(s.copyto(c) for c in where)
    return total


class LaneSum(autograd.Function):
    """Every lane's output is the tree's sum of the lanes' inputs; backward: every lane's gradient is
    the tree's sum of every output's gradient (each output depends on every input)."""

    def __init__(self, where, row, k):
        super().__init__()
        self.total = add_up(where, row, k)

    def forward(self, *xs):
        return self.total(xs)

    def backward(self, *dys):
        return self.total(dys)


class Lanes:
    """The Sequence (strategies/context/context.py) of a group `row` of C contexts holding the K pieces of
    the sequence, K/C consecutive ones each: `bounds` (K + 1 token offsets), `where` (each lane's
    context), `attend` (FixedAttention: ring's fold, or Ulysses' head groups) and `sum` (LaneSum).
    attend and sum read the contexts off their arguments, so one Lanes serves every column of a
    cp x tp grid (strategies/context/grid_sums.py), each column its own contexts."""

    def __init__(self, n_tokens, K, row, attention="ring", causal=False):
        self.tokens, self.bounds, self.row, self.k = n_tokens, chunk_bounds(n_tokens, K), list(row), K // len(row)
        self.chunks = [[(a, b)] for a, b in zip(self.bounds, self.bounds[1:])]   # a lane's tokens (models/gpt.py)
        self.where = [self.row[b // self.k] for b in range(K)]
        self.ulysses, self.causal = attention == "ulysses" and len(self.row) > 1, causal

    def attend(self, qs, ks, vs):
        groups = distinct([q.context for q in qs]) if self.ulysses else None
        return as_list(FixedAttention(groups, self.causal)(*qs, *ks, *vs))

    def sum(self, xs):
        where = [x.context for x in xs]
        row = distinct(where)
        return as_list(LaneSum(where, row, len(xs) // len(row))(*xs))


def distinct(contexts):
    """The contexts of a list, each once, in order (the row of a column's lanes)."""
    return list(dict.fromkeys(contexts))
