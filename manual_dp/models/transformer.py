"""A small vision transformer for Fashion-MNIST, written with MXNet operators under the model contract.

Each image row is a token: 28 tokens of 28 pixels (or patches of P x P pixels with `patch`).

    embed      (B, 1, 28, 28) -> tokens (B, T, d): a linear map of each token, plus learned positions
    block l    pre-norm: h + attention(LN(h)), then h + MLP(LN(h)); multi-head self-attention with
               q, k, v and the output projection kept apart, so that splitting the heads over a
               tensor group is a plain slice (nanoGPT fuses them; Megatron then needs a stride)
    head       LN, the mean over tokens, a linear map to 10 class scores

Dropout (a run's --dropout, models/dropout.py) acts where GPT-2's residual dropout does: on the
embedding's output (site 0) and on each block's attention and MLP outputs before they are added to
the residual stream (sites 2l + 1 and 2l + 2), with masks no layout changes.

Weights are (out, in), Gluon's and Megatron's layout; `split` marks Megatron's cuts: q, k, v and
the MLP's first matrix by output rows (column-parallel: whole heads, whole hidden units), the
attention output and the MLP's second matrix by input columns (row-parallel; their biases are
added once, after the sum). Layer norms are replicated.
"""
import math

from mxnet import nd

from ..config import TRANSFORMER
from ..fast.causal_attention import causal
from ..lesson import relu
from .contract import CLASSES, IMAGE, Layer, Model, Param, add_bias, fc, outer
from ..precision import float32_ops
from .dropout import dropout, dropout_at

DEFAULTS = dict(TRANSFORMER, mlp_ratio=2)          # the command line's sizes (manual_dp.config)


def layer_norm(h, g, b, F=nd, d=None, eps=1e-5):
    """(h - mean) / sqrt(var + eps) * g + b over the last axis (of size d), every mean and every
    broadcast a skinny matrix product (oneDNN's inner product): the means products with ones / d,
    the broadcasts of a (B, T, 1) column over d and of g and b over the rows outer products, so
    that every gradient is a product too. MXNet 1.9's LayerNorm operator, and its broadcast ops,
    differentiate through a slow generic reduce on CPU: on (128, 28, 64), forward and backward in
    a cached graph, one thread, 5.1 ms against 0.9 ms here (docs/performance.md). In float32 under
    any --precision, as autocast keeps layer norms."""
    F = float32_ops(F)
    d = d or g.shape[0]
    where = {"ctx": h.context} if isinstance(h, nd.NDArray) else {}    # F may wrap nd (dropout, a precision)
    average, spread = F.ones(shape=(1, d), **where) / d, F.ones(shape=(d, 1), **where)

    def times(x, w, n):
        return F.FullyConnected(x, w, no_bias=True, num_hidden=n, flatten=False)
    centred = h - times(times(h, average, 1), spread, d)                          # (B, T, d)
    scale = 1 / F.sqrt(times(F.square(centred), average, 1) + eps)                # (B, T, 1)
    return centred * outer(scale, g, d, F) + outer(F.ones_like(scale), b, d, F)    # scale g^T + ones b^T


def token_sum(h, T, F=nd):
    """The sum over the T tokens of h (B, T, d): (B, d), a batched product with ones (B, T, 1).
    MXNet 1.9's mean over a middle axis, forward and backward (a broadcast), took 2.0 ms on (128,
    28, 64) in a cached graph, one thread; the product 0.14 ms (docs/performance.md)."""
    F = float32_ops(F)
    where = {"ctx": h.context} if isinstance(h, nd.NDArray) else {}
    ones = F.broadcast_like(F.ones(shape=(1, T, 1), **where), h, lhs_axes=(0,), rhs_axes=(0,))   # (B, T, 1)
    return F.reshape(F.batch_dot(ones, h, transpose_a=True), shape=(0, -1))                     # (B, d)


def add_positions(h, pos, X, size, F=nd):
    """h (B, T, d) plus the positions pos (T, d), `size` = T * d values, in every example: pos
    broadcast as a product of ones (B, 1), shaped from the images X (which need no gradient), with
    pos as a (T*d, 1) weight, so that its gradient is a product too. MXNet 1.9's broadcast_add
    differentiates through a slow generic reduce: 1.7 ms of a 27 ms step of the default
    transformer on (128, 28, 64), one thread (docs/performance.md). In float32 under any
    --precision, as autocast keeps additions: the product with ones is exact, its gradient a
    float32 sum."""
    F = float32_ops(F)
    ones = F.ones_like(F.slice_axis(F.reshape(X, shape=(0, -1)), axis=1, begin=0, end=1))      # (B, 1)
    return h + F.reshape_like(outer(ones, pos, size, F), h)


def tokens(X, patch, F=nd):
    """Images (B, 1, 28, 28) as tokens (B, T, token size): rows (patch 0) or P x P patches."""
    if not patch:
        return F.reshape(X, shape=(-1, IMAGE[1], IMAGE[2]))                       # (B, 28, 28)
    n = IMAGE[1] // patch
    h = F.reshape(X, shape=(-1, n, patch, n, patch))                             # (B, n, P, n, P)
    h = F.transpose(h, axes=(0, 1, 3, 2, 4))                                     # (B, n, n, P, P)
    return F.reshape(h, shape=(-1, n * n, patch * patch))                        # (B, T, P*P)


def attention(a, p, F, shapes, head_dim, causal=False):
    """Multi-head self-attention of a (B, T, d) with q, k, v, o = p[0:8] (weights and biases)."""
    return fc(attend(a, p[:6], F, shapes, head_dim, causal), p[6], p[7], F, shapes[6])     # (B, T, d)


def qkv(a, p, F, shapes, head_dim):
    """The queries (scaled by 1 / sqrt(dh)), keys and values of a (B, T, d), each (B, T, nh, dh),
    with q, k, v = p[0:6] (weights and biases); the number of heads nh is what the query weight
    holds (all of them, or a tensor group's share)."""
    wq, bq, wk, bk, wv, bv = p
    n_heads = shapes[0][0] // head_dim

    def heads(x):                                         # (B, T, nh * dh) -> (B, T, nh, dh)
        return F.reshape(x, shape=(0, 0, -4, n_heads, head_dim))
    return (heads(fc(a, wq, bq, F, shapes[0]) * (1 / math.sqrt(head_dim))),   # scaled here: (B, T, d) < (B*nh, T, T)
            heads(fc(a, wk, bk, F, shapes[2])), heads(fc(a, wv, bv, F, shapes[4])))


def attend(a, p, F, shapes, head_dim, is_causal=False):
    """The heads' outputs (B, T, nh * dh), before the output projection, of a (B, T, d) with q, k, v
    = p[0:6] (weights and biases); is_causal: each query attends to its own and earlier tokens."""
    n_heads = shapes[0][0] // head_dim

    def split_heads(x):                                   # (B, T, nh, dh) -> (B * nh, T, dh)
        return F.reshape(F.transpose(x, axes=(0, 2, 1, 3)), shape=(-3, -2))
    q, k, v = (split_heads(x) for x in qkv(a, p, F, shapes, head_dim))
    scores = F.batch_dot(q, k, transpose_b=True)                                     # (B*nh, T, T)
    weights = F.softmax(causal(scores, F) if is_causal else scores, axis=-1)
    o = F.batch_dot(weights, v)                                                  # (B*nh, T, dh)
    return F.reshape(F.transpose(F.reshape(o, shape=(-4, -1, n_heads, -2)), axes=(0, 2, 1, 3)),
                     shape=(0, 0, -3))                                           # (B, T, nh*dh)


def mlp_output(h, p, F, shapes):
    """MLP(LN(h)); p: ln2 g, b, w1, b1, w2, b2."""
    m = relu(fc(layer_norm(h, p[0], p[1], F, shapes[0][0]), p[2], p[3], F, shapes[2]), F)   # (B, T, hidden)
    return fc(m, p[4], p[5], F, shapes[4])


def mlp(h, p, F, shapes, site, start=0):
    """h + MLP(LN(h)), dropout `site` on the MLP's output (tokens from `start`); p: ln2 g, b, w1, b1,
    w2, b2."""
    return h + dropout(mlp_output(h, p, F, shapes), site, F, start)


def make_block(head_dim, site, causal=False):
    def block(h, p, F=nd, shapes=None):
        """h + attention(LN(h)), then h + MLP(LN(h)), dropout sites `site` and `site` + 1 on the
        two outputs; p: ln1 g, b, q, k, v, o (w, b each), ln2 g, b, MLP w1, b1, w2, b2."""
        shapes = shapes or [x.shape for x in p]
        a = attention(layer_norm(h, p[0], p[1], F, shapes[0][0]), p[2:10], F, shapes[2:10], head_dim, causal)
        return mlp(h + dropout(a, site, F), p[10:], F, shapes[10:], site + 1)
    return block


def make_sequence_block(head_dim, site):
    def sequence_block(hs, own, seq, F=nd):
        """The block on a context-parallel group, context j holding its block of tokens hs[j]
        (B, T_j, d): queries, keys and values of its own tokens, seq.attend over the whole sequence
        (ring or Ulysses), the rest token by token."""
        shapes = [[x.shape for x in p] for p in own]
        q, k, v = zip(*[qkv(layer_norm(h, p[0], p[1], F), p[2:8], F, s[2:8], head_dim)
                        for h, p, s in zip(hs, own, shapes)])
        o = [F.reshape(x, shape=(0, 0, -3)) for x in seq.attend(list(q), list(k), list(v))]   # (B, T_j, d)
        hs = [h + dropout(fc(oj, p[8], p[9], F), site, F, a) for h, oj, p, a in zip(hs, o, own, seq.bounds)]
        return [mlp(h, p[10:], F, s[10:], site + 1, a) for h, p, s, a in zip(hs, own, shapes, seq.bounds)]
    return sequence_block


def row_parallel(hs, ws, join, F=nd):
    """g of each context's partial product h W^T (W split by input columns, no bias): the sum."""
    return join.g([F.FullyConnected(h, w, no_bias=True, num_hidden=w.shape[0], flatten=False)
                   for h, w in zip(hs, ws)])


def make_split_block(head_dim, site, causal=False):
    def split_block(hs, shards, join, F=nd):
        """The block on a tensor group (Megatron): LN whole, f, this context's heads (q, k, v rows),
        its slice of the output projection's columns, g, + bo; LN, f, its MLP hidden units, its
        columns of w2, g, + b2. shards[j]: context j's pieces, in the block's parameter order."""
        shapes = [[x.shape for x in p] for p in shards]
        a = join.f([layer_norm(h, p[0], p[1], F) for h, p in zip(hs, join.leads(shards))])   # a piece each
        heads = [attend(aj, p[2:8], F, s[2:8], head_dim, causal) for aj, p, s in zip(a, shards, shapes)]
        starts = join.starts(len(hs))
        return split_mlp(split_output(hs, heads, shards, join, F, site, starts), shards, join, F, site + 1, starts)
    return split_block


def split_output(hs, heads, shards, join, F, site, starts):
    """h + the attention output projection of each piece's heads (B, T, nh/Q * dh): row-parallel,
    summed by g, + bo, dropout `site` (context j's tokens from starts[j])."""
    o = row_parallel(heads, [p[8] for p in shards], join, F)                   # (B, T, d) summed
    return [h + dropout_at(add_bias(oj, p[9], F), site, F, a)
            for h, oj, p, a in zip(hs, o, join.leads(shards), starts)]


def split_mlp(hs, shards, join, F, site, starts):
    """h + MLP(LN(h)) on a tensor group: LN whole, f, this context's hidden units, its columns of w2,
    g, + b2, dropout `site` (shards: the block's pieces, in its parameter order)."""
    lead = join.leads(shards)                                                  # each context's
    m = join.f([layer_norm(h, p[10], p[11], F) for h, p in zip(hs, lead)])     # a piece each
    m = [relu(fc(mj, p[12], p[13], F), F) for mj, p in zip(m, shards)]         # (B, T, hidden/Q)
    m = row_parallel(m, [p[14] for p in shards], join, F)
    return [h + dropout_at(add_bias(mj, p[15], F), site, F, a) for h, mj, p, a in zip(hs, m, lead, starts)]


def at(chunks, offset):
    """Where a tensor rank's tokens are (models.dropout.dropout_at): `offset` tokens into its row's
    one chunk, or (offset 0) the row's chunks themselves."""
    if len(chunks) == 1:
        return chunks[0][0] + offset
    if offset:
        raise ValueError("a row of several chunks (the balanced causal cut) is not cut again over its tensor ranks")
    return chunks


def make_grid_block(head_dim, site):
    def grid_block(hs, shards, join, seq, F=nd):
        """The block on a context x tensor grid: hs[c][t] is block c of the tokens on tensor rank t,
        shards[c] its pieces (join.k a context). Each row c is a tensor group (f and g as
        split_block, join.for_row(c)'s); each column of pieces a context-parallel group whose blocks'
        queries, keys and values of the piece's heads meet in seq.attend (ring or Ulysses)."""
        joins = [join.for_row(c) for c in range(len(hs))]
        a = [jc.f([layer_norm(h, p[0], p[1], F) for h, p in zip(row, jc.leads(prow))])
             for row, prow, jc in zip(hs, shards, joins)]                        # a[c][piece]
        q, k, v = ([[None] * len(a[0]) for _ in hs] for _ in range(3))
        for c, (arow, prow) in enumerate(zip(a, shards)):
            for t, (aj, p) in enumerate(zip(arow, prow)):
                q[c][t], k[c][t], v[c][t] = qkv(aj, p[2:8], F, [x.shape for x in p[2:8]], head_dim)
        heads = [[None] * len(a[0]) for _ in hs]
        for t in range(len(a[0])):
            outs = seq.attend([q[c][t] for c in range(len(hs))], [k[c][t] for c in range(len(hs))],
                              [v[c][t] for c in range(len(hs))])
            for c, o in enumerate(outs):
                heads[c][t] = F.reshape(o, shape=(0, 0, -3))                  # (B, T_c, nh/Q * dh)
        out = []
        for row, hrow, prow, chunks, jc in zip(hs, heads, shards, seq.chunks, joins):
            starts = [at(chunks, a) for a in jc.starts(len(row))]
            out.append(split_mlp(split_output(row, hrow, prow, jc, F, site, starts), prow, jc, F, site + 1, starts))
        return out
    return grid_block


class Transformer(Model):
    """A pre-norm vision transformer of `layers` blocks, width `d_model`, `heads` heads, MLP of
    `mlp_ratio` x d_model hidden units, row tokens (patch 0) or P x P patches."""
    name = "transformer"

    def __init__(self, layers=None, d_model=None, heads=None, mlp_ratio=None, patch=None, room=None):
        cfg = {k: DEFAULTS[k] if v is None else v for k, v in
               dict(layers=layers, d_model=d_model, heads=heads, mlp_ratio=mlp_ratio, patch=patch).items()}
        self.config = cfg
        L, d, H, r, P = cfg["layers"], cfg["d_model"], cfg["heads"], cfg["mlp_ratio"], cfg["patch"]
        if min(L, d, H, r) < 1 or d % H:
            raise ValueError(f"a transformer needs layers, d_model, heads >= 1 and heads dividing d_model "
                             f"(got {L}, {d}, {H})")
        if P and IMAGE[1] % P:
            raise ValueError(f"--patch {P} does not divide the image's {IMAGE[1]} rows")
        T, size = (IMAGE[1], IMAGE[2]) if not P else ((IMAGE[1] // P) ** 2, P * P)
        self.tokens, hidden, dh = T, r * d, d // H
        ends = (self.embed_layer(T, size, d, P), self.block_layer(0, T, d, hidden, dh), self.head_layer(T, d))
        if room is not None:                    # before the other blocks are made (a million take minutes)
            n = [sum(p.size for p in layer.params) for layer in ends]
            room.check(n[0] + L * n[1] + n[2], ends[0].inputs + ends[0].acts + L * ends[1].acts + ends[2].acts)
        self.layers = ends[:2] + tuple(self.block_layer(l, T, d, hidden, dh) for l in range(1, L)) + ends[2:]

    def dropout_sites(self):
        """The embedding's output and each block's attention and MLP outputs."""
        return 1 + 2 * self.config["layers"]

    def tensor_refusal(self, T):
        """Heads and MLP units must divide by T: a context holds whole heads."""
        if self.config["heads"] % T:
            return f"{T} does not divide the {self.name}'s {self.config['heads']} heads"
        return super().tensor_refusal(T)

    def sequence_refusal(self, C, attention):
        """Every context needs a token; Ulysses gives each context whole heads."""
        if C > self.tokens:
            return f"{C} contexts cannot each take a block of the transformer's {self.tokens} tokens"
        if attention == "ulysses" and self.config["heads"] % C:
            return f"Ulysses needs cp={C} to divide the transformer's {self.config['heads']} heads"
        return super().sequence_refusal(C, attention)

    def grid_refusal(self, C, T, attention):
        """On a C x T grid, Ulysses cuts each tensor rank's H/T heads over the C contexts."""
        if attention == "ulysses" and T and self.config["heads"] % T == 0 and (self.config["heads"] // T) % C:
            return f"Ulysses needs cp={C} to divide the {self.config['heads'] // T} heads of each of the tp={T} ranks"
        return super().grid_refusal(C, T, attention)

    @staticmethod
    def embed_layer(T, size, d, patch):
        def embed(X, p, F=nd, shapes=None):
            h = fc(tokens(X, patch, F), p[0], p[1], F, shapes[0] if shapes else None)   # (B, T, d)
            return dropout(add_positions(h, p[2], X, T * d, F), 0, F)

        def sequence_embed(Xs, own, seq, F=nd):
            """Context j embeds its block of tokens, at their positions."""
            out = []
            for X, p, a, b in zip(Xs, own, seq.bounds, seq.bounds[1:]):
                h = fc(F.slice_axis(tokens(X, patch, F), axis=1, begin=a, end=b), p[0], p[1], F)
                pos = F.slice_axis(p[2], axis=0, begin=a, end=b)
                out.append(dropout(add_positions(h, pos, X, (b - a) * d, F), 0, F, a))
            return out
        params = (Param("embed_w", (d, size), "lecun", size, split=None), Param("embed_b", (d,)),
                  Param("pos", (T, d), "normal", std=0.02))
        return Layer("embed", params, embed, 2 * T * size * d, T * size, 2 * T * d, "embed",
                     sequence_forward=sequence_embed)

    @staticmethod
    def block_layer(l, T, d, hidden, dh, causal=False):
        """Block l; causal: each token attends to itself and the tokens before it (the GPT's), and
        the layer has no context-parallel form yet."""
        def P(name, shape, init="zeros", fan=0, split=None):
            return Param(f"block{l}_{name}", shape, init, fan, split=split)
        params = (P("ln1_g", (d,), "ones"), P("ln1_b", (d,)),
                  P("wq", (d, d), "lecun", d, 0), P("bq", (d,), split=0),
                  P("wk", (d, d), "lecun", d, 0), P("bk", (d,), split=0),
                  P("wv", (d, d), "lecun", d, 0), P("bv", (d,), split=0),
                  P("wo", (d, d), "lecun", d, 1), P("bo", (d,)),
                  P("ln2_g", (d,), "ones"), P("ln2_b", (d,)),
                  P("w1", (hidden, d), "he", d, 0), P("b1", (hidden,), split=0),
                  P("w2", (d, hidden), "lecun", hidden, 1), P("b2", (d,)))
        flops = 2 * T * (4 * d * d + 2 * d * hidden) + 2 * 2 * T * T * d
        acts = T * (11 * d + 3 * hidden) + 2 * (d // dh) * T * T
        traffic = [(f"f: block{l} attention's input gradient", T * d, "backward"),
                   (f"g: block{l} attention's partial output", T * d, "forward"),
                   (f"f: block{l} MLP's input gradient", T * d, "backward"),
                   (f"g: block{l} MLP's partial output", T * d, "forward")]
        site = 2 * l + 1                                  # dropout sites: attention's and the MLP's outputs
        if causal:
            return Layer(f"block{l}", params, make_block(dh, site, True), flops, T * d, acts, "block",
                         {"head_dim": dh, "traffic": traffic}, make_split_block(dh, site, True))
        return Layer(f"block{l}", params, make_block(dh, site), flops, T * d, acts, "block",
                     {"head_dim": dh, "traffic": traffic}, make_split_block(dh, site),
                     sequence_forward=make_sequence_block(dh, site), grid_forward=make_grid_block(dh, site))

    @staticmethod
    def head_layer(T, d):
        def head(h, p, F=nd, shapes=None):
            pooled = token_sum(layer_norm(h, p[0], p[1], F, d), T, F) * (1 / T)  # (B, d)
            return fc(pooled, p[2], p[3], F, shapes[2] if shapes else None)      # (B, 10)

        def sequence_head(hs, own, seq, F=nd):
            """Each context's share of the mean over tokens, summed over the group (seq.sum): then
            every context holds the whole pooled vector and computes the same scores."""
            parts = [token_sum(layer_norm(h, p[0], p[1], F, d), h.shape[1], F) * (1 / T) for h, p in zip(hs, own)]
            return [fc(x, p[2], p[3], F) for x, p in zip(seq.sum(parts), own)]
        params = (Param("lnf_g", (d,), "ones"), Param("lnf_b", (d,)),
                  Param("head_w", (CLASSES, d), "lecun", d), Param("head_b", (CLASSES,)))
        return Layer("head", params, head, 2 * d * CLASSES, T * d, T * d * 2 + d + 3 * CLASSES + 1, "head",
                     sequence_forward=sequence_head)
