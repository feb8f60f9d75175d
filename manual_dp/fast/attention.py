"""Attention over a sequence cut into blocks, one block per context of a context-parallel group.

Every function takes, per context j, the queries, keys and values of its block of tokens, each
(B, T_j, H, D) (H heads of D features; the queries already scaled by 1 / sqrt(D)), and returns
the attention output of its queries, (B, T_j, H, D) on the same context: what full attention over
the whole sequence gives for those rows. Blocks may differ in length.

    full     the reference, on one context: softmax(q k^T) v over all T tokens
    ring     ring attention (Liu et al. 2023): each context keeps its queries; the key and value
             blocks travel round the ring, one hop per step (mesh_ops.ring_shift), and each context
             folds every block it receives into an online softmax (Milakov and Gimelshein 2018;
             FlashAttention's): a running maximum m, a running sum l and a running output o,

                 m' = max(m, rowmax(s))        s = q k_b^T, the scores against block b
                 l' = l exp(m - m') + rowsum(exp(s - m'))
                 o' = o exp(m - m') + exp(s - m') v_b                 output: o / l at the end

             so no context ever holds more than one foreign block, nor the T x T scores. `ring` is
             one autograd Function (fast/ring_attention.py) whose backward passes the blocks round
             the ring again with their gradients, keeping in between only the context's own q, k,
             v, its output and log-sum-exp; `ring_autograd`, the same forward left to autograd
             (m carries no gradient: the output does not depend on it, BlockGrad), keeps every
             foreign block and every step's scores for its backward, the gradients of the keys and
             values travelling home through ring_shift's backward: the naive one, kept beside it.
    ulysses  DeepSpeed-Ulysses (Jacobs et al. 2023): one all-to-all turns sequence blocks into head
             groups (every context then holds all T tokens of H / C heads), full attention on
             those heads, and the all-to-all back; H must be a multiple of C.
"""
from mxnet import nd

from .mesh_ops import all_to_all, ring_shift
from .ring_attention import ring_attention


def heads_first(x):
    """(B, T, H, D) -> (B * H, T, D): each head a batch entry of batch_dot."""
    return nd.reshape(nd.transpose(x, axes=(0, 2, 1, 3)), shape=(-3, -2))


def heads_last(x, n_heads):
    """(B * H, T, D) -> (B, T, H, D), heads_first undone."""
    return nd.transpose(nd.reshape(x, shape=(-4, -1, n_heads, -2)), axes=(0, 2, 1, 3))


def full(q, k, v):
    """softmax(q k^T) v of one context's whole sequence, each (B, T, H, D)."""
    scores = nd.batch_dot(heads_first(q), heads_first(k), transpose_b=True)       # (B*H, T, T)
    return heads_last(nd.batch_dot(nd.softmax(scores, axis=-1), heads_first(v)), q.shape[2])


def ring(qs, ks, vs):
    """Ring attention, one autograd Function over the group (fast/ring_attention.py): context j's
    output over the whole sequence, each block's gradients from a second ring."""
    H = qs[0].shape[2]
    out = ring_attention(*([heads_first(x) for x in xs] for xs in (qs, ks, vs)))
    return [heads_last(o, H) for o in out]


def ring_autograd(qs, ks, vs):
    """Ring attention left to autograd: after step t, context j has folded in the key and value blocks of contexts
    j, j - 1, ..., j - t; after C steps, all of them."""
    H = qs[0].shape[2]
    q = [heads_first(x) for x in qs]
    k, v = [heads_first(x) for x in ks], [heads_first(x) for x in vs]
    m, l, o = [None] * len(q), [None] * len(q), [None] * len(q)
    for step in range(len(q)):
        if step:
            k, v = ring_shift(k), ring_shift(v)                              # one hop round the ring
        for j in range(len(q)):
            s = nd.batch_dot(q[j], k[j], transpose_b=True)                   # (B*H, T_j, T_b)
            top = nd.BlockGrad(nd.max(s, axis=-1, keepdims=True))
            new_m = top if m[j] is None else nd.BlockGrad(nd.maximum(m[j], top))
            p = nd.exp(nd.broadcast_sub(s, new_m))
            pv = nd.batch_dot(p, v[j])
            if m[j] is None:
                l[j], o[j] = nd.sum(p, axis=-1, keepdims=True), pv
            else:
                fade = nd.exp(m[j] - new_m)                                  # the old terms' rescaling
                l[j] = l[j] * fade + nd.sum(p, axis=-1, keepdims=True)
                o[j] = nd.broadcast_mul(o[j], fade) + pv
            m[j] = new_m
    return [heads_last(nd.broadcast_div(oj, lj), H) for oj, lj in zip(o, l)]


def ulysses(qs, ks, vs):
    """DeepSpeed-Ulysses: sequence blocks to head groups (all-to-all), full attention, and back."""
    C, H = len(qs), qs[0].shape[2]
    if H % C:
        raise ValueError(f"Ulysses attention needs the {H} heads to be a multiple of the {C} contexts")
    lengths = [x.shape[1] for x in qs]
    to_heads = [all_to_all(xs, split=2, join_axis=1) for xs in (qs, ks, vs)]    # (B, T, H/C, D) each
    out = [full(q, k, v) for q, k, v in zip(*to_heads)]
    return all_to_all(out, split=1, join_axis=2, sizes=lengths)                   # (B, T_j, H, D)


ATTENTION = {"ring": ring, "ulysses": ulysses}
