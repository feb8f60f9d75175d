"""The same `lenet` and `cross_entropy`, traced once into a symbolic graph and run as a cached op.

Imperatively every layer is a separate call from Python into MXNet (shape checks, allocation,
an engine push, an autograd node): about 30 calls forward and as many backward per device and
step. Built once with F=mx.sym, the network is one CachedOp call forward and one backward, with
memory planned once (static_alloc) and the backward ops pushed to the engine in bulk.

conv_pad: MXNet 1.9's oneDNN convolution takes only memory layouts of exactly the array's size,
so with 20 and 50 channels, not multiples of the CPU's vector block (8 floats with AVX2, 16 with
AVX-512), it cannot use its blocked (nChw8c) kernels: every convolution falls back to im2col and
GEMM, and the average pooling after it to a plain loop. Inside the graph the channels can be
zero-padded to a multiple of `conv_pad`: extra filters of zeros, whose outputs are 0 after ReLU and
pooling and meet zero rows of W3. The function and the gradients of the real parameters are the
same (concat's backward hands each its slice); only the order of float additions changes. Which
multiple is fastest depends on the CPU, so manual_dp.fast.autotune measures it.

bulk: MXNet runs a cached graph's backward in segments of up to 15 operators, each one engine
operation, whose outputs (the gradients among them) are released only when the whole segment is
done: fewer engine pushes, but no gradient is ready before its segment ends. bulk=False runs
every backward operator on its own, so that gradient buckets can be all-reduced while the rest
of the backward runs (manual_dp.fast.buckets).
"""
import mxnet as mx
from mxnet import nd

from ..lesson import LENET_SHAPES, cross_entropy, lenet

FLAGS = [("static_alloc", "true"), ("static_shape", "true")]
UNBULKED = [("backward_bulk_size", "0")]


def round_up(n, block):
    return -(-n // block) * block


def zero_padded(params, block, shapes):
    """(LeNet's parameter symbols, of `shapes`, with the convolutions' channels zero-padded to
    multiples of `block`, their shapes)."""
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


def lenet_loss_symbol(conv_pad=1, shapes=None):
    """Outputs (sum of the batch's losses, number correct), of inputs X, y and the 8 parameters
    of `shapes` (default: the lesson's LeNet)."""
    X, y = mx.sym.var("X"), mx.sym.var("y")
    params = [mx.sym.var(name) for name, _ in LENET_SHAPES]
    params, shapes = zero_padded(params, conv_pad, shapes or [shape for _, shape in LENET_SHAPES])
    scores = lenet(X, params, F=mx.sym, shapes=shapes)                    # (B, 10)
    loss_sum = mx.sym.sum(cross_entropy(scores, y, F=mx.sym))             # (1,)
    correct = mx.sym.sum(mx.sym.argmax(scores, axis=1) == mx.sym.cast(y, "float32"))
    return mx.sym.Group([mx.sym.make_loss(loss_sum), mx.sym.BlockGrad(correct)])


class LeNetGraph:
    """Call as graph(X, y, params) under autograd.record(): (loss sum, correct) on X's context;
    backward from the loss sum fills the parameters' gradients, as the imperative pass does.
    shapes: the parameters' shapes (default: the lesson's LeNet; see lesson.lenet_shapes)."""

    def __init__(self, conv_pad=1, shapes=None, bulk=True):
        symbol = lenet_loss_symbol(conv_pad, shapes)
        self.conv_pad, self.bulk = conv_pad, bulk
        self.names = symbol.list_inputs()
        self.op = nd.CachedOp(symbol, FLAGS if bulk else FLAGS + UNBULKED)

    def __call__(self, X, y, params):
        inputs = dict(zip([name for name, _ in LENET_SHAPES], params), X=X, y=y)
        loss_sum, correct = self.op(*[inputs[name] for name in self.names])
        return loss_sum, correct
