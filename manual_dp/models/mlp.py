"""A multilayer perceptron under the model contract: the input flattened (an image, or any values
the data holds), dense layers with ReLU, then the class scores. Its layers are the lesson's `dense` (weights (in, out)), so ZeRO's hand-made
dense gradients and a pipeline's cuts apply to it as to LeNet's dense layers.

    dense1  (B, 1, 28, 28) -> (B, 256 W)     dense2  (B, 256 W) -> (B, 128 W)     out  (B, 128 W) -> (B, 10)
"""
import numpy as np
from mxnet import nd

from ..lesson import dense, relu
from .contract import Layer, Model, Param, add_bias, pair_roles, pair_traffic, split_pairs
from .lenet import dense_layer, dense_relu_layer

HIDDEN = (256, 128)


class MLP(Model):
    """Dense layers of HIDDEN x `width` units with ReLU, then the class scores."""
    name = "mlp"

    def __init__(self, width=1, spec=None):
        from ..datasets import IMAGES
        spec = spec or IMAGES
        if spec.tokens:
            raise ValueError(f"reads values; the data holds {spec.describe()}: --model lstm reads token ids")
        self.spec = spec
        self.config = {"width": width} if spec == IMAGES else {"width": width, "inputs": list(spec.shape),
                                                               "classes": spec.classes}
        sizes = [int(np.prod(spec.shape))] + [h * width for h in HIDDEN] + [spec.classes]
        self.roles = pair_roles(len(sizes) - 1, lambda i: i < len(sizes) - 2)   # dense1 | dense2, out whole
        axes = {"column": (1, 0), "row": (0, None)}                             # W (in, out), b
        layers = []
        for i, (d_in, d_out) in enumerate(zip(sizes, sizes[1:])):
            last = i == len(sizes) - 2
            w_axis, b_axis = axes.get(self.roles.get(i), (None, None))
            params = (Param(f"W{i + 1}", (d_in, d_out), "he", d_in, split=w_axis),
                      Param(f"b{i + 1}", (d_out,), split=b_axis))
            layers.append(Layer(f"dense{i + 1}", params, dense_layer if last else dense_relu_layer,
                                2 * d_in * d_out, d_in, 3 * d_out + (1 if last else 0), "dense", {"relu": not last}))
        self.layers = tuple(layers)

    def split_forward(self, Xs, shards, join, F=nd):
        """Megatron's dense pairs: dense1 split by output units, dense2 by input units (g, + b2,
        ReLU); the output layer whole."""
        return split_pairs(Xs, shards, join, self.layers, self.slices(), self.roles,
                           lambda l, h, p, F: relu(dense(h, p[0], p[1], F), F), row, F)

    def tensor_traffic(self):
        return pair_traffic(self.layers, self.roles, [layer.acts // 3 for layer in self.layers])


def row(l, h, p, partial, F=nd):
    """The row-parallel dense layer: its partial product h W (W's rows split, no bias), or after the
    sum, + b and ReLU."""
    if partial:
        return F.FullyConnected(h, F.transpose(p[0]), no_bias=True, num_hidden=p[0].shape[1])
    return relu(add_bias(h, p[1], F), F)
