"""How much arithmetic LeNet needs, and how much this machine can do: the distance to the peak.

Counted are the multiply-adds of the convolutions and dense layers (2 FLOPs each), from the layer
shapes; ReLU, pooling, the loss and the optimiser are a few per element and left out. Backward
costs two such products per layer (the gradient of the weights, and of the layer's input), except
for the first layer, whose input (the images) needs no gradient.
"""
import time

import numpy as np

from .lesson import LENET_SHAPES

IMAGE = (1, 28, 28)


def layer_macs(image=IMAGE, shapes=None):
    """Multiply-adds per image of each weighted layer, in order: conv1, conv2, dense1, dense2, of
    LeNet's parameters of `shapes` (default the lesson's)."""
    shapes = shapes or [shape for _, shape in LENET_SHAPES]
    c, h, w = image
    macs = []
    for out_c, in_c, k, _ in (shapes[0], shapes[2]):
        h, w = h - k + 1, w - k + 1
        macs.append(out_c * h * w * in_c * k * k)      # one product per output element and tap
        h, w = h // 2, w // 2                            # 2x2 pooling
    for d_in, d_out in (shapes[4], shapes[6]):
        macs.append(d_in * d_out)
    return macs


def flops_per_image(image=IMAGE, shapes=None):
    """(forward, forward + backward) FLOPs of one training image."""
    macs = layer_macs(image, shapes)
    forward = 2 * sum(macs)
    backward = 2 * (macs[0] + 2 * sum(macs[1:]))
    return forward, forward + backward


def gemm_peak(n=2048, repeats=5):
    """GFLOP/s of an n x n float32 matrix product on this machine, through MXNet's two kernels:
    {"dot": OpenBLAS (nd.dot), "fully_connected": oneDNN (nd.FullyConnected)}, best of `repeats`
    after a warm-up. Run it with the thread settings of the measurement it is held against."""
    import mxnet as mx
    from mxnet import nd
    a = nd.array(np.random.RandomState(0).rand(n, n).astype(np.float32), ctx=mx.cpu(0))
    b = nd.array(np.random.RandomState(1).rand(n, n).astype(np.float32), ctx=mx.cpu(0))
    kernels = {"dot": lambda: nd.dot(a, b),
               "fully_connected": lambda: nd.FullyConnected(a, b, no_bias=True, num_hidden=n)}
    out = {}
    for name, fn in kernels.items():
        best = float("inf")
        for _ in range(repeats + 1):
            nd.waitall()
            start = time.perf_counter()
            fn().wait_to_read()
            best = min(best, time.perf_counter() - start)
        out[name] = 2 * n ** 3 / best / 1e9
    return out
