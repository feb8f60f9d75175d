"""Causal attention over a sequence cut into chunks held by the contexts of a group: query t attends
to keys 0..t only (a language model's attention, models/gpt.py).

A context holds its tokens as chunks of one cut of the sequence (collectives.chunk_bounds):

    contiguous   C chunks, context j chunk j. With the causal mask context j attends over j + 1
                 chunks (the last context C times the first's work)
    balanced     2C chunks, context j chunks j and 2C - 1 - j (the "zig-zag" or head-and-tail cut of
                 Megatron-LM and ring-flash-attention): every context attends over 2C + 1 chunk
                 pairs, within one chunk's rounding of even

A query chunk and a key chunk of one cut are either the same (the diagonal: the scores above it
masked), or the key chunk lies wholly before (attended whole), or wholly after (skipped: nothing is
computed for it, forward or backward). `work` counts the score entries each context computes.

    causal            scores with the entries above the diagonal masked (any F: nd or mx.sym)
    causal_full       the reference on one context
    causal_ring       ring attention (fast/ring_attention.py's two rings) folding chunk pair by
                      chunk pair, the skipped pairs left out; one autograd Function
    causal_ulysses    DeepSpeed-Ulysses: the all-to-all to head groups, the tokens put in sequence
                      order, causal attention, and back
Every function takes, per context j, q, k, v (B, T_j, H, D) (queries scaled), T_j its chunks'
tokens in their order, and returns the output rows of its queries on its context.
"""
from mxnet import autograd, nd

from .attention import heads_first, heads_last
from .collectives import chunk_bounds
from .mesh_ops import all_to_all, shifted
from .ring_attention import fold, scores

MASKED = -1e4               # a masked score: its exp underflows to 0 in float32, bf16 and fp16


def causal(s, F=nd):
    """s (N, T, T) with MASKED added to every entry above the diagonal (a query's later keys): query
    t attends to keys 0..t (a masked score's exp is 0, so the softmax and its gradient are those of
    the scores 0..t alone). The pattern (1, T, T) is built from s's own shape (arange_like), so a
    cached graph holds it too, and added by broadcasting: on the default GPT's step 11% faster than
    writing a (N, T, T) mask with `where` (59,400 against 53,700 tokens/s, Zen 5, 2026-11-28)."""
    pos = F.contrib.arange_like(s, axis=-1)                                         # (T,) 0..T-1
    later = F.broadcast_greater(F.reshape(pos, shape=(1, 1, -1)), F.reshape(pos, shape=(1, -1, 1)))
    return F.broadcast_add(s, F.BlockGrad(later * MASKED))                          # (1, T, T): a later key


def chunks_of(T, C, balanced):
    """[[(start, stop) of each chunk context j holds, in order] for j in range(C)]."""
    if not balanced:
        b = chunk_bounds(T, C)
        return [[(b[j], b[j + 1])] for j in range(C)]
    b = chunk_bounds(T, 2 * C)
    return [[(b[j], b[j + 1]), (b[2 * C - 1 - j], b[2 * C - j])] for j in range(C)]


def relation(query, key):
    """"skip" (the key chunk lies after the query chunk), "diagonal" (the same chunk) or "whole"."""
    return "skip" if key[0] >= query[1] else "diagonal" if key == query else "whole"


def work(chunks):
    """Score entries each context computes per head and example: whole pairs n_q n_k, diagonal
    pairs n (n + 1) / 2 (the entries on and below it), skipped pairs none."""
    every = [c for row in chunks for c in row]
    out = []
    for row in chunks:
        total = 0
        for q in row:
            for k in every:
                rel, n = relation(q, k), q[1] - q[0]
                total += 0 if rel == "skip" else n * (n + 1) // 2 if rel == "diagonal" else n * (k[1] - k[0])
        out.append(total)
    return out


def split(x, ranges):
    """x (N, sum of the ranges' lengths, D) cut along axis 1 into one array per range."""
    out, at = [], 0
    for a, b in ranges:
        out.append(nd.slice_axis(x, axis=1, begin=at, end=at + b - a))
        at += b - a
    return out


def join(xs):
    return nd.concat(*xs, dim=1) if len(xs) > 1 else xs[0]


def causal_full(q, k, v):
    """Causal softmax(q k^T) v of one context's whole sequence, each (B, T, H, D)."""
    s = causal(nd.batch_dot(heads_first(q), heads_first(k), transpose_b=True))      # (B*H, T, T)
    return heads_last(nd.batch_dot(nd.softmax(s, axis=-1), heads_first(v)), q.shape[2])


def hop(rows):
    """One hop round the ring of every context's chunks: rows[j] (a list of chunk arrays) moves to
    context j + 1."""
    return [list(xs) for xs in zip(*[shifted(list(col), 1) for col in zip(*rows)])]


def forward_chunks(q, k, v, chunks):
    """([o_j], [lse_j]) (B*H, T_j, D) and (B*H, T_j, 1): the key and value blocks once round the
    ring, each query chunk folding the key chunks it may see (fast/ring_attention.py's fold)."""
    C = len(q)
    qc = [split(x, r) for x, r in zip(q, chunks)]
    kc, vc = [split(x, r) for x, r in zip(k, chunks)], [split(x, r) for x, r in zip(v, chunks)]
    state = [[None] * len(r) for r in chunks]
    for step in range(C):
        if step:                                                     # one hop: block j - step reaches j
            kc, vc = hop(kc), hop(vc)
        for j in range(C):
            held = chunks[(j - step) % C]
            for i, rq in enumerate(chunks[j]):
                for kb, vb, rk in zip(kc[j], vc[j], held):
                    rel = relation(rq, rk)
                    if rel != "skip":
                        s = scores(qc[j][i], kb)
                        state[j][i] = fold(state[j][i], causal(s) if rel == "diagonal" else s, vb)
    out = [join([nd.broadcast_div(o, l) for _, l, o in row]) for row in state]
    lse = [join([m + nd.log(l) for m, l, _ in row]) for row in state]
    return out, lse


def chunk_grads(q, k, v, lse, do, D, diagonal):
    """(dq, dk, dv) of one query chunk against one key chunk (FlashAttention-2's backward)."""
    s = scores(q, k)
    p = nd.exp(nd.broadcast_sub(causal(s) if diagonal else s, lse))
    ds = p * nd.broadcast_sub(nd.batch_dot(do, v, transpose_b=True), D)
    return nd.batch_dot(ds, k), nd.batch_dot(ds, q, transpose_a=True), nd.batch_dot(p, do, transpose_a=True)


def backward_chunks(q, k, v, o, lse, do, chunks):
    """(dq, dk, dv) per context: the blocks round the ring again, each chunk's key and value
    gradients travelling with it and sent home after the last step."""
    C = len(q)
    cut = [[split(x, r) for x, r in zip(xs, chunks)] for xs in (q, k, v, o, lse, do)]
    qc, kc, vc, oc, lc, dc = cut
    D = [[nd.sum(d * y, axis=-1, keepdims=True) for d, y in zip(dr, orow)] for dr, orow in zip(dc, oc)]
    dq = [[nd.zeros_like(x) for x in row] for row in qc]
    dk, dv = [[nd.zeros_like(x) for x in row] for row in kc], [[nd.zeros_like(x) for x in row] for row in vc]
    for step in range(C):
        if step:
            kc, vc, dk, dv = hop(kc), hop(vc), hop(dk), hop(dv)
        for j in range(C):
            held = chunks[(j - step) % C]
            for i, rq in enumerate(chunks[j]):
                for c, rk in enumerate(held):
                    rel = relation(rq, rk)
                    if rel == "skip":
                        continue
                    gq, gk, gv = chunk_grads(qc[j][i], kc[j][c], vc[j][c], lc[j][i], dc[j][i], D[j][i],
                                             rel == "diagonal")
                    dq[j][i] += gq
                    dk[j][c] += gk
                    dv[j][c] += gv
    dk, dv = hop(dk), hop(dv)                                                # the last hop: home
    return [join(r) for r in dq], [join(r) for r in dk], [join(r) for r in dv]


class CausalRing(autograd.Function):
    """Causal ring attention over one group as one autograd node, its chunks given: forward(*q, *k,
    *v) (B*H, T_j, D) -> the C outputs; backward: the second ring."""

    def __init__(self, chunks):
        super().__init__()
        self.chunks = chunks

    def forward(self, *qkv):
        C = len(qkv) // 3
        q, k, v = list(qkv[:C]), list(qkv[C:2 * C]), list(qkv[2 * C:])
        o, lse = forward_chunks(q, k, v, self.chunks)
        self.save_for_backward(*([x.detach() for x in xs] for xs in (q, k, v, o, lse)))
        return tuple(o)

    def backward(self, *do):
        q, k, v, o, lse = self.saved_tensors
        self.saved_tensors = ()
        dq, dk, dv = backward_chunks(q, k, v, o, lse, list(do), self.chunks)
        return tuple(dq + dk + dv)


def causal_ring(qs, ks, vs, chunks):
    """Causal ring attention: context j's output rows (B, T_j, H, D) over the tokens up to each."""
    H = qs[0].shape[2]
    out = CausalRing(chunks)(*[heads_first(x) for xs in (qs, ks, vs) for x in xs])
    return [heads_last(o, H) for o in (out if isinstance(out, (tuple, list)) else [out])]


def causal_ulysses(qs, ks, vs, chunks):
    """Ulysses with the causal mask: all-to-all to head groups (every context all T tokens of H / C
    heads, in the contexts' order), the tokens put in sequence order, causal attention, and back."""
    C, H = len(qs), qs[0].shape[2]
    if H % C:
        raise ValueError(f"Ulysses attention needs the {H} heads to be a multiple of the {C} contexts")
    held = [r for row in chunks for r in row]                       # the gathered tokens' chunks, in order
    order = sorted(range(len(held)), key=lambda i: held[i][0])
    back = sorted(range(len(held)), key=lambda i: order[i])

    def reorder(x, ranges, perm):
        parts = split(x, ranges)
        return join([parts[i] for i in perm])
    to_heads = [all_to_all(xs, split=2, join_axis=1) for xs in (qs, ks, vs)]        # (B, T, H/C, D) each
    in_order = [[reorder(x, held, order) for x in xs] for xs in to_heads]
    out = [causal_full(q, k, v) for q, k, v in zip(*in_order)]
    out = [reorder(o, [held[i] for i in order], back) for o in out]
    return all_to_all(out, split=1, join_axis=2, sizes=[sum(b - a for a, b in row) for row in chunks])


CAUSAL = {"ring": causal_ring, "ulysses": causal_ulysses}
