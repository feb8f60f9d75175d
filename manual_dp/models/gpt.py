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
stages). Context parallelism needs attention that skips the blocks above the diagonal, which the
causal block does not have yet: it refuses in one line.
"""
from mxnet import nd

from ..config import GPT as DEFAULTS
from .contract import Layer, Model, Param, fc
from .dropout import dropout
from .transformer import Transformer, add_positions, layer_norm

MLP_RATIO = 4               # nanoGPT's: hidden units of a block's MLP per unit of d_model


def embed_layer(T, vocab, d):
    def embed(X, p, F=nd, shapes=None):
        h = F.Embedding(X, p[0], input_dim=vocab, output_dim=d)                     # (B, T, d)
        return dropout(add_positions(h, p[1], X, T * d, F), 0, F)
    params = (Param("wte", (vocab, d), "normal", std=0.02), Param("wpe", (T, d), "normal", std=0.02))
    return Layer("embed", params, embed, 2 * T * d, T, 2 * T * d, "embed")


def head_layer(T, d, vocab):
    def head(h, p, F=nd, shapes=None):
        return fc(layer_norm(h, p[0], p[1], F, d), p[2], p[3], F, shapes[2] if shapes else None)   # (B, T, vocab)
    params = (Param("lnf_g", (d,), "ones"), Param("lnf_b", (d,)),
              Param("head_w", (vocab, d), "normal", std=0.02), Param("head_b", (vocab,)))
    return Layer("head", params, head, 2 * T * d * vocab, T * d, T * (2 * d + 3 * vocab), "head")


class GPT(Model):
    """`layers` causal blocks of width `d_model` and `heads` heads over windows of spec.shape[0]
    tokens of spec.vocab (a datasets.Spec of the task "next-token")."""
    name = "gpt"

    def __init__(self, layers, d_model, heads, spec):
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
        self.layers = (embed_layer(T, V, d),) + tuple(
            Transformer.block_layer(l, T, d, MLP_RATIO * d, d // H, causal=True) for l in range(L)) + (
            head_layer(T, d, V),)

    def describe(self):
        """Model.describe, and the text of its tokens (a corpus's), so that a checkpoint can be
        sampled from (python -m manual_dp.sample)."""
        out = super().describe()
        if self.spec.text:
            out["tokens"] = {"text": self.spec.text, "names": "".join(self.spec.names)}
        return out

    def dropout_sites(self):
        """The embedding's output and each block's attention and MLP outputs."""
        return 1 + 2 * self.config["layers"]

    def tensor_refusal(self, T):
        """Heads and MLP units must divide by T: a context holds whole heads."""
        if self.config["heads"] % T:
            return f"{T} does not divide the GPT's {self.config['heads']} heads"
        return super().tensor_refusal(T)

    def sequence_refusal(self, C, attention):
        """Megatron-SP (attention None) cuts the tokens between split layers: a token a context at
        least. Ring and Ulysses attention are not causal yet."""
        if C > self.tokens:
            return f"{C} contexts cannot each take a block of the GPT's {self.tokens} tokens"
        if attention is None:
            return None
        return ("gpt: context parallelism needs causal ring and Ulysses attention, which the package does not "
                "have yet: train the GPT with --mode sync, zero, pipeline, tensor or mesh dp x pp x tp")
