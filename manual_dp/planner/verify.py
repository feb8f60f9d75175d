"""`plan --verify`: the top layouts run for a few steps on CPU contexts, measured beside predicted.

Measured memory of a context = the bytes of the arrays it holds at the step's peak: the strategy's
peak_arrays() (parameters, gradients, optimiser state, and ZeRO's transient gathered parameters and
gradient pieces) plus its activations: for pipelines the bytes PipelineParallel counted as its
schedule ran (end_epoch's activation_peak_bytes), otherwise memory.per_context's count from the
strategy's layout() and the layer shapes (MXNet has no per-context memory counter on CPU). The
busiest context is reported. Measured time = the median of `steps` steps after one warm-up.

BUILDERS is the registry of kinds that have a strategy: build(params, ctx, optimizer, layout) and
activations(model, batch, shapes) -> bytes per context name. A kind without an entry is predicted,
never run.
"""
import statistics
import time

import mxnet as mx
import numpy as np

from .. import memory
from ..lesson import init_lenet_params, lenet_shapes
from ..strategies.data_parallel import DataParallel
from ..strategies.pipeline import PipelineParallel
from ..strategies.zero import ZeroRedundancy
from .predict import stage_flops


def counted_activations(model, batch, shapes):
    """Pipelines: the activation bytes each context held at its peak, counted as the schedule ran."""
    return dict(model.peaks)


def shape_activations(model, batch, shapes):
    """Activation bytes per context from the strategy's layout() and the layer shapes (memory.py)."""
    return {c: r["activation_bytes"] for c, r in memory.per_context(model, batch, shapes).items()}


BUILDERS = {
    "data": (lambda p, ctx, opt, l: DataParallel(p, ctx, opt, graph=False), shape_activations),
    "zero": (lambda p, ctx, opt, l: ZeroRedundancy(p, ctx, opt, stage=l.zero_stage), shape_activations),
    "pipeline": (lambda p, ctx, opt, l: PipelineParallel(p, ctx, opt, l.micro, None, l.pp, l.schedule,
                                                         l.recompute), counted_activations),
}


def random_batch(batch, seed=0):
    """Images (batch, 1, 28, 28) and labels, reproducible."""
    rng = np.random.RandomState(seed)
    return rng.rand(batch, 1, 28, 28).astype(np.float32), rng.randint(0, 10, batch).astype(np.int32)


def timed_steps(model, X, y, steps):
    """Median seconds of `steps` steps after one warm-up step."""
    model.step(X, y, 0.01)
    mx.nd.waitall()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model.step(X, y, 0.01)
        mx.nd.waitall()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_bytes(model, activations, batch, shapes):
    """{context name: (array bytes at the peak, activation bytes)}."""
    out = {str(c): [0, 0] for c in model.ctx}
    for arrays in model.peak_arrays().values():
        for a in arrays:
            out[str(a.context)][0] += a.size * np.dtype(a.dtype).itemsize
    for c, nbytes in activations(model, batch, shapes).items():
        out[c][1] += nbytes
    return {c: tuple(v) for c, v in out.items()}


def measure(l, setting, steps=3):
    """{"state", "activations", "total"} bytes of the busiest context and "seconds" per step of
    layout l run on CPU contexts cpu(0..devices-1)."""
    build, activations = BUILDERS[l.kind]
    ctx = [mx.cpu(i) for i in range(l.dp * l.tp * l.pp)]
    model = build(init_lenet_params(0, width=setting.width), ctx, setting.optimizer, l)
    X, y = random_batch(setting.batch)
    seconds = timed_steps(model, X, y, steps)
    shapes = [shape for _, shape in lenet_shapes(setting.width)]
    state, acts = max(peak_bytes(model, activations, setting.batch, shapes).values(), key=sum)
    return {"state": state, "activations": acts, "total": state + acts, "seconds": seconds}


def machine_rate(setting, contexts, cores, steps=3):
    """FLOP/s of this machine on LeNet's layers: a one-context step's FLOPs over its measured time,
    times the contexts that run at once (min(contexts, cores): each context's ops get
    cores // contexts threads, manual_dp.fast.runtime)."""
    model = DataParallel(init_lenet_params(0, width=setting.width), [mx.cpu(0)], setting.optimizer, graph=False)
    seconds = timed_steps(model, *random_batch(setting.batch), steps)
    return setting.batch * stage_flops(setting.width, range(4), False) / seconds * min(contexts, cores)
