"""`python -m manual_dp.bench.modes`: images/s of every mode side by side, in one run.

Every strategy is built on the same CPU contexts from the same parameters and takes `--steps`
momentum steps on one random batch, the strategies taking turns for `--rounds` rounds (round 0
warms up: graphs, kernels); the median of each is kept and divided by sync's. CPU contexts share
the machine's cores, so no mode is expected to beat sync here: the table is each mode's overhead.
Prints one line per mode and writes DIR/modes.json with the machine and commit.
"""
import json
import time
from pathlib import Path

import numpy as np

from ..cli.options import OneLineParser
from ..cli.output import parsed_or_exit
from ..fast.runtime import configure, machine


def strategies(ctx):
    """{name: make(params)} of every mode on the contexts `ctx` (4 of them)."""
    from ..strategies.async_dp import AsyncDataParallel
    from ..strategies.data_parallel import DataParallel
    from ..strategies.deterministic import DeterministicDataParallel
    from ..strategies.local_sgd import LocalSGD
    from ..strategies.pipeline import PipelineParallel
    from ..strategies.tensor import TensorParallel
    from ..strategies.zero import ZeroRedundancy
    opt = "momentum"
    return {
        "sync (fast step)": lambda p: DataParallel(p, ctx, opt),
        "sync (the lesson's step)": lambda p: DataParallel(p, ctx, opt, lesson=True),
        "deterministic": lambda p: DeterministicDataParallel(p, ctx, opt),
        "async S=1": lambda p: AsyncDataParallel(p, ctx, opt, staleness=1),
        "local H=4": lambda p: LocalSGD(p, ctx, opt, sync_every=4),
        "zero stage 1": lambda p: ZeroRedundancy(p, ctx, opt, stage=1),
        "zero stage 2": lambda p: ZeroRedundancy(p, ctx, opt, stage=2),
        "zero stage 3": lambda p: ZeroRedundancy(p, ctx, opt, stage=3),
        "tensor T=4": lambda p: TensorParallel(p, ctx, opt),
        "tensor T=2 x data 2": lambda p: TensorParallel(p, ctx, opt, 2),
        "model S=4": lambda p: PipelineParallel(p, ctx, opt, 1, stages=4),
        "pipeline S=4 gpipe M=4": lambda p: PipelineParallel(p, ctx, opt, 4, stages=4),
        "pipeline S=4 1f1b M=4": lambda p: PipelineParallel(p, ctx, opt, 4, stages=4, schedule="1f1b"),
        "hybrid 2x2 M=4": lambda p: PipelineParallel(p, ctx, opt, 4),
    }


def speed(width, batch, steps, rounds):
    """{mode: median images/s} over `rounds` turns of `steps` steps each, on cpu(0..3)."""
    import mxnet as mx
    from ..lesson import init_lenet_params
    ctx = [mx.cpu(i) for i in range(4)]
    models = {name: make(init_lenet_params(0, width=width)) for name, make in strategies(ctx).items()}
    return take_turns(models, batch, steps, rounds)


def take_turns(models, batch, steps, rounds):
    """{name: median images/s} of each model's `steps` steps on one random batch of `batch`, the
    models taking turns for `rounds` rounds after one that warms up (graphs, kernels)."""
    import mxnet as mx
    rng = np.random.RandomState(0)
    X, y = rng.rand(batch, 1, 28, 28).astype(np.float32), rng.randint(0, 10, batch).astype(np.int32)
    times = {name: [] for name in models}
    for r in range(rounds + 1):
        for name, model in models.items():
            start = time.perf_counter()
            for _ in range(steps):
                model.step(X, y, 0.01)
            mx.nd.waitall()
            if r:
                times[name].append(time.perf_counter() - start)
    return {name: steps * batch / float(np.median(t)) for name, t in times.items()}


def parse(argv):
    """The checked arguments; UsageError (one line) for values no run can use."""
    parser = OneLineParser(prog="python -m manual_dp.bench.modes", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench_out", help="directory for modes.json")
    parser.add_argument("--width", type=int, default=1)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="steps per mode per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if min(args.width, args.steps, args.rounds) < 1 or args.batch < 4:
        parser.error("--width, --steps and --rounds must be >= 1, --batch >= 4")
    return args


def main(argv=None):
    args = parsed_or_exit(parse, argv, "python -m manual_dp.bench.modes")
    configure(4)                                    # thread settings before MXNet loads
    from ..bench.command import commit
    where = dict(machine(), commit=commit())
    rates = speed(args.width, args.batch, args.steps, args.rounds)
    base = rates["sync (fast step)"]
    print(f"{where['cpu']} ({where['vector']}), {where['cores']} cores, commit {where['commit']}; 4 CPU "
          f"contexts, LeNet x{args.width}, batch {args.batch}, median of {args.rounds} rounds")
    for name, rate in rates.items():
        print(f"  {name:26} {rate:8.0f} img/s  {rate / base:5.2f}x sync")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "modes.json").write_text(json.dumps(dict(where, width=args.width, batch=args.batch,
                                                    images_per_sec=rates), indent=1))


if __name__ == "__main__":
    main()
