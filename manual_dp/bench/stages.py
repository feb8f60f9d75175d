"""`python -m manual_dp.bench.stages`: what 1F1B and --recompute buy. Per stage of an S-stage
pipeline, the activation bytes one step holds at its peak, counted as the schedule runs (GPipe and
1F1B, with and without recompute: exact counts); then step times with and without recompute,
interleaved step by step in one run (on a shared machine: noisy, compare the ratios).

    python -m manual_dp.bench.stages [--stages 4] [--micro-batches 8] [--batch-size 256] [--width 1]
"""
import statistics
import time

from ..cli.options import OneLineParser, positive
from ..cli.output import ends_on_signals, parsed_or_exit
from ..fast.runtime import configure, machine

PROG = "python -m manual_dp.bench.stages"

CONFIGS = [("gpipe", False), ("gpipe", True), ("1f1b", False), ("1f1b", True)]


def build_parser():
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=4, choices=(1, 2, 3, 4), help="pipeline stages (default 4)")
    p.add_argument("--micro-batches", type=positive, default=8, help="micro-batches per batch (default 8)")
    p.add_argument("--batch-size", type=positive, default=256, help="examples per step (default 256)")
    p.add_argument("--width", type=positive, default=1, help="LeNet's width multiplier (default 1)")
    p.add_argument("--steps", type=positive, default=5, help="timed steps per configuration (default 5)")
    return p


def make_models(args, mx):
    """One PipelineParallel per (schedule, recompute) of CONFIGS, on cpu(0..S-1), same weights."""
    from ..lesson import init_lenet_params
    from ..strategies.pipeline.pipeline import PipelineParallel
    ctx = [mx.cpu(i) for i in range(args.stages)]
    return [PipelineParallel(init_lenet_params(seed=0, width=args.width), ctx, "sgd", args.micro_batches,
                             stages=args.stages, schedule=name, recompute=rc) for name, rc in CONFIGS]


def step_times(models, X, y, steps, nd):
    """Seconds per step of each model: one warm-up step each, then `steps` rounds, one step of each
    model per round (so that load on the machine falls on all alike)."""
    times = [[] for _ in models]
    for model in models:
        model.step(X, y, 0.01)
    nd.waitall()
    for _ in range(steps):
        for model, t in zip(models, times):
            start = time.perf_counter()
            model.step(X, y, 0.01)
            nd.waitall()
            t.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def table(models, seconds, args):
    """The report's lines: peak activation bytes per stage, then step times."""
    head = "".join(f"{f'stage {s}':>12}" for s in range(args.stages))
    lines = ["activation bytes held at the peak, per stage (counted as the schedule runs):",
             f"{'schedule':<9}{'recompute':<10}{head}{'total':>12}"]
    for (name, rc), model in zip(CONFIGS, models):
        peaks = [model.peaks[str(c)] for c in model.ctx]
        lines.append(f"{name:<9}{'yes' if rc else 'no':<10}" + "".join(f"{p:>12,}" for p in peaks)
                     + f"{sum(peaks):>12,}")
    lines.append(f"step time, median of {args.steps} interleaved steps (machine shared: noisy, compare ratios):")
    for (name, rc), sec, base in zip(CONFIGS, seconds, [seconds[0]] * 2 + [seconds[2]] * 2):
        lines.append(f"{name:<9}{'yes' if rc else 'no':<10}{sec * 1e3:>9.1f} ms  {sec / base:.2f}x")
    return lines


def main(argv=None):
    """The report; bad flags end with one line and exit 2, Ctrl-C, SIGTERM or SIGHUP with one line."""
    with ends_on_signals(PROG):
        report(parsed_or_exit(build_parser().parse_args, argv, PROG))


def report(args):
    """Measure the configurations of `args` and print the tables."""
    configure(args.stages)
    import mxnet as mx   # loads here, with the thread settings for S contexts
    import numpy as np
    from mxnet import nd
    from .command import commit
    rng = np.random.RandomState(0)
    X = rng.rand(args.batch_size, 1, 28, 28).astype(np.float32)
    y = rng.randint(0, 10, args.batch_size).astype(np.int32)
    models = make_models(args, mx)
    seconds = step_times(models, X, y, args.steps, nd)
    m = machine()
    print(f"LeNet x{args.width} in {args.stages} stages on cpu(0..{args.stages - 1}), batch {args.batch_size} "
          f"in {args.micro_batches} micro-batches; {m['cpu']}, {m['cores']} cores, commit {commit()}")
    print("\n".join(table(models, seconds, args)))


if __name__ == "__main__":
    main()
