"""Bytes per context: sync against ZeRO stages 1, 2, 3, in fp32 and in a 16-bit precision, side by side.

`python -m manual_dp.bench.zero_memory [--width 16] [--cpus 4] [--optimizer adam] [--precision bf16]
[--batch 64] [--no-profile]` builds each strategy on the same LeNet parameters in fp32 and in the
precision, takes one step on one random image per context, and prints for the busiest context:

    kept         the bytes of the arrays it keeps between steps (Strategy.arrays(): sizes times
                 dtypes, the split of the memory report): parameters, gradients, optimiser state
                 (ZeRO in 16 bits: with its float32 master shard, strategies/zero/zero_mixed.py)
    a parameter  those bytes over the model's N parameters, on that context and summed over every
                 context: fp32 Adam's 4 + 4 + 8 (parameter, gradient, m, v), DeepSpeed's 2 + 2 + 12
                 in 16 bits (parameter, gradient; master, m, v); sync holds one set per context
    arrays       kept and the transient arrays held at the step's largest moment (peak_arrays:
                 ZeRO's gathered layer and gradient pieces), as the planner prices them
    profiled     the whole peak of a --batch step as MXNet's profiler counts it (manual_dp.memory.
                 measure in a fresh process with one scratch buffer per device, as --memory-per-device
                 measures): activations and temporaries too, among them the float32 copies that a
                 layer casts its 16-bit parameters to where it reads them

Under a 16-bit precision sync keeps what fp32 keeps (PyTorch AMP's layout: float32 master weights,
gradients and state; its 16-bit copies are transient). Sizes do not depend on the machine.
"""
import json

import numpy as np

from ..cli.options import OneLineParser, positive
from ..cli.output import ends_on_signals, parsed_or_exit
from ..config import ZERO_MEMORY, RunConfig
from ..modes import resolve

NAMES = ("sync", "zero1", "zero2", "zero3")
KINDS = ("param", "grad", "state")


def strategy(name, precision, net, ctx, optimizer):
    """The strategy `name` (NAMES) of `net` in `precision` on ctx, from net's parameters of seed 0."""
    from ..models.precise import Precise
    from ..precision import Policy
    from ..strategies.data.data_parallel import DataParallel
    from ..strategies.zero.zero import ZeroRedundancy
    from ..strategies.zero.zero_mixed import MixedZero
    params, policy = net.init_params(0), Policy(precision)
    model = net if precision == "fp32" else Precise(net, policy)
    if name == "sync":
        return DataParallel(params, ctx, optimizer, graph=False, model=model)
    if precision == "fp32":
        return ZeroRedundancy(params, ctx, optimizer, int(name[-1]), model=net)
    return MixedZero(params, ctx, optimizer, int(name[-1]), model=model, precision=precision, native=policy.native)


def stepped(model, seed=0):
    """`model` after one step on one random image per context."""
    import mxnet as mx
    rng = np.random.default_rng(seed)
    X = rng.random((len(model.ctx), 1, 28, 28), dtype=np.float32)
    model.step(X, rng.integers(0, 10, len(model.ctx)).astype(np.int32), 0.01)
    mx.nd.waitall()
    return model


def peak_bytes(model):
    """{context name: [parameter bytes, gradient + optimiser-state bytes]} of peak_arrays() (what
    notebook 07 draws per mode)."""
    out = {str(c): [0, 0] for c in model.ctx}
    for kind, arrays in model.peak_arrays().items():
        for a in arrays:
            out[str(a.context)][0 if kind == "param" else 1] += a.size * np.dtype(a.dtype).itemsize
    return out


def arrays_peak(model):
    """{context name: bytes of peak_arrays() on it}."""
    out = {str(c): 0 for c in model.ctx}
    for arrays in model.peak_arrays().values():
        for a in arrays:
            out[str(a.context)] += a.size * np.dtype(a.dtype).itemsize
    return out


def row(name, precision, net, ctx, optimizer):
    """{"name", "precision", "kept": [param, grad, state] bytes of the busiest context, "all": the
    same summed over the contexts, "arrays": the largest peak_arrays bytes}."""
    from ..memory import held_bytes
    model = stepped(strategy(name, precision, net, ctx, optimizer))
    held = [[r[f"{k}_bytes"] for k in KINDS] for r in held_bytes(model).values()]
    return {"name": name, "precision": precision, "kept": max(held, key=sum),
            "all": [sum(h[i] for h in held) for i in range(3)], "arrays": max(arrays_peak(model).values())}


def profiled(name, precision, width, cpus, optimizer, batch):
    """The largest peak_bytes of the run's memory report, measured in a fresh process (None if it failed)."""
    from ..cli.memcheck import default_pad, read_probes
    cfg = resolve(RunConfig(mode="zero" if name != "sync" else "sync", zero_stage=int(name[-1]) if name != "sync"
                            else None, precision=precision, cpus=cpus, width=width, optimizer=optimizer,
                            batch_size=batch))
    report = read_probes({0: (cfg, cpus)}, "cpu", default_pad(cfg))[0]
    return max(r["peak_bytes"] for r in report.values()) if report else None


def table(width, cpus, optimizer, precision, names=NAMES, batch=None):
    """(rows, N): a row (see `row`) per strategy in fp32 and in `precision`, with "profiled" (the
    fresh process's peak of a `batch` step; None: not measured, `batch` None)."""
    import mxnet as mx
    from ..models import build
    net, ctx = build("lenet", width), [mx.cpu(i) for i in range(cpus)]
    rows = [row(name, p, net, ctx, optimizer) for name in names for p in ("fp32", precision)]
    for r in rows:
        r["profiled"] = batch and profiled(r["name"], r["precision"], width, cpus, optimizer, batch)
    return rows, net.n_params()


def split(values, n):
    """Bytes per parameter, "p + g + s = total"."""
    return " + ".join(f"{v / n:.3g}" for v in values) + f" = {sum(values) / n:.3g}"


def format_table(rows, n, width, cpus, optimizer, batch=None):
    """The rows as text: MiB of the busiest context, bytes a parameter, the peaks."""
    mib = lambda b: f"{b / 2 ** 20:8.1f}" if b else f"{'-':>8}"
    lines = [f"LeNet x{width} ({n:,} parameters), {optimizer}, {cpus} contexts; the busiest context, MiB; "
             f"bytes a parameter (param + grad + state)" + (f"; profiled: batch {batch}" if batch else ""),
             f"{'strategy':8} {'prec.':5} {'params':>8} {'grads':>8} {'state':>8} {'kept':>8}  "
             f"{'a parameter, per context':26} {'all contexts':22} {'arrays':>8} {'profiled':>8}"]
    for r in rows:
        lines.append(f"{r['name']:8} {r['precision']:5} " + " ".join(mib(b) for b in r["kept"]) +
                     f" {mib(sum(r['kept']))}  {split(r['kept'], n):26} {split(r['all'], n):22} "
                     f"{mib(r['arrays'])} {mib(r['profiled'])}")
    return "\n".join(lines)


@ends_on_signals("python -m manual_dp.bench.zero_memory")   # Ctrl-C, SIGTERM, SIGHUP: one line
def main(argv=None):
    p = OneLineParser(prog="python -m manual_dp.bench.zero_memory", description=__doc__.split("\n")[0])
    d = ZERO_MEMORY
    p.add_argument("--width", type=positive, default=d["width"], help=f"LeNet's width (default {d['width']})")
    p.add_argument("--cpus", type=positive, default=d["cpus"], help=f"contexts cpu(0..N-1) (default {d['cpus']})")
    p.add_argument("--optimizer", default=d["optimizer"], choices=("sgd", "momentum", "adam"),
                   help=f"(default {d['optimizer']})")
    p.add_argument("--precision", default=d["precision"], choices=("bf16", "fp16"),
                   help=f"the 16-bit precision beside fp32 (default {d['precision']})")
    p.add_argument("--batch", type=positive, default=d["batch"], help=f"the profiled step's batch (default {d['batch']})")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled peaks (fresh processes)")
    p.add_argument("--json", help="also write the rows to this file")
    args = parsed_or_exit(p.parse_args, argv, "python -m manual_dp.bench.zero_memory")
    batch = None if args.no_profile else args.batch
    rows, n = table(args.width, args.cpus, args.optimizer, args.precision, batch=batch)
    print(format_table(rows, n, args.width, args.cpus, args.optimizer, batch))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(width=args.width, cpus=args.cpus, optimizer=args.optimizer, n_params=n, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
