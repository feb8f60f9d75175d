"""A multilayer perceptron under the model contract: the image flattened, dense layers with ReLU,
then 10 class scores. Its layers are the lesson's `dense` (weights (in, out)), so ZeRO's hand-made
dense gradients and a pipeline's cuts apply to it as to LeNet's dense layers.

    dense1  (B, 1, 28, 28) -> (B, 256 W)     dense2  (B, 256 W) -> (B, 128 W)     out  (B, 128 W) -> (B, 10)
"""
from .contract import CLASSES, IMAGE, Layer, Model, Param
from .lenet import dense_layer, dense_relu_layer

HIDDEN = (256, 128)


class MLP(Model):
    """Dense layers of HIDDEN x `width` units with ReLU, then the class scores."""
    name = "mlp"

    def __init__(self, width=1):
        self.config = {"width": width}
        sizes = [IMAGE[0] * IMAGE[1] * IMAGE[2]] + [h * width for h in HIDDEN] + [CLASSES]
        layers = []
        for i, (d_in, d_out) in enumerate(zip(sizes, sizes[1:])):
            last = i == len(sizes) - 2
            params = (Param(f"W{i + 1}", (d_in, d_out), "he", d_in, split=None if last else 1),
                      Param(f"b{i + 1}", (d_out,), split=None if last else 0))
            layers.append(Layer(f"dense{i + 1}", params, dense_layer if last else dense_relu_layer,
                                2 * d_in * d_out, d_in, 3 * d_out + (1 if last else 0), "dense", {"relu": not last}))
        self.layers = tuple(layers)
