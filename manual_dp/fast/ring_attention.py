"""Ring attention with a backward of its own: the key and value blocks go round the ring a second
time in the backward, so that between the two passes a context keeps only its own block.

Inputs per context j of a group of C: q_j, k_j, v_j (B*H, T_j, D), heads first, the queries already
scaled. Block b reaches context j at step t = (j - b) mod C (mesh_ops.shifted: one hop a step).

forward (Liu et al. 2023; the online softmax of Milakov and Gimelshein 2018, FlashAttention's):
    s = q_j k_b^T                                      (B*H, T_j, T_b), the scores against block b
    m' = max(m, rowmax(s)),  l' = l e^(m - m') + rowsum(e^(s - m')),  o' = o e^(m - m') + e^(s - m') v_b
    afterwards  o_j = o / l  and  lse_j = m + log l   (the log-sum-exp of every score of a row)
    kept for the backward: q_j, k_j, v_j, o_j, lse_j: no foreign block, no scores.

backward (FlashAttention-2's, over the ring as ring-flash-attention does): with dO_j the output's
gradient and D_j = rowsum(dO_j * o_j), for each block b as it passes:
    p = e^(s - lse_j)                                  the softmax weights of block b, recomputed
    dv_b += p^T dO_j,   ds = p * (dO_j v_b^T - D_j),   dq_j += ds k_b,   dk_b += ds^T q_j
dk_b and dv_b travel with k_b and v_b; after the C-th block one more hop takes them home. So the
backward sends the key and value blocks C - 1 hops again and their gradients C hops: the price of
keeping 1/C (autograd through the forward ring would keep every foreign block and every step's
scores). tests/test_mesh.py checks both against full attention and against each other.
"""
from mxnet import autograd, nd

from .mesh_ops import shifted


def scores(q, k):
    """q k^T: (B*H, T_j, D) x (B*H, T_b, D) -> (B*H, T_j, T_b)."""
    return nd.batch_dot(q, k, transpose_b=True)


def fold(state, s, v):
    """The online softmax (m, l, o) with block scores s and values v folded in (state None: the first)."""
    top = nd.max(s, axis=-1, keepdims=True)                                 # (B*H, T_j, 1)
    if state is None:
        p = nd.exp(nd.broadcast_sub(s, top))
        return top, nd.sum(p, axis=-1, keepdims=True), nd.batch_dot(p, v)
    m, l, o = state
    new_m = nd.maximum(m, top)
    p, fade = nd.exp(nd.broadcast_sub(s, new_m)), nd.exp(m - new_m)        # fade rescales the old terms
    return new_m, l * fade + nd.sum(p, axis=-1, keepdims=True), nd.broadcast_mul(o, fade) + nd.batch_dot(p, v)


def forward_ring(q, k, v):
    """([o_j], [lse_j]): every context's attention output over the whole sequence and its rows'
    log-sum-exp, after the key and value blocks went once round the ring."""
    state = [None] * len(q)
    for step in range(len(q)):
        if step:
            k, v = shifted(k, 1), shifted(v, 1)                             # one hop round the ring
        state = [fold(st, scores(qj, kj), vj) for st, qj, kj, vj in zip(state, q, k, v)]
    return ([nd.broadcast_div(o, l) for _, l, o in state],
            [m + nd.log(l) for m, l, _ in state])


def block_grads(q, k, v, lse, do, D):
    """(dq, dk, dv) of one context's queries against one block: its share of each gradient."""
    p = nd.exp(nd.broadcast_sub(scores(q, k), lse))                        # (B*H, T_j, T_b)
    ds = p * nd.broadcast_sub(nd.batch_dot(do, v, transpose_b=True), D)
    return (nd.batch_dot(ds, k), nd.batch_dot(ds, q, transpose_a=True),
            nd.batch_dot(p, do, transpose_a=True))


def backward_ring(q, k, v, o, lse, do):
    """(dq, dk, dv), each on its own context: the key and value blocks round the ring again,
    their gradients accumulated as they travel and sent home at the end."""
    D = [nd.sum(dj * oj, axis=-1, keepdims=True) for dj, oj in zip(do, o)]  # (B*H, T_j, 1)
    dq, dk, dv = ([nd.zeros_like(x) for x in xs] for xs in (q, k, v))
    for step in range(len(q)):
        if step:
            k, v, dk, dv = (shifted(x, 1) for x in (k, v, dk, dv))
        for j in range(len(q)):
            for acc, g in zip((dq[j], dk[j], dv[j]), block_grads(q[j], k[j], v[j], lse[j], do[j], D[j])):
                acc += g                                                    # in place
    return dq, shifted(dk, 1), shifted(dv, 1)                              # the last hop: home


class RingAttention(autograd.Function):
    """Ring attention over one group as one autograd node: forward(*q, *k, *v) -> the C outputs
    (B*H, T_j, D); backward: the second ring. Keeps each context's own q, k, v, output and lse."""

    def forward(self, *qkv):
        C = len(qkv) // 3
        q, k, v = list(qkv[:C]), list(qkv[C:2 * C]), list(qkv[2 * C:])
        o, lse = forward_ring(q, k, v)
        self.save_for_backward(*([x.detach() for x in xs] for xs in (q, k, v, o, lse)))
        return tuple(o)

    def backward(self, *do):
        if not self.saved_tensors:
            raise RuntimeError("ring attention's backward runs once: it freed its blocks (retain_graph is not kept)")
        q, k, v, o, lse = self.saved_tensors
        self.saved_tensors = ()            # freed now: MXNet drops this Function only later, on its engine
        dq, dk, dv = backward_ring(q, k, v, o, lse, list(do))
        return tuple(dq + dk + dv)


def ring_attention(q, k, v):
    """[o_j] (B*H, T_j, D) on each context: full attention's rows of context j's queries."""
    out = RingAttention()(*q, *k, *v)
    return list(out) if isinstance(out, (tuple, list)) else [out]
