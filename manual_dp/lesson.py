"""The lesson, "multiple GPUs from scratch", top to bottom: everything else in manual_dp builds on it.

The picture on the whiteboard, one short function a step:

    1. a network written as a function of its parameters       lenet(X, params)
    2. copy the parameters to every device                      get_params(params, ctx)
    3. cut each batch into one shard per device                 split_and_load(data, ctx)
    4. forward and backward on every device at once             (inside train_batch)
    5. sum the gradients over the devices, copy the sum back    allreduce(arrays)
    6. every device takes the same optimiser step               sgd(params, lr, batch_size)

train_batch is steps 3 to 6 for one batch. Afterwards every replica holds what one device would
hold after one step on the whole batch. Only MXNet and numpy are used here.
"""
import mxnet as mx
import numpy as np
from mxnet import autograd, nd

# 1. The network ---------------------------------------------------------------------------------
def lenet_shapes(width=1):
    """(name, shape) of LeNet's 8 parameters, in order: W1, b1, W2, b2, W3, b3, W4, b4. `width`
    multiplies the channels and hidden units (20, 50, 128): W=16 has 32.6 million parameters."""
    c1, c2, hidden = 20 * width, 50 * width, 128 * width
    return [("W1", (c1, 1, 3, 3)), ("b1", (c1,)),
            ("W2", (c2, c1, 5, 5)), ("b2", (c2,)),
            ("W3", (c2 * 16, hidden)), ("b3", (hidden,)),     # 16 = the 4x4 map after two poolings
            ("W4", (hidden, 10)), ("b4", (10,))]


LENET_SHAPES = lenet_shapes(1)       # the lesson's LeNet: 129,068 parameters


def init_lenet_params(seed=0, scale=None, ctx=None, width=1):
    """Fresh LeNet parameters of `width` (see lenet_shapes) on `ctx` (default cpu(0)), reproducible
    from `seed`.

    scale=None draws He-normal weights (std sqrt(2 / fan_in)), which trains fast;
    scale=0.01 is the lesson's normal(0, 0.01) initialisation. Biases are zero.
    """
    ctx = ctx or mx.cpu(0)
    rng = np.random.RandomState(seed)
    params = []
    for name, shape in lenet_shapes(width):
        if name.startswith("b"):
            value = np.zeros(shape, dtype=np.float32)
        else:
            fan_in = shape[0] if len(shape) == 2 else int(np.prod(shape[1:]))
            std = scale if scale is not None else np.sqrt(2.0 / fan_in)
            value = rng.normal(0.0, std, size=shape).astype(np.float32)
        params.append(nd.array(value, ctx=ctx))
    return params


def relu(h, F=nd):
    """max(h, 0), as Activation: oneDNN's kernel, ~8% less CPU per training step than F.relu."""
    return F.Activation(h, act_type="relu")


def dense(h, W, b, F=nd, shape=None):
    """h W + b for h (B, ...) flattened to (B, in) and W (in, out), as the lesson writes it, run as
    FullyConnected (oneDNN's kernel, which takes the weight as (out, in)): less CPU per step than
    F.dot followed by F.broadcast_add."""
    shape = shape or W.shape
    return F.FullyConnected(data=h, weight=F.transpose(W), bias=b, num_hidden=shape[1], flatten=True)


def conv_block(X, W, b, F=nd, shape=None):
    """Convolution, ReLU, 2x2 average pooling; `shape` of W is needed when F is mx.sym."""
    shape = shape or W.shape
    h = F.Convolution(data=X, weight=W, bias=b, kernel=shape[2:], num_filter=shape[0])
    return F.Pooling(data=relu(h, F), pool_type="avg", kernel=(2, 2), stride=(2, 2))


def lenet(X, params, F=nd, shapes=None):
    """Class scores (B, 10) for images X (B, 1, 28, 28); params live on X's context.

    F=mx.sym builds the same network as a symbolic graph (manual_dp.fast.graph caches it); symbols
    have no shapes, so theirs are `shapes` (default LENET_SHAPES').
    """
    W1, b1, W2, b2, W3, b3, W4, b4 = params
    shapes = shapes or [getattr(p, "shape", shape) for p, (_, shape) in zip(params, LENET_SHAPES)]
    h = conv_block(X, W1, b1, F, shapes[0])          # (B, 20, 13, 13)
    h = conv_block(h, W2, b2, F, shapes[2])          # (B, 50, 4, 4)
    h = relu(dense(h, W3, b3, F, shapes[4]), F)      # (B, 128)
    return dense(h, W4, b4, F, shapes[6])            # (B, 10)


def cross_entropy(y_hat, y, F=nd):
    """Per-example softmax cross-entropy (B,) of scores y_hat (B, C) and labels y (B,)."""
    return -F.pick(F.log_softmax(y_hat), y)


def n_correct(scores, y):
    """Number of rows of `scores` whose argmax equals `y`, as a 1-element NDArray."""
    return (scores.argmax(axis=1) == y.astype(scores.dtype)).sum()


# 2. Copy the parameters to a device ---------------------------------------------------------------
def get_params(params, ctx):
    """Copies of `params` on `ctx`, each with a gradient buffer attached."""
    new_params = [p.copyto(ctx) for p in params]
    for p in new_params:
        p.attach_grad()
    return new_params


# 3. Cut the batch ------------------------------------------------------------------------------------
def shard_sizes(n, k):
    """Sizes of k contiguous shards of n items that differ by at most one."""
    if k < 1:
        raise ValueError(f"need at least one device, got {k}")
    if n < k:
        raise ValueError(f"a batch of {n} cannot be split over {k} devices: "
                         f"use a batch of at least {k}")
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def split_and_load(data, ctx):
    """Shard `data` (NDArray or numpy) along axis 0 into len(ctx) pieces, piece i on ctx[i]."""
    sizes = shard_sizes(data.shape[0], len(ctx))
    shards, start = [], 0
    for size, c in zip(sizes, ctx):
        piece = data[start:start + size]
        shards.append(nd.array(piece, ctx=c, dtype=piece.dtype) if isinstance(piece, np.ndarray)
                      else piece.as_in_context(c))
        start += size
    return shards


# 4. Forward and backward on every device -----------------------------------------------------------
def forward_backward(X_shards, y_shards, device_params, net=lenet, loss=cross_entropy, correct=n_correct):
    """Record every device's forward pass, then run each backward: the gradients are of the loss
    summed over the shard. Returns per-device (loss sum, number correct), left on the devices.
    (`net`: the network, lenet here; past the lesson any model's forward, manual_dp.models, and
    its loss and count of correct predictions per example, models.contract.)"""
    with autograd.record():
        scores = [net(X, W) for X, W in zip(X_shards, device_params)]
        losses = [loss(s, y) for s, y in zip(scores, y_shards)]
    for l in losses:
        l.backward()
    return [(l.sum(), correct(s, y)) for l, s, y in zip(losses, scores, y_shards)]


# 5. Sum the gradients --------------------------------------------------------------------------------
def allreduce(data):
    """Afterwards every `data[i]` holds the elementwise sum of all of them, on its own context."""
    for i in range(1, len(data)):
        data[0][:] += data[i].copyto(data[0].context)
    for i in range(1, len(data)):
        data[0].copyto(data[i])


# 6. The same step everywhere -------------------------------------------------------------------------
def sgd(params, lr, batch_size):
    """Minibatch SGD: p <- p - lr * gradient / batch_size (the gradient is of the loss sum)."""
    for p in params:
        p[:] = p - lr * p.grad / batch_size


def train_batch(X, y, device_params, ctx, lr, allreduce_fn=allreduce, update=sgd, net=lenet, **loss):
    """One synchronous step on the batch (X, y): afterwards every replica in `device_params`
    equals one step of `update` on the whole batch, taken on one device.

    `update(params, lr, batch_size)` is called once per replica (the lesson's sgd by default; a
    strategy passes its own optimiser, whose state it keeps; and `net`, its model, and `loss`,
    forward_backward's loss and correct). Returns per-device (loss sum, number correct) NDArrays,
    left on their devices.
    """
    X_shards, y_shards = split_and_load(X, ctx), split_and_load(y, ctx)   # 3.
    metrics = forward_backward(X_shards, y_shards, device_params, net, **loss)   # 4.
    for i in range(len(device_params[0])):                                 # 5.
        allreduce_fn([W[i].grad for W in device_params])
    for W in device_params:                                                # 6.
        update(W, lr, X.shape[0])
    return metrics
