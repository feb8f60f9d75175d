"""A mixture-of-experts MLP for the GPT's blocks (`--experts E --top-k K --capacity-factor F`), routed
with dense, graph-friendly operators (GShard's dispatch and combine tensors), so that the same code
runs eagerly (F=nd) and in the cached symbolic graph (F=sym, fast/graph.py).

    router     logits x Wr^T (B, T, E), softmax over the E experts: probabilities p
    top-k      the expert of the largest p, ties to the lower index; for K = 2 the largest of the
               rest, the same way. Gates: Switch's for K = 1 (the gate is p of the expert chosen),
               GShard's for K = 2 (p of the two renormalised to sum to 1; Mixtral's softmax over the
               top-2 logits gives the same numbers)
    capacity   C = ceil(F * T * K / E) slots per expert (F none: dropless, C = T). Slots go in
               GShard's order: every first choice in position order, then every second choice in
               position order after the first choices an expert kept; a token past C is dropped
               for that choice (its MoE output is zero there, the residual carries it)
    experts    E two-layer ReLU MLPs (d -> 4d -> d), each on its C slots: (E, B*C, d) batched
               products; combine puts each slot's output back on its token, times its gate
    aux        Switch/GShard's load-balancing loss E * sum_e f_e * P_e, f_e the share of tokens
               whose first choice is e (before capacity), P_e the mean of p_e over the tokens

**The routing group is one example (a window of T tokens).** Capacity, slots, drops and the aux
loss are computed within each window, from that window's tokens alone. Every data, ZeRO and
pipeline layout splits a batch by rows, so by windows: each routes every token as one context
does and drops the same tokens, by construction, with no counts exchanged. Layouts that cut a
window (context parallelism, Megatron-SP) or split an expert's weights (tensor parallelism) are
refused (GPT.tensor_refusal, sequence_refusal, checks.check_experts). Expert parallelism shards whole
experts over a group of contexts (experts_group, make_expert_block; strategies/expert/): each context
routes its own rows as here, so it drops the same tokens too.

**How the aux loss reaches the gradient.** The hidden state of an MoE GPT carries one extra row:
(B, T + 1, d), row T holding coef * (the sum of the blocks' aux losses so far) of its example in
every channel. The embedding appends it as zeros, each MoE block adds its window's term, and the
head returns (B, T + 1, vocab): the T positions' scores, then a row whose column 0 is the example's
aux term. models/contract.py's example_loss adds that term to the example's loss (and count_correct
and sampling read the T positions only). A pipeline stage passes one array a micro-batch as
before; every strategy's sum over examples includes the term and its division by the examples
summed stays right: the objective is the mean over examples of (mean token loss + coef * aux).
"""
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
from mxnet import nd

from ..lesson import relu
from .contract import Param
from .dropout import dropout
from .transformer import attention, layer_norm


@dataclass(frozen=True)
class Experts:
    """An MoE MLP's settings: E experts, top-K routing, capacity factor (None: dropless), the aux
    loss's coefficient (each expert d -> 4d -> d, as the dense MLP)."""
    experts: int
    top_k: int = 1
    capacity_factor: Optional[float] = 1.0
    aux_loss_coef: float = 0.01

    def capacity(self, T):
        """Slots per expert in a window of T tokens: ceil(F * T * K / E), at most T; T if dropless."""
        if self.capacity_factor is None:
            return T
        return max(1, min(T, math.ceil(self.capacity_factor * T * self.top_k / self.experts)))


def where_of(x):
    return {"ctx": x.context} if isinstance(x, nd.NDArray) else {}


def lower_ones(n, F, like):
    """(n, n) ones on and below the diagonal: row t sums items 0..t."""
    i = F.arange(n, **where_of(like))
    return F.broadcast_greater_equal(F.reshape(i, shape=(-1, 1)), F.reshape(i, shape=(1, -1)))


def cumulative(m, n, F, like):
    """Inclusive running sums of m (..., n) over its last axis: a product with lower_ones."""
    return F.FullyConnected(m, lower_ones(n, F, like), no_bias=True, num_hidden=n, flatten=False)


def first_max(x, E, F):
    """One-hot (..., E) of the largest of x's last axis, ties to the lowest index."""
    top = F.broadcast_equal(x, F.max(x, axis=-1, keepdims=True))
    return top * (cumulative(top, E, F, x) == 1)


def choices(p, cfg, T, E, F):
    """[(mask (B, T, E) of the expert chosen, slot (B, T), kept (B, T))] for each of the K choices:
    slots in GShard's order (module docstring), kept where the slot is below the capacity."""
    C, out, p = cfg.capacity(T), [], F.BlockGrad(p)
    offset = None                                                   # (B, 1, E) slots the earlier choices took
    for k in range(cfg.top_k):
        mask = first_max(p - 2 * sum(m for m, _, _ in out) if out else p, E, F)   # (B, T, E)
        counts = F.swapaxes(cumulative(F.swapaxes(mask, 1, 2), T, F, p), 1, 2)   # (B, T, E) inclusive
        if offset is not None:
            counts = F.broadcast_add(counts, offset)
        slot = F.sum(counts * mask, axis=-1) - 1                                  # (B, T)
        kept = slot < C
        taken = F.sum(F.broadcast_mul(mask, F.expand_dims(kept, axis=-1)), axis=1, keepdims=True)   # (B, 1, E)
        offset = taken if offset is None else offset + taken
        out.append((mask, slot, kept))
    return out


def gates(p, picked, F):
    """Each choice's gate (B, T): p of its expert (K = 1, Switch), or renormalised over the two."""
    g = [F.sum(p * mask, axis=-1) for mask, _, _ in picked]
    if len(g) == 1:
        return g
    total = g[0] + g[1]
    return [x / total for x in g]


def dispatch_combine(p, cfg, T, E, F):
    """(dispatch, combine), each (B, T, E * C): dispatch 1 where token t holds a slot of expert e,
    combine the same times its gate (gradient to the router through the gates)."""
    C, picked = cfg.capacity(T), choices(p, cfg, T, E, F)
    dispatch = combine = 0
    for (mask, slot, kept), gate in zip(picked, gates(p, picked, F)):
        where = F.expand_dims(F.broadcast_mul(mask, F.expand_dims(kept, axis=-1)), axis=3)         # (B, T, E, 1)
        onehot = F.expand_dims(F.one_hot(slot, C), axis=2)                         # (B, T, 1, C)
        d = F.broadcast_mul(where, onehot)                                         # (B, T, E, C)
        dispatch = dispatch + d
        combine = combine + F.broadcast_mul(d, F.reshape(gate, shape=(0, 0, 1, 1)))
    return F.reshape(F.BlockGrad(dispatch), shape=(0, 0, -3)), F.reshape(combine, shape=(0, 0, -3))


def routed(x, wr, cfg, T, E, F):
    """(probs (B, T, E), combine (B, T, E*C), slots (E, B*C, d)) of x (B, T, d) and the router wr:
    each expert's C slots of every window, filled by the dispatch tensor."""
    C = cfg.capacity(T)
    probs = F.softmax(F.FullyConnected(x, wr, no_bias=True, num_hidden=E, flatten=False), axis=-1)  # (B, T, E)
    dispatch, combine = dispatch_combine(probs, cfg, T, E, F)                    # (B, T, E*C)
    slots = F.batch_dot(dispatch, x, transpose_a=True)                           # (B, E*C, d)
    slots = F.reshape(F.transpose(F.reshape(slots, shape=(0, -4, E, C, 0)), axes=(1, 0, 2, 3)), shape=(0, -3, 0))
    return probs, combine, slots                                                 # slots (E, B*C, d)


def expert_mlps(slots, w1, b1, w2, b2, F):
    """Each expert's MLP on its slots (E', S, d), E' the experts whose weights are given: (E', S, d)."""
    hidden = relu(F.broadcast_add(F.batch_dot(slots, w1, transpose_b=True), F.expand_dims(b1, axis=1)), F)
    return F.broadcast_add(F.batch_dot(hidden, w2, transpose_b=True), F.expand_dims(b2, axis=1))


def combined(y, combine, probs, C, T, E, F):
    """(out (B, T, d), aux (B,)): the experts' outputs y (E, B*C, d) back on their tokens, times
    their gates, and the window's aux loss."""
    y = F.reshape(F.transpose(F.reshape(y, shape=(0, -4, -1, C, 0)), axes=(1, 0, 2, 3)), shape=(0, -3, 0))
    out = F.batch_dot(combine, y)                                                # (B, T, d)
    first = F.BlockGrad(first_max(F.BlockGrad(probs), E, F))
    share, mean_p = (F.sum(v, axis=1) * (1 / T) for v in (first, probs))         # (B, E) f and P
    return out, E * F.sum(share * mean_p, axis=-1)


def experts_forward(x, p, cfg, T, E, F):
    """The experts' output (B, T, d) of x (B, T, d) and the window's aux loss (B,); p: router
    weight, w1 (E, H, d), b1 (E, H), w2 (E, d, H), b2 (E, d)."""
    probs, combine, slots = routed(x, p[0], cfg, T, E, F)
    return combined(expert_mlps(slots, *p[1:], F), combine, probs, cfg.capacity(T), T, E, F)


def experts_group(xs, ps, cfg, T, E, group, F=nd):
    """experts_forward on the contexts of an expert-parallel group, context j holding experts
    j E/N .. (j + 1) E/N - 1 (ps[j][1:] their weights): each routes its own rows, group.send
    (an all-to-all) brings every context's slots of its experts to it, group.back takes the
    outputs home for each context's combine."""
    C, routes = cfg.capacity(T), [routed(x, p[0], cfg, T, E, F) for x, p in zip(xs, ps)]
    received = group.send([slots for _, _, slots in routes])                   # [(E/N, sum_i B_i*C, d)]
    ys = group.back([expert_mlps(s, *p[1:], F) for s, p in zip(received, ps)],
                    [slots.shape[1] for _, _, slots in routes])                # [(E, B_j*C, d)]
    return [combined(y, combine, probs, C, T, E, F) for y, (probs, combine, _) in zip(ys, routes)]


def split_carry(h, T, F):
    """(tokens (B, T, d), carry (B, 1, d)) of an MoE hidden state (B, T + 1, d)."""
    return F.slice_axis(h, axis=1, begin=0, end=T), F.slice_axis(h, axis=1, begin=T, end=T + 1)


def with_carry(x, F):
    """x (B, T, d) with a zero carry row appended: (B, T + 1, d)."""
    return F.concat(x, F.zeros_like(F.slice_axis(x, axis=1, begin=0, end=1)), dim=1)


def attended(h, p, F, shapes, head_dim, site, T):
    """(x + causal attention(LN(x)) (B, T, d), carry (B, 1, d)) of an MoE hidden state h."""
    x, carry = split_carry(h, T, F)
    a = attention(layer_norm(x, p[0], p[1], F, shapes[0][0]), p[2:10], F, shapes[2:10], head_dim, True)
    return x + dropout(a, site, F), carry


def make_moe_block(head_dim, site, cfg, T):
    def moe_block(h, p, F=nd, shapes=None):
        """h + causal attention(LN(h)), then h + MoE(LN(h)) on the T tokens, and coef * the window's
        aux loss added to the carry row; p: ln1 g, b, q, k, v, o (w, b each), ln2 g, b, router,
        w1, b1, w2, b2."""
        shapes = shapes or [x.shape for x in p]
        x, carry = attended(h, p, F, shapes, head_dim, site, T)
        out, aux = experts_forward(layer_norm(x, p[10], p[11], F, shapes[10][0]), p[12:], cfg, T, cfg.experts, F)
        carry = F.broadcast_add(carry, F.reshape(aux * cfg.aux_loss_coef, shape=(-1, 1, 1)))
        return F.concat(x + dropout(out, site + 1, F), carry, dim=1)
    return moe_block


def make_expert_block(head_dim, site, cfg, T):
    def expert_block(hs, own, group, Fs):
        """moe_block on the contexts of an expert-parallel group (experts_group): hs[j] context j's
        rows, own[j] its parameters (its experts' alone), Fs[j] its namespace (its dropout masks)."""
        shapes = [[x.shape for x in p] for p in own]
        xs, carries = zip(*[attended(h, p, F, s, head_dim, site, T) for h, p, F, s in zip(hs, own, Fs, shapes)])
        normed = [layer_norm(x, p[10], p[11], F, s[10][0]) for x, p, F, s in zip(xs, own, Fs, shapes)]
        outs = experts_group(normed, [p[12:] for p in own], cfg, T, cfg.experts, group)
        return [F.concat(x + dropout(out, site + 1, F), F.broadcast_add(carry, F.reshape(aux * cfg.aux_loss_coef,
                                                                                        shape=(-1, 1, 1))), dim=1)
                for x, carry, (out, aux), F in zip(xs, carries, outs, Fs)]
    return expert_block


EXPERT_PARAMS = (13, 14, 15, 16)      # an MoE block's parameters cut by expert (axis 0): w1, b1, w2, b2


def moe_params(l, d, hidden, E):
    """Block l's MoE parameters, after its attention's and second layer norm's."""
    def P(name, shape, init="zeros", fan=0):
        return Param(f"block{l}_{name}", shape, init, fan)
    return (P("router", (E, d), "lecun", d), P("experts_w1", (E, hidden, d), "he", d), P("experts_b1", (E, hidden)),
            P("experts_w2", (E, d, hidden), "lecun", hidden), P("experts_b2", (E, d)))


def moe_costs(T, d, hidden, H, cfg):
    """(forward FLOPs, activations kept) of an MoE block per example."""
    E, C = cfg.experts, cfg.capacity(T)
    flops = 2 * T * 4 * d * d + 4 * T * T * d + 2 * T * d * E + 2 * 2 * T * E * C * d + 2 * E * C * 2 * d * hidden
    acts = T * (11 * d + 4 * E) + 2 * H * T * T + 2 * T * E * C + E * C * (2 * d + 2 * hidden)
    return flops, acts


def routing(h, p, head_dim, cfg, T):
    """The routing of an MoE block of input h (B, T + 1, d) and parameters p, eagerly (no dropout):
    host arrays (B, T, K) of the expert each choice picked, its slot, and whether it was kept."""
    x, _ = attended(h, p, nd, [w.shape for w in p], head_dim, 0, T)
    x = layer_norm(x, p[10], p[11], nd)
    probs = nd.softmax(nd.FullyConnected(x, p[12], no_bias=True, num_hidden=cfg.experts, flatten=False), axis=-1)
    picked = choices(probs, cfg, T, cfg.experts, nd)
    expert, slot, kept = ([v.asnumpy() for v in vs] for vs in zip(*[(m.argmax(axis=-1), s, k) for m, s, k in picked]))
    return tuple(np.stack(v, axis=-1).astype(t) for v, t in ((expert, np.int16), (slot, np.int32), (kept, np.uint8)))
