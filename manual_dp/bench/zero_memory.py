"""Bytes of parameters, gradients and optimiser state per context: sync against ZeRO stages 1, 2, 3.

`python -m manual_dp.bench.zero_memory [--width 16] [--cpus 4] [--optimizer adam]` builds each
strategy on fresh LeNet parameters, takes one step on one random image per context, and adds up
the NDArrays each context holds at the step's largest moment (Strategy.peak_arrays: for ZeRO the
shards it keeps plus the gathered parameters or gradient pieces it held at that moment; sync holds
no more during a step than between steps). Not counted, for any strategy: activations (priced by
manual_dp.memory from the layer shapes), the optimiser's and the collectives' own temporaries.
"""
import argparse

import mxnet as mx
import numpy as np

from ..lesson import init_lenet_params
from ..strategies.data_parallel import DataParallel
from ..strategies.zero import ZeroRedundancy

STRATEGIES = {
    "sync": lambda p, ctx, opt: DataParallel(p, ctx, opt, graph=False),
    "zero1": lambda p, ctx, opt: ZeroRedundancy(p, ctx, opt, stage=1),
    "zero2": lambda p, ctx, opt: ZeroRedundancy(p, ctx, opt, stage=2),
    "zero3": lambda p, ctx, opt: ZeroRedundancy(p, ctx, opt, stage=3),
}


def peak_bytes(model):
    """{context name: [parameter bytes, gradient + optimiser-state bytes]} at the step's peak."""
    out = {str(c): [0, 0] for c in model.ctx}
    for kind, arrays in model.peak_arrays().items():          # "grad" (if listed apart) goes with "state"
        for a in arrays:
            out[str(a.context)][0 if kind == "param" else 1] += a.size * np.dtype(a.dtype).itemsize
    return out


def measure(name, ctx, width, optimizer, seed=0):
    """peak_bytes of strategy `name` after one step of one random image per context."""
    model = STRATEGIES[name](init_lenet_params(seed, width=width), ctx, optimizer)
    rng = np.random.default_rng(seed)
    X = rng.random((len(ctx), 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, len(ctx)).astype(np.int32)
    model.step(X, y, 0.01)
    mx.nd.waitall()
    return peak_bytes(model)


def table(width=16, cpus=4, optimizer="adam", names=tuple(STRATEGIES)):
    """Rows (strategy, largest per-context parameter bytes, gradient + state bytes, total), and
    the parameter count."""
    ctx = [mx.cpu(i) for i in range(cpus)]
    rows = []
    for name in names:
        per_ctx = measure(name, ctx, width, optimizer)
        param, state = max(per_ctx.values(), key=sum)
        rows.append((name, param, state, param + state))
    n = sum(p.size for p in init_lenet_params(0, width=width))
    return rows, n


def format_table(rows, n, width, cpus, optimizer):
    """The rows as text, in MiB, each total also as a fraction of sync's."""
    sync = dict((r[0], r[3]) for r in rows).get("sync")
    lines = [f"LeNet x{width} ({n:,} parameters), {optimizer}, {cpus} contexts: the busiest context "
             f"at the step's peak, MiB",
             f"{'strategy':8} {'params':>9} {'grads+state':>12} {'total':>9} {'of sync':>8}"]
    for name, param, state, total in rows:
        share = f"{total / sync:8.2f}" if sync else ""
        lines.append(f"{name:8} {param / 2**20:9.1f} {state / 2**20:12.1f} {total / 2**20:9.1f} {share}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m manual_dp.bench.zero_memory", description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=16, help="LeNet's width (default 16: 32.6M parameters)")
    p.add_argument("--cpus", type=int, default=4, help="contexts cpu(0..N-1) (default 4)")
    p.add_argument("--optimizer", default="adam", choices=("sgd", "momentum", "adam"))
    args = p.parse_args(argv)
    rows, n = table(args.width, args.cpus, args.optimizer)
    print(format_table(rows, n, args.width, args.cpus, args.optimizer))


if __name__ == "__main__":
    main()
