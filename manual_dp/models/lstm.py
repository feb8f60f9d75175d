"""Seed 000's text classifier under the model contract: token ids embedded, an LSTM read to its last
step, that state to the class scores. Three layers, which a pipeline cuts between:

    embed  (B, T) token ids -> (B, T, D)          the embedding table (vocab, D)
    lstm   (B, T, D) -> (B, D)                    L LSTM layers of D units, MXNet's fused RNN
                                                  operator (oneDNN's kernel on CPU, cuDNN's on a GPU),
                                                  its last step's hidden state
    head   (B, D) -> (B, classes)                 class scores

Gluon's rnn.LSTM runs the same operator on the same parameters, packed in the same order (every
layer's i2h and h2h weights, then every layer's i2h and h2h biases; the gates i, f, g, o), which
the tests use as the reference. An LSTM's recurrence needs every hidden unit of the last step at
the next, and every step's state the one before: tensor and context parallelism have nothing to
split in it, and refuse it in one line.
"""
from mxnet import nd

from .contract import Layer, Model, Param, fc

GATES = 4                   # input, forget, cell, output


def embed_layer(vocab, d):
    def forward(h, params, F=nd, shapes=None):
        return F.Embedding(h, params[0], input_dim=vocab, output_dim=d)            # (B, T, D)
    return forward


def lstm_layer(n_layers, d):
    def forward(h, params, F=nd, shapes=None):
        x = F.transpose(h, axes=(1, 0, 2))                                          # (T, B, D)
        weights = [params[4 * l + i] for l in range(n_layers) for i in (0, 1)]
        biases = [params[4 * l + i] for l in range(n_layers) for i in (2, 3)]
        packed = F.concat(*[F.reshape(p, shape=(-1,)) for p in weights + biases], dim=0)
        zeros = F.zeros_like(F.slice_axis(x, axis=0, begin=0, end=1))               # (1, B, D)
        state = F.concat(*[zeros] * n_layers, dim=0) if n_layers > 1 else zeros     # (L, B, D)
        out = F.RNN(x, packed, state, state, state_size=d, num_layers=n_layers, mode="lstm")   # (T, B, D)
        return F.reshape(F.slice_axis(out, axis=0, begin=-1, end=None), shape=(-1, d))          # (B, D)
    return forward


def head_layer(classes):
    def forward(h, params, F=nd, shapes=None):
        return fc(h, params[0], params[1], F, (classes,) + tuple((shapes or [p.shape for p in params])[0][1:]))
    return forward


class LSTM(Model):
    """An embedding of `spec.vocab` tokens, `layers` LSTM layers of `d_model` units, a dense head."""
    name = "lstm"

    def __init__(self, layers, d_model, spec):
        if not spec.tokens or len(spec.shape) != 1:
            raise ValueError(f"reads sequences of token ids; the data holds {spec.describe()}: give --data "
                             f"fortunes or npz:PATH of integer sequences")
        L, D, T, V, C = layers, d_model, spec.shape[0], spec.vocab, spec.classes
        self.spec, self.config = spec, {"layers": L, "d_model": D, "seq_len": T, "vocab": V, "classes": C}
        cell = []
        for l in range(L):
            cell += [Param(f"lstm{l}_i2h_weight", (GATES * D, D), "lecun", D),
                     Param(f"lstm{l}_h2h_weight", (GATES * D, D), "lecun", D),
                     Param(f"lstm{l}_i2h_bias", (GATES * D,)), Param(f"lstm{l}_h2h_bias", (GATES * D,))]
        step = 2 * GATES * D * 2 * D + 10 * D                  # the gates' products, then their elementwise work
        self.layers = (
            Layer("embed", (Param("embed_weight", (V, D), "normal", std=0.1),), embed_layer(V, D), 0, T, T * D),
            Layer("lstm", tuple(cell), lstm_layer(L, D), L * T * step, T * D, L * T * 7 * D + D),
            Layer("head", (Param("head_weight", (C, D), "lecun", D), Param("head_bias", (C,))), head_layer(C),
                  2 * D * C, D, C))

    def tensor_refusal(self, T):
        return ("lstm: its recurrence needs every hidden unit of a step at the next, so it has no layer "
                "tensor parallelism splits")

    def sequence_refusal(self, C, attention):
        return "lstm: each step's state needs the one before, so its sequence cannot be cut over contexts"
