"""Training throughput of LeNet, the same data, start and updates for every implementation:

    manual_dp   DataParallel through run_epoch (any allreduce, fused or not, cached graph or not)
    lesson      d2l's train_batch as the lesson writes it, waitall after every batch
    gluon       gluon.Trainer(kvstore='device') on a gluon LeNet, hybridised or not

Every implementation starts from init_lenet_params(seed) and takes plain SGD steps on the same
batches in the same order, so its final loss is a check that it trained the same model.
"""
import os
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd
from mxnet.gluon import nn

from ..fast.collectives import make_allreduce
from ..lesson import allreduce, cross_entropy, get_params, init_lenet_params, lenet, sgd
from ..strategies.data.data_parallel import DataParallel
from ..strategies.sums.fixed_sums import FixedSums
from ..loop import run_epoch


# --- the lesson, as written (d2l, "Multiple GPUs from scratch"); allreduce, get_params and sgd
# --- are manual_dp.lesson's, identical to the lesson's; its network uses nd.relu where
# --- manual_dp's uses Activation, and nd.dot where manual_dp's uses FullyConnected.
def lesson_lenet(X, params):
    """The lesson's lenet as d2l writes it."""
    W1, b1, W2, b2, W3, b3, W4, b4 = params
    h1 = nd.relu(nd.Convolution(data=X, weight=W1, bias=b1, kernel=(3, 3), num_filter=20))
    h1 = nd.Pooling(data=h1, pool_type="avg", kernel=(2, 2), stride=(2, 2))
    h2 = nd.relu(nd.Convolution(data=h1, weight=W2, bias=b2, kernel=(5, 5), num_filter=50))
    h2 = nd.Pooling(data=h2, pool_type="avg", kernel=(2, 2), stride=(2, 2))
    h3 = nd.relu(nd.dot(h2.reshape((0, -1)), W3) + b3)
    return nd.dot(h3, W4) + b4


def lesson_train_batch(X, y, device_params, devices, lr, loss):
    """d2l's train_batch: split, forward and backward per device, allreduce each gradient, SGD."""
    X_shards = gluon.utils.split_and_load(X, devices)
    y_shards = gluon.utils.split_and_load(y, devices)
    with autograd.record():
        ls = [loss(lesson_lenet(X_shard, device_W), y_shard)
              for X_shard, y_shard, device_W in zip(X_shards, y_shards, device_params)]
    for l in ls:
        l.backward()
    for i in range(len(device_params[0])):
        allreduce([device_params[c][i].grad for c in range(len(devices))])
    for param in device_params:
        sgd(param, lr, X.shape[0])


def lesson_trainer(params, ctx, lr, batch):
    device_params = [get_params(params, c) for c in ctx]
    loss = gluon.loss.SoftmaxCrossEntropyLoss()

    def epoch(X, y):
        for start in range(0, len(X), batch):
            lesson_train_batch(nd.array(X[start:start + batch]), nd.array(y[start:start + batch]),
                               device_params, ctx, lr, loss)
            nd.waitall()  # the lesson's loop waits for every batch
    return epoch, lambda: device_params[0]


# --- manual_dp
def manual_trainer(params, ctx, lr, batch, allreduce="lesson", fused=False, graph=False, conv_pad=None,
                   deterministic=False):
    """conv_pad None: the autotune's choice for this machine (the bench measures it first);
    deterministic: --deterministic's strategy (its cached graph, unpadded, pieces added in one fixed tree)."""
    model = DataParallel(params, ctx, "sgd", sums=FixedSums()) if deterministic else \
        DataParallel(params, ctx, "sgd", make_allreduce(allreduce), fuse_grads=fused, graph=graph,
                     conv_pad=conv_pad)
    return (lambda X, y: run_epoch(model, X, y, batch, lr, rng=None)), lambda: model.replicas[0]


# --- gluon
def gluon_lenet():
    net = nn.HybridSequential()
    net.add(nn.Conv2D(20, 3, activation="relu"), nn.AvgPool2D(2, 2),
            nn.Conv2D(50, 5, activation="relu"), nn.AvgPool2D(2, 2),
            nn.Flatten(), nn.Dense(128, activation="relu"), nn.Dense(10))
    return net


def gluon_lenet_holding(params, ctx):
    """(net, its 4 layers): gluon's LeNet on `ctx` holding lenet's 8 `params`."""
    net = gluon_lenet()
    net.initialize(ctx=ctx)
    net(nd.zeros((1, 1, 28, 28), ctx=ctx[0]))
    layers = [net[0], net[2], net[5], net[6]]
    for i, (layer, W, b) in enumerate(zip(layers, params[0::2], params[1::2])):
        layer.weight.set_data(W.T if i >= 2 else W)   # gluon's Dense weight is (out, in)
        layer.bias.set_data(b)
    return net, layers


def gluon_trainer(params, ctx, lr, batch, hybrid=False):
    net, layers = gluon_lenet_holding(params, ctx)
    if hybrid:
        net.hybridize(static_alloc=True, static_shape=True)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": lr}, kvstore="device")
    loss = gluon.loss.SoftmaxCrossEntropyLoss()

    def epoch(X, y):
        for start in range(0, len(X), batch):
            Xs = gluon.utils.split_and_load(nd.array(X[start:start + batch]), ctx)
            ys = gluon.utils.split_and_load(nd.array(y[start:start + batch]), ctx)
            with autograd.record():
                ls = [loss(net(a), b) for a, b in zip(Xs, ys)]
            for l in ls:
                l.backward()
            trainer.step(len(X[start:start + batch]))
        nd.waitall()

    def final():
        out = []
        for i, layer in enumerate(layers):
            W = layer.weight.data(ctx[0])
            out += [W.T if i >= 2 else W, layer.bias.data(ctx[0])]
        return out
    return epoch, final


TRAINERS = {"manual_dp": manual_trainer, "lesson": lesson_trainer, "gluon": gluon_trainer}


def eval_loss(params, X, y):
    """Mean cross-entropy of host copies of `params` on (X, y), computed on cpu(0)."""
    W = [nd.array(p.asnumpy() if hasattr(p, "asnumpy") else p) for p in params]
    return float(cross_entropy(lenet(nd.array(X), W), nd.array(y)).mean().asscalar())


def measure(spec, X, y):
    """(wall, CPU) seconds of each of spec['repeats'] + 1 passes over (X, y) (the first is
    warm-up), and the loss after all of them on the first 1024 images."""
    ctx = [mx.cpu(i) for i in range(spec["devices"])]
    params = init_lenet_params(spec.get("seed", 0))
    epoch, final = TRAINERS[spec["impl"]](params, ctx, spec["lr"], spec["batch"], **spec.get("options", {}))
    times = []
    for _ in range(spec["repeats"] + 1):
        start = time.perf_counter(), cpu_seconds()
        epoch(X, y)
        nd.waitall()
        times.append((time.perf_counter() - start[0], cpu_seconds() - start[1]))
    return times, eval_loss(final(), X[:1024], y[:1024])


def cpu_seconds():
    """CPU time this process has used, all threads (user + system)."""
    t = os.times()
    return t.user + t.system
