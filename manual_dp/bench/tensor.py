"""`python -m manual_dp.bench.tensor`: what tensor parallelism saves and costs, beside synchronous
data parallelism on the same contexts.

    bytes   per context: parameters, gradients and optimiser state, counted from the NDArrays each
            strategy holds (strategy.arrays(), grouped by .context), at --memory-width (16) with Adam
    speed   images/s of training steps at each --widths, the strategies taking turns (rounds), the
            median kept: on a shared machine still noisy, and labelled so

Writes DIR/tensor.json (with the machine and commit) and DIR/tensor.png.
"""
import json
import os
from pathlib import Path

import numpy as np

from ..cli.options import OneLineParser, positive
from ..cli.output import ends_on_signals, parsed_or_exit
from ..fast.runtime import configure, machine

PROG = "python -m manual_dp.bench.tensor"

PARTS = ("params", "grads", "optimiser state")


def held_bytes(model):
    """{context: {part: bytes}} of what `model` holds (Strategy.arrays: "param", "grad", "state")."""
    held = model.arrays()
    out = {str(c): dict.fromkeys(PARTS, 0) for c in model.ctx}
    for part, kind in zip(PARTS, ("param", "grad", "state")):
        for a in held[kind]:
            out[str(a.context)][part] += a.size * np.dtype(a.dtype).itemsize
    return out


def strategies(n):
    """{name: make(params, optimizer)} of the strategies compared on n contexts."""
    import mxnet as mx
    from ..strategies.data.data_parallel import DataParallel
    from ..strategies.tensor.tensor import TensorParallel
    ctx = [mx.cpu(i) for i in range(n)]
    return {f"sync x{n} (fast step, unpadded)": lambda p, o: DataParallel(p, ctx, o, conv_pad=1),
            f"sync x{n} (layer by layer)": lambda p, o: DataParallel(p, ctx, o, graph=False),
            f"tensor T={n}": lambda p, o: TensorParallel(p, ctx, o),
            f"tensor T={n // 2} x DP 2": lambda p, o: TensorParallel(p, ctx, o, n // 2)}


def memory(n, width, optimizer="adam"):
    """{strategy: held_bytes} at `width`, one strategy alive at a time."""
    from ..lesson import init_lenet_params
    makes = strategies(n)
    return {name.split(" (")[0]: held_bytes(makes[name](init_lenet_params(0, width=width), optimizer))
            for name in (f"sync x{n} (layer by layer)", f"tensor T={n}", f"tensor T={n // 2} x DP 2")}


def speed(n, width, batch, steps, rounds):
    """{strategy: median images/s over `rounds`} of `steps` momentum steps each, taken in turns."""
    from ..lesson import init_lenet_params
    from .modes import take_turns
    models = {name: make(init_lenet_params(0, width=width), "momentum") for name, make in strategies(n).items()}
    return take_turns(models, batch, steps, rounds)


def plot(results, out):
    """tensor.png: stacked bytes per context (left), images/s per width (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels, bottoms = [], []
    for s, (name, per_ctx) in enumerate(results["memory"].items()):
        for c, (ctx, parts) in enumerate(per_ctx.items()):
            x, bottom = s * (len(per_ctx) + 1) + c, 0
            for k, part in enumerate(PARTS):
                left.bar(x, parts[part] / 2 ** 20, bottom=bottom, color=f"C{k}", label=part if not s and not c else None)
                bottom += parts[part] / 2 ** 20
            labels.append((x, f"{name}\n{ctx}" if c == 0 else ctx))
    left.set_xticks([x for x, _ in labels], [l for _, l in labels], rotation=60, ha="right", fontsize=7)
    left.set(ylabel="MiB held", title=f"per context: LeNet x{results['memory_width']}, Adam")
    left.legend(fontsize=8)
    names = list(next(iter(results["speed"].values())))
    for i, (width, per_name) in enumerate(results["speed"].items()):
        right.bar([j * (len(results["speed"]) + 1) + i for j in range(len(names))],
                  [per_name[n] for n in names], color=f"C{i + 3}", label=f"width {width}")
    right.set_xticks([j * (len(results["speed"]) + 1) for j in range(len(names))], names, rotation=20,
                     ha="right", fontsize=7)
    load = f" (1-min load {results['load_1min']:.0f})" if "load_1min" in results else ""
    right.set(ylabel="images/s", title=f"training speed: NOISY, shared machine{load}")
    right.legend(fontsize=8)
    m = results["machine"]
    fig.suptitle(f"{m['cpu']}, {m['cores']} cores, commit {results['commit']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tensor.png", dpi=110)
    plt.close(fig)


def parse(argv):
    """The checked flags; UsageError (one line) for values no run can use."""
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench_out", help="directory for tensor.json and tensor.png")
    parser.add_argument("--contexts", type=positive, default=4, help="CPU contexts (even, >= 2)")
    parser.add_argument("--memory-width", type=positive, default=16)
    parser.add_argument("--widths", type=positive, nargs="+", default=[1, 4], help="widths timed")
    parser.add_argument("--batch", type=positive, default=256)
    parser.add_argument("--steps", type=positive, default=3, help="steps per strategy per round")
    parser.add_argument("--rounds", type=positive, default=3)
    args = parser.parse_args(argv)
    if args.contexts % 2:
        parser.error(f"--contexts must be even (tensor groups of 2), got {args.contexts}")
    return args


def main(argv=None):
    """The results; bad flags end with one line and exit 2, Ctrl-C, SIGTERM or SIGHUP with one line."""
    with ends_on_signals(PROG):
        return measure(parsed_or_exit(parse, argv, PROG))


def measure(args):
    """Memory and speed of the strategies, written to OUT/tensor.json and .png, and printed."""
    configure(args.contexts)                         # thread settings before MXNet loads
    from .command import commit
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine(), "commit": commit(), "memory_width": args.memory_width,
               "memory": memory(args.contexts, args.memory_width),
               "speed": {w: speed(args.contexts, w, args.batch, args.steps, args.rounds) for w in args.widths}}
    results["load_1min"] = os.getloadavg()[0]       # how shared the machine was as the timing ended
    (out / "tensor.json").write_text(json.dumps(results, indent=1))
    plot(results, out)
    for name, per_ctx in results["memory"].items():
        print(f"{name}: " + "; ".join(f"{c} {sum(p.values()) / 2 ** 20:.0f} MiB" for c, p in per_ctx.items()))
    for w, per_name in results["speed"].items():
        print(f"width {w}: " + "; ".join(f"{n} {v:.0f} img/s" for n, v in per_name.items()))
    return results


if __name__ == "__main__":
    main()
