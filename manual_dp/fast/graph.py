"""The same `lenet` and `cross_entropy`, traced once into a symbolic graph and run as a cached op.

Imperatively every layer is a separate call from Python into MXNet (shape checks, allocation,
an engine push, an autograd node): about 30 calls forward and as many backward per device and
step. Built once with F=mx.sym, the network is one CachedOp call forward and one backward, with
memory planned once (static_alloc) and the backward ops pushed to the engine in bulk.
"""
import mxnet as mx
from mxnet import nd

from ..lesson import LENET_SHAPES, cross_entropy, lenet

FLAGS = [("static_alloc", "true"), ("static_shape", "true")]


def lenet_loss_symbol():
    """Outputs (sum of the batch's losses, number correct), of inputs X, y and the 8 parameters."""
    X, y = mx.sym.var("X"), mx.sym.var("y")
    params = [mx.sym.var(name) for name, _ in LENET_SHAPES]
    scores = lenet(X, params, F=mx.sym)                                   # (B, 10)
    loss_sum = mx.sym.sum(cross_entropy(scores, y, F=mx.sym))             # (1,)
    correct = mx.sym.sum(mx.sym.argmax(scores, axis=1) == mx.sym.cast(y, "float32"))
    return mx.sym.Group([mx.sym.make_loss(loss_sum), mx.sym.BlockGrad(correct)])


class LeNetGraph:
    """Call as graph(X, y, params) under autograd.record(): (loss sum, correct) on X's context;
    backward from the loss sum fills the parameters' gradients, as the imperative pass does."""

    def __init__(self):
        symbol = lenet_loss_symbol()
        self.names = symbol.list_inputs()
        self.op = nd.CachedOp(symbol, FLAGS)

    def __call__(self, X, y, params):
        inputs = dict(zip([name for name, _ in LENET_SHAPES], params), X=X, y=y)
        loss_sum, correct = self.op(*[inputs[name] for name in self.names])
        return loss_sum, correct
