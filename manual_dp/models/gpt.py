"""A causal language model in nanoGPT's shape, under the model contract: at every position of a
window of T tokens, the scores of the token that comes next.

    embed      (B, T) token ids -> (B, T, d): the token's row of the embedding table, plus a
               learned position (models/transformer.py's add_positions), dropout site 0
    block l    the vision transformer's pre-norm block (models/transformer.py) with causal
               self-attention: token t attends to tokens 0..t; dropout sites 2l + 1 and 2l + 2
    head       a final layer norm, then every token's d values to vocab scores: (B, T, vocab)

The loss of an example is the mean over its T positions of each next token's cross-entropy
(models/contract.py's `loss`), so every layout's division by the examples it summed gives the
mean over tokens, as nanoGPT's loss is.

Tensor parallelism splits each block as Megatron does (heads, MLP hidden units); the embedding and
head run whole on every context of a tensor group. The head has its own weights (GPT-2 ties them
to the embedding: a layer here owns its parameters, and a pipeline puts the two on different
stages).

Context parallelism: context j of a group holds its chunks of every window (seq.chunks: the
balanced cut, chunks j and 2C - 1 - j of 2C, fast/causal_attention.py), embeds them at their
positions, runs every token-wise part on them alone and meets the others in causal ring or Ulysses
attention (seq.attend). The head's scores of each context's chunks are put in their places among
zeros and summed over the group (seq.sum: an all-gather whose backward hands each context its own
rows' gradient back), so every context holds the whole window's scores, as the vision
transformer's pooled head leaves them, and the strategies take the loss as they do there.

Mixture of experts (`experts`, a models.moe.Experts): every block's MLP is E experts routed per
window (models/moe.py); the hidden state then carries one extra row, the examples' aux loss, and
the scores are (B, T + 1, vocab) (example_loss adds the last row's column 0). Tensor and context
parallelism are refused for it (the routing groups and experts are not split); expert parallelism
(strategies/expert/) runs each block's expert_forward, the experts sharded over a group.
"""
import dataclasses

from mxnet import nd

from ..config import GPT as DEFAULTS
from .contract import Layer, Param, fc
from .dropout import dropout, dropout_at
from .moe import EXPERT_PARAMS, make_expert_block, make_moe_block, moe_costs, moe_params, split_carry, with_carry
from .transformer import Transformer, add_positions, layer_norm, make_grid_block, mlp_output, qkv

MLP_RATIO = 4               # nanoGPT's: hidden units of a block's MLP per unit of d_model


def embed_layer(T, vocab, d):
    def embed(X, p, F=nd, shapes=None):
        h = F.Embedding(X, p[0], input_dim=vocab, output_dim=d)                     # (B, T, d)
        return dropout(add_positions(h, p[1], X, T * d, F), 0, F)

    def sequence_embed(Xs, own, seq, F=nd):
        """Context j embeds the tokens of its chunks, at their positions."""
        def piece(X, p, a, b):
            ids = F.slice_axis(X, axis=1, begin=a, end=b)
            h = F.Embedding(ids, p[0], input_dim=vocab, output_dim=d)
            return dropout(add_positions(h, F.slice_axis(p[1], axis=0, begin=a, end=b), ids, (b - a) * d, F), 0, F, a)
        return [F.concat(*[piece(X, p, a, b) for a, b in chunks], dim=1) if len(chunks) > 1 else piece(X, p, *chunks[0])
                for X, p, chunks in zip(Xs, own, seq.chunks)]
    params = (Param("wte", (vocab, d), "normal", std=0.02), Param("wpe", (T, d), "normal", std=0.02))
    return Layer("embed", params, embed, 2 * T * d, T, 2 * T * d, "embed", sequence_forward=sequence_embed)


def block_layer(l, T, d, H):
    """The vision transformer's block with causal attention, and its context-parallel form."""
    dh, site = d // H, 2 * l + 1

    def sequence_block(hs, own, seq, F=nd):
        """Queries, keys and values of each context's tokens, seq.attend (causal ring or Ulysses) over
        the whole window, the rest token by token, dropout's masks by each chunk's positions."""
        shapes = [[x.shape for x in p] for p in own]
        q, k, v = zip(*[qkv(layer_norm(h, p[0], p[1], F), p[2:8], F, s[2:8], dh) for h, p, s in zip(hs, own, shapes)])
        o = [F.reshape(x, shape=(0, 0, -3)) for x in seq.attend(list(q), list(k), list(v))]       # (B, T_j, d)
        hs = [h + dropout_at(fc(oj, p[8], p[9], F), site, F, c) for h, oj, p, c in zip(hs, o, own, seq.chunks)]
        return [h + dropout_at(mlp_output(h, p[10:], F, s[10:]), site + 1, F, c)
                for h, p, s, c in zip(hs, own, shapes, seq.chunks)]
    layer = Transformer.block_layer(l, T, d, MLP_RATIO * d, dh, causal=True)
    return dataclasses.replace(layer, sequence_forward=sequence_block, grid_forward=make_grid_block(dh, site))


def head_layer(T, d, vocab):
    def head(h, p, F=nd, shapes=None):
        return fc(layer_norm(h, p[0], p[1], F, d), p[2], p[3], F, shapes[2] if shapes else None)   # (B, T, vocab)

    def sequence_head(hs, own, seq, F=nd):
        """Each context's scores of its chunks in their places among zeros, summed over the group:
        every context then holds the scores of the whole window (B, T, vocab)."""
        cut = sorted(r for chunks in seq.chunks for r in chunks)
        placed = []
        for h, p, chunks in zip(hs, own, seq.chunks):
            s = head(h, p, F)                                                            # (B, T_j, vocab)
            mine, at = {}, 0
            for a, b in chunks:
                mine[a], at = F.slice_axis(s, axis=1, begin=at, end=at + b - a), at + b - a
            parts = [mine.get(a) if a in mine else nd.zeros((s.shape[0], b - a, vocab), ctx=s.context, dtype=s.dtype)
                     for a, b in cut]
            placed.append(F.concat(*parts, dim=1))
        return seq.sum(placed)
    params = (Param("lnf_g", (d,), "ones"), Param("lnf_b", (d,)),
              Param("head_w", (vocab, d), "normal", std=0.02), Param("head_b", (vocab,)))
    return Layer("head", params, head, 2 * T * d * vocab, T * d, T * (2 * d + 3 * vocab), "head",
                 sequence_forward=sequence_head)


def moe_layers(layers, T, d, H, V, cfg):
    """The GPT's layers with each block's MLP an MoE (models/moe.py), the aux loss's row carried from
    the embedding (zeros) through the blocks to the head, whose scores gain it as row T."""
    embed, *blocks, head = layers
    dh, hidden = d // H, MLP_RATIO * d

    def moe_embed(X, p, F=nd, shapes=None):
        return with_carry(embed.forward(X, p, F, shapes), F)                     # (B, T + 1, d)

    def moe_head(h, p, F=nd, shapes=None):
        x, carry = split_carry(h, T, F)
        scores = head.forward(x, p, F, shapes)                                   # (B, T, vocab)
        aux = F.slice_axis(carry, axis=2, begin=0, end=1)                        # (B, 1, 1)
        pad = F.zeros_like(F.slice_axis(F.slice_axis(scores, axis=1, begin=0, end=1), axis=2, begin=1, end=V))
        return F.concat(scores, F.concat(aux, pad, dim=2), dim=1)                # (B, T + 1, vocab)

    def moe_block(l, b):
        flops, acts = moe_costs(T, d, hidden, H, cfg)
        return dataclasses.replace(b, params=b.params[:12] + moe_params(l, d, hidden, cfg.experts),
                                   forward=make_moe_block(dh, 2 * l + 1, cfg, T), flops=flops, inputs=(T + 1) * d,
                                   acts=acts, extra={"head_dim": dh, "experts": cfg, "expert_params": EXPERT_PARAMS},
                                   split_forward=None, sequence_forward=None, grid_forward=None,
                                   expert_forward=make_expert_block(dh, 2 * l + 1, cfg, T))
    return ((dataclasses.replace(embed, forward=moe_embed, acts=embed.acts + d, sequence_forward=None),)
            + tuple(moe_block(l, b) for l, b in enumerate(blocks))
            + (dataclasses.replace(head, forward=moe_head, inputs=(T + 1) * d, sequence_forward=None),))


class GPT(Transformer):
    """`layers` causal blocks of width `d_model` and `heads` heads over windows of spec.shape[0]
    tokens of spec.vocab (a datasets.Spec of the task "next-token"). Its blocks are the vision
    transformer's, and so are its refusals of tensor and Ulysses layouts (heads a context) and its
    dropout sites."""
    name = "gpt"
    causal = True              # its attention: a context-parallel group cuts its windows in balanced chunks

    def __init__(self, layers, d_model, heads, spec, experts=None):
        if spec.task != "next-token":
            raise ValueError(f"predicts the next token of a text; the data holds {spec.describe()}: give --data "
                             f"fortunes, text:PATH or npz:PATH of token ids and next tokens")
        L, d, H = (DEFAULTS[k] if v is None else v for k, v in (("layers", layers), ("d_model", d_model),
                                                                 ("heads", heads)))
        if min(L, d, H) < 1 or d % H:
            raise ValueError(f"a GPT needs layers, d_model, heads >= 1 and heads dividing d_model (got {L}, {d}, {H})")
        T, V = spec.shape[0], spec.vocab
        self.spec, self.tokens = spec, T
        self.config = {"layers": L, "d_model": d, "heads": H, "seq_len": T, "vocab": V}
        self.layers = (embed_layer(T, V, d),) + tuple(block_layer(l, T, d, H) for l in range(L)) + (
            head_layer(T, d, V),)
        self.experts = experts if experts and experts.experts else None
        if self.experts:
            self.aux = True                     # its scores carry the aux loss's row (models/moe.py)
            self.config.update(experts=experts.experts, top_k=experts.top_k,
                               capacity_factor=experts.capacity_factor, aux_loss_coef=experts.aux_loss_coef)
            self.layers = moe_layers(self.layers, T, d, H, V, self.experts)

    def describe(self):
        """Model.describe, and the text of its tokens (a corpus's), so that a checkpoint can be
        sampled from (python -m manual_dp.sample)."""
        out = super().describe()
        if self.spec.text:
            out["tokens"] = {"text": self.spec.text, "names": "".join(self.spec.names)}
        return out

    def tensor_refusal(self, T):
        """The vision transformer's (heads a context); an MoE GPT's experts are not split."""
        if self.experts:
            return "--experts: tensor parallelism of the MoE block is not built (its experts are not split)"
        return super().tensor_refusal(T)

    def grid_refusal(self, C, T, attention):
        """The vision transformer's; an MoE GPT's as tensor_refusal."""
        return self.tensor_refusal(T) if self.experts else super().grid_refusal(C, T, attention)

    def sequence_refusal(self, C, attention):
        """Megatron-SP (attention None) cuts the tokens between split layers: a token a context at
        least; ring and Ulysses the balanced cut: two chunks a context, and Ulysses whole heads; an MoE
        GPT none (its routing group is the whole window)."""
        if self.experts:
            return "--experts: a window is the MoE routing group; cutting it over contexts is not built"
        if C > self.tokens or attention is not None and 2 * C > self.tokens:
            return (f"{C} contexts cannot each take {'two chunks' if attention else 'a block'} of the GPT's "
                    f"{self.tokens} tokens")
        if attention == "ulysses" and self.config["heads"] % C:
            return f"Ulysses needs cp={C} to divide the GPT's {self.config['heads']} heads"
        return None
