"""`plan --verify`: the top layouts run for a few steps on CPU contexts, measured beside predicted.

Measured memory of a context = the bytes of the arrays it holds at the step's peak: the strategy's
peak_arrays() (parameters, gradients, optimiser state, and ZeRO's transient gathered parameters and
gradient pieces) plus its activations: for pipelines the bytes PipelineParallel counted as its
schedule ran (end_epoch's activation_peak_bytes), otherwise memory.per_context's count from the
strategy's layout() and the layer shapes, the same count the planner predicts with. The busiest
context is reported. Tensor, sequence parallel, context and dp x pp x tp layouts' layout() price
1/T (1/C) of the group's examples on each context and what every context holds whole for the rest,
as the planner predicts (planner/sequence.py, pipelines.py); cp x tp grids and MeshParallel's cp
stages 1/(C T) (the images whole on a first stage), their floors, as the planner predicts too:
measured / predicted is 1 by construction: the planner prices what the strategies keep. MXNet
allocates more (its temporaries; MXNet's profiler, through cli.memcheck's fresh-process probe, which
the trainer's --memory-per-device uses): 1.1 to 3.1 times the count in every layout measured, LeNet
sync 16.0 MiB a context against 9.9, the transformer's tp=2 20.7 against 12.7 (docs/performance.md,
2026-11-26). For
interleaved pipelines the prediction adds a device's stages' peaks, measured counts them at once.
Measured time = the median of `steps` steps after one warm-up.

BUILDERS is the registry of kinds that have a strategy: build(params, ctx, optimizer, layout, net)
(net: the models.Model laid out) and activations(model, batch, shapes) -> bytes per context name. A
kind without an entry is predicted, never run.
"""
import statistics
import time

import mxnet as mx
import numpy as np

from .. import memory
from ..strategies.context.context import ContextParallel
from ..strategies.context.context_tensor import ContextTensorParallel
from ..strategies.data.data_parallel import DataParallel
from ..strategies.mesh.mesh_parallel import MeshParallel
from ..strategies.pipeline.pipeline import PipelineParallel
from ..strategies.tensor.tensor import TensorParallel
from ..models.precise import Precise
from ..precision import Policy
from ..strategies.zero.zero import ZeroRedundancy
from ..strategies.zero.zero_mixed import MixedZero
from .predict import net_of, stage_flops


def counted_activations(model, batch, shapes):
    """Pipelines: the activation bytes each context held at its peak, counted as the schedule ran."""
    return dict(model.peaks)


def shape_activations(model, batch, shapes):
    """Activation bytes per context from the strategy's layout() and the layer shapes (memory.py)."""
    return {c: r["activation_bytes"] for c, r in memory.per_context(model, batch, shapes).items()}


BUILDERS = {
    "data": (lambda p, ctx, opt, l, net: DataParallel(p, ctx, opt, graph=False, model=net), shape_activations),
    "zero": (lambda p, ctx, opt, l, net: ZeroRedundancy(p, ctx, opt, stage=l.zero_stage, model=net),
             shape_activations),
    "pipeline": (lambda p, ctx, opt, l, net: PipelineParallel(p, ctx, opt, l.micro, None, l.pp, l.schedule,
                                                              l.recompute, model=net, virtual_stages=l.virtual),
                 counted_activations),
    "tensor": (lambda p, ctx, opt, l, net: TensorParallel(p, ctx, opt, l.tp, model=net, sequence_parallel=l.sp),
               shape_activations),
    "context": (lambda p, ctx, opt, l, net: ContextTensorParallel(p, ctx, opt, l.cp, l.tp, l.attention, model=net)
                if l.tp > 1 else ContextParallel(p, ctx, opt, l.cp, l.attention, model=net), shape_activations),
    "mesh": (lambda p, ctx, opt, l, net: MeshParallel(p, ctx, opt, l.pp, l.tp, l.micro, l.schedule, l.virtual,
                                                      model=net, sequence_parallel=l.sp, context_parallel=l.cp,
                                                      attention=l.attention or "ring"), shape_activations),
}


def mixed_zero(precision):
    """The zero builder under a 16-bit --precision: MixedZero on the model in that precision (the
    layout the planner prices for it; every other kind keeps float32 arrays in any precision)."""
    def build(p, ctx, opt, l, net):
        policy = Policy(precision)
        return MixedZero(p, ctx, opt, stage=l.zero_stage, model=Precise(net, policy), precision=precision,
                         native=policy.native)
    return build


def random_batch(batch, seed=0):
    """Images (batch, 1, 28, 28) and labels, reproducible."""
    rng = np.random.RandomState(seed)
    return rng.rand(batch, 1, 28, 28).astype(np.float32), rng.randint(0, 10, batch).astype(np.int32)


def timed_steps(runs, steps):
    """Median seconds per step of each (model, X, y) of `runs`: one warm-up step each, then `steps`
    rounds of one step of each, side by side, so that the load of a shared machine falls on all alike."""
    times = [[] for _ in runs]
    for model, X, y in runs:
        model.step(X, y, 0.01)
    mx.nd.waitall()
    for _ in range(steps):
        for (model, X, y), t in zip(runs, times):
            start = time.perf_counter()
            model.step(X, y, 0.01)
            mx.nd.waitall()
            t.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


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
    """{"state", "activations", "total"} bytes of the busiest context, "seconds" per step of layout
    l run on CPU contexts cpu(0..devices-1), and "rate": this machine's FLOP/s on the model's layers,
    timed side by side with it: the FLOPs of a one-context step on one device's share of the batch
    (ceil(batch / devices) examples) over its time. The contexts' work is taken to run one after
    another (measured here: 8 contexts on a batch of 64 took as long as 8 one-context steps of 8)."""
    build, activations = BUILDERS[l.kind]
    build = mixed_zero(setting.precision) if l.kind == "zero" and setting.precision != "fp32" else build
    net = net_of(setting)
    ctx = [mx.cpu(i) for i in range(l.dp * l.tp * l.pp * l.cp)]
    params = net.init_params(0)
    model = build(params, ctx, setting.optimizer, l, net)
    one = DataParallel(params, [mx.cpu(0)], setting.optimizer, graph=False, model=net)
    X, y = random_batch(setting.batch)
    share = -(-setting.batch // len(ctx))
    seconds, one_seconds = timed_steps([(model, X, y), (one, X[:share], y[:share])], steps)
    shapes = [shape for _, shape in net.shapes()]
    state, acts = max(peak_bytes(model, activations, setting.batch, shapes).values(), key=sum)
    rate = share * stage_flops(net, range(len(net.layers)), False) / one_seconds
    return {"state": state, "activations": acts, "total": state + acts, "seconds": seconds, "rate": rate}
