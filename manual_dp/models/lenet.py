"""The lesson's LeNet under the model contract: four layers whose forward functions are the lesson's
own (conv_block, dense, relu), so every strategy computes exactly what it computed when it read
lesson.LENET_SHAPES: the same table (width W multiplies 20, 50, 128), the same initial values, the
same ops and the same pipeline cuts.

    layer 0 conv1   images (B, 1, 28, 28) -> (B, 20, 13, 13)   W1, b1   tensor split: output channels
    layer 1 conv2   (B, 20, 13, 13)       -> (B, 50, 4, 4)     W2, b2   tensor split: input channels
    layer 2 dense1  (B, 50, 4, 4)         -> (B, 128)          W3, b3   tensor split: output units
    layer 3 dense2  (B, 128)              -> (B, 10)           W4, b4   tensor split: input units
"""
import numpy as np

from ..lesson import conv_block, dense, lenet_shapes, relu
from .contract import IMAGE, Layer, Model, Param, add_bias, add_channel_bias

CUTS = {1: ((0, 1, 2, 3),),
        2: ((0, 1), (2, 3)),                   # convolutions | dense layers (the lesson's cut)
        3: ((0,), (1,), (2, 3)),               # conv1 | conv2 | dense
        4: ((0,), (1,), (2,), (3,))}           # one layer a stage


def fan_in(shape):
    """The lesson's fan-in: rows of a dense (in, out) weight, in_c * k * k of a convolution's."""
    return shape[0] if len(shape) <= 2 else int(shape[1] * shape[2] * shape[3])


def conv_layer(h, params, F, shapes):
    return conv_block(h, params[0], params[1], F, shapes[0])


def dense_relu_layer(h, params, F, shapes):
    return relu(dense(h, params[0], params[1], F, shapes[0]), F)


def dense_layer(h, params, F, shapes):
    return dense(h, params[0], params[1], F, shapes[0])


class LeNet(Model):
    """LeNet of `width` (lesson.lenet_shapes)."""
    name = "lenet"

    def __init__(self, width=1):
        self.width, self.config = width, {"width": width}
        table = lenet_shapes(width)
        splits = [0, 0, 1, None, 1, 0, 0, None]          # which axis Megatron's split cuts
        params = [Param(name, shape, "zeros" if name.startswith("b") else "he", fan_in(shape), split=s)
                  for (name, shape), s in zip(table, splits)]
        c, h = IMAGE[1], IMAGE[2]
        sizes = []
        for W in (table[0][1], table[2][1]):             # convolution, ReLU, 2x2 pooling
            out_c, in_c, k, _ = W
            c, h = c - k + 1, h - k + 1
            sizes.append((out_c * c * h * in_c * k * k, 2 * out_c * c * h + out_c * (c // 2) * (h // 2),
                          out_c * (c // 2) * (h // 2)))       # (MACs, kept, output) per example
            c, h = c // 2, h // 2
        (d_in, hidden), (_, classes) = table[4][1], table[6][1]
        self.layers = (
            Layer("conv1", tuple(params[0:2]), conv_layer, 2 * sizes[0][0], int(np.prod(IMAGE)),
                  sizes[0][1], "conv"),
            Layer("conv2", tuple(params[2:4]), conv_layer, 2 * sizes[1][0], sizes[0][2], sizes[1][1], "conv"),
            Layer("dense1", tuple(params[4:6]), dense_relu_layer, 2 * d_in * hidden, d_in, 3 * hidden,
                  "dense", {"relu": True}),
            Layer("dense2", tuple(params[6:8]), dense_layer, 2 * hidden * classes, hidden, 3 * classes + 1,
                  "dense", {"relu": False}),
        )

    def graph_params(self, params, shapes, pad):
        """The convolutions' channels zero-padded to multiples of `pad` (fast.graph explains why)."""
        return zero_padded(params, pad, shapes)

    def split_forward(self, Xs, shards, join, F=None):
        """Megatron's split of LeNet as two column/row pairs (strategies/tensor/tensor.py draws it): conv1
        by output channel, conv2 by input channel then g, + b2, ReLU, pool, f; dense1 by unit,
        dense2 by input then g, + b4. shards[j] = context j's [W1, b1, W2, b2, W3, b3, W4, b4]."""
        from mxnet import nd
        F, lead = F or nd, join.leads(shards)                   # shards: one per piece; lead: per context
        h = [conv_block(X, p[0], p[1], F) for X, p in zip(join.spread(Xs), shards)]   # (B, c1/Q, 13, 13)
        h = join.g([F.Convolution(hj, p[2], no_bias=True, kernel=p[2].shape[2:], num_filter=p[2].shape[0])
                    for hj, p in zip(h, shards)])                                   # (B, c2, 9, 9) summed
        h = [F.Pooling(relu(add_channel_bias(hj, p[3], F), F), pool_type="avg",
                       kernel=(2, 2), stride=(2, 2)) for hj, p in zip(h, lead)]     # (B, c2, 4, 4)
        h = join.f(h)
        h = [relu(dense(hj, p[4], p[5], F), F) for hj, p in zip(h, shards)]        # (B, hidden/Q)
        s = join.g([F.FullyConnected(hj, F.transpose(p[6]), no_bias=True, num_hidden=p[6].shape[1])
                    for hj, p in zip(h, shards)])                                   # (B, 10) summed
        return [add_bias(sj, p[7], F) for sj, p in zip(s, lead)]

    def tensor_traffic(self):
        """g on conv2's unpooled partial output, f on dense1's input gradient (conv2's pooled
        output), g on the scores: per example and step."""
        c2, _, k, _ = self.shapes()[2][1]
        side = (IMAGE[1] - self.shapes()[0][1][2] + 1) // 2 - k + 1                     # conv2's output: 9
        return [("g: conv2's partial output", c2 * side * side, "forward"),
                ("f: dense1's input gradient", self.layers[2].inputs, "backward"),
                ("g: the scores", self.shapes()[6][1][1], "forward")]

    def cuts(self, n_stages):
        """The lesson's cuts: 2 stages are the convolutions | the dense layers."""
        if n_stages not in CUTS:
            raise ValueError(f"LeNet's 4 layers cannot be cut into {n_stages} stages")
        return CUTS[n_stages]


def round_up(n, block):
    return -(-n // block) * block


def zero_padded(params, block, shapes):
    """(LeNet's parameter symbols, of `shapes`, with the convolutions' channels zero-padded to
    multiples of `block`, their shapes): extra filters of zeros, whose outputs are 0 after ReLU and
    pooling and meet zero rows of W3 (fast.graph explains why this is faster)."""
    import mxnet as mx
    F = mx.sym
    shapes = [list(shape) for shape in shapes]
    (c1, _, k1, _), (c2, _, k2, _), (d_in, hidden) = shapes[0], shapes[2], shapes[4]
    p1, p2, per_channel = round_up(c1, block), round_up(c2, block), d_in // c2
    W1, b1, W2, b2, W3, b3, W4, b4 = params

    def pad(s, axis, shape):                          # s followed by zeros of `shape` along axis
        return F.concat(s, F.zeros(tuple(shape)), dim=axis) if shape[axis] else s
    W1, b1 = pad(W1, 0, [p1 - c1, 1, k1, k1]), pad(b1, 0, [p1 - c1])          # (p1, 1, 3, 3)
    W2 = pad(pad(W2, 1, [c2, p1 - c1, k2, k2]), 0, [p2 - c2, p1, k2, k2])     # (p2, p1, 5, 5)
    b2 = pad(b2, 0, [p2 - c2])
    W3 = pad(W3, 0, [(p2 - c2) * per_channel, hidden])                          # (p2 * 16, 128)
    shapes[0], shapes[1], shapes[2], shapes[3] = (p1, 1, k1, k1), (p1,), (p2, p1, k2, k2), (p2,)
    shapes[4] = (p2 * per_channel, hidden)
    return [W1, b1, W2, b2, W3, b3, W4, b4], [tuple(s) for s in shapes]
