"""`python -m manual_dp.bench.modes`: images/s of every mode side by side, in one run.

Every strategy is built on the same CPU contexts from the same parameters of `--model` (any model of
the contract; layouts it refuses are left out, with the reason) and takes `--steps` momentum steps
on one random batch, the strategies taking turns for `--rounds` rounds (round 0
warms up: graphs, kernels); the median of each is kept and divided by sync's. CPU contexts share
the machine's cores, so no mode is expected to beat sync here: the table is each mode's overhead.
Prints one line per mode and writes DIR/modes.json with the machine and commit.
"""
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from ..checks import check_model
from ..cli.options import OneLineParser
from ..cli.output import ends_on_signals, parsed_or_exit
from ..config import CORPUS_SEQ_LEN, NEXT_TOKEN_MODELS, TRANSFORMER, RunConfig
from ..errors import UsageError
from ..fast.runtime import configure, machine


def strategies(ctx, net=None):
    """{name: make(params)} of every mode on the contexts `ctx` (None: the names for 4), for the
    models.Model `net` (None: LeNet of the parameters' width). Tensor x data and hybrid need an even
    count of 4 or more."""
    from ..strategies.data.async_dp import AsyncDataParallel
    from ..strategies.context.context import ContextParallel
    from ..strategies.mesh.mesh_parallel import MeshParallel
    from ..strategies.data.data_parallel import DataParallel
    from ..strategies.sums.fixed_sums import FixedSums
    from ..strategies.data.local_sgd import LocalSGD
    from ..strategies.expert.expert_parallel import ExpertParallel
    from ..strategies.pipeline.pipeline import PipelineParallel
    from ..strategies.tensor.tensor import TensorParallel
    from ..strategies.zero.zero import ZeroRedundancy
    opt, m, k = "momentum", dict(model=net), len(ctx) if ctx else 4
    modes = {
        "sync (fast step)": lambda p: DataParallel(p, ctx, opt, **m),
        "sync (the lesson's step)": lambda p: DataParallel(p, ctx, opt, lesson=True, **m),
        "deterministic": lambda p: DataParallel(p, ctx, opt, sums=FixedSums(), **m),
        "async S=1": lambda p: AsyncDataParallel(p, ctx, opt, staleness=1, **m),
        "local H=4": lambda p: LocalSGD(p, ctx, opt, sync_every=4, **m),
        "zero stage 1": lambda p: ZeroRedundancy(p, ctx, opt, stage=1, **m),
        "zero stage 2": lambda p: ZeroRedundancy(p, ctx, opt, stage=2, **m),
        "zero stage 3": lambda p: ZeroRedundancy(p, ctx, opt, stage=3, **m),
        f"tensor T={k}": lambda p: TensorParallel(p, ctx, opt, **m),
        f"model S={k}": lambda p: PipelineParallel(p, ctx, opt, 1, stages=k, **m),
        f"pipeline S={k} gpipe M=4": lambda p: PipelineParallel(p, ctx, opt, 4, stages=k, **m),
        f"pipeline S={k} 1f1b M=4": lambda p: PipelineParallel(p, ctx, opt, 4, stages=k, schedule="1f1b", **m),
    }
    if k >= 4 and k % 2 == 0:
        modes[f"tensor T=2 x data {k // 2}"] = lambda p: TensorParallel(p, ctx, opt, 2, **m)
        modes[f"hybrid 2x{k // 2} M=4"] = lambda p: PipelineParallel(p, ctx, opt, 4, **m)
        modes[f"mesh dp={k // 4 or 1} x pp=2 x tp=2 1f1b M=4"] = lambda p: MeshParallel(p, ctx, opt, 2, 2, 4, **m)
    modes[f"context cp={k} ring"] = lambda p: ContextParallel(p, ctx, opt, k, **m)    # models with a sequence
    modes[f"expert ep={k}"] = lambda p: ExpertParallel(p, ctx, opt, k, **m)          # models with experts
    return modes


def speed(net, batch, steps, rounds, cpus=4):
    """({mode: median images/s} over `rounds` turns of `steps` steps each, on cpu(0..cpus-1),
    {mode: why it was left out}) for the models.Model `net`."""
    import mxnet as mx
    ctx = [mx.cpu(i) for i in range(cpus)]
    models, left_out = {}, {}
    for name, make in strategies(ctx, net).items():
        try:
            models[name] = make(net.init_params(0))
        except ValueError as e:                   # a layout this model refuses: more stages than layers, ...
            left_out[name] = str(e)
    return take_turns(models, batch, steps, rounds), left_out


def take_turns(models, batch, steps, rounds):
    """{name: median images/s} of each model's `steps` steps on one random batch of `batch`, the
    models taking turns for `rounds` rounds after one that warms up (graphs, kernels)."""
    rng = np.random.RandomState(0)
    X, y = rng.rand(batch, 1, 28, 28).astype(np.float32), rng.randint(0, 10, batch).astype(np.int32)
    return {name: batch / s for name, s in step_seconds(models, X, y, steps, rounds).items()}


def step_seconds(models, X, y, steps, rounds):
    """{name: median seconds a step} of each model's `steps` steps on (X, y), the models taking
    turns for `rounds` rounds after one that warms up."""
    import mxnet as mx
    times = {name: [] for name in models}
    for r in range(rounds + 1):
        for name, model in models.items():
            start = time.perf_counter()
            for _ in range(steps):
                model.step(X, y, 0.01)
            mx.nd.waitall()
            if r:
                times[name].append((time.perf_counter() - start) / steps)
    return {name: float(np.median(t)) for name, t in times.items()}


def parse(argv):
    """The checked arguments; UsageError (one line) for values no run can use."""
    return parse_bench(argv, "python -m manual_dp.bench.modes", __doc__, "modes.json", cpus=4, least=2)


def parse_bench(argv, prog, doc, output, cpus, least):
    """The checked arguments of a bench that times a model on --cpus contexts (default `cpus`, at
    least `least`, at most 64); UsageError (one line) for values no run can use."""
    parser = model_parser(prog, doc, output)
    parser.add_argument("--cpus", type=int, default=cpus, help=f"CPU contexts (default {cpus}; {least} to 64)")
    args = checked(parser, parser.parse_args(argv))
    if not least <= args.cpus <= 64:
        parser.error(f"--cpus must be {least} to 64, got {args.cpus}")
    return args


def model_parser(prog, doc, output):
    """The parser of a bench that times a model: --out, the model's flags, --batch, --steps, --rounds."""
    parser = OneLineParser(prog=prog, description=doc.split("\n")[0])
    parser.add_argument("--out", default="bench_out", help=f"directory for {output}")
    add_model_flags(parser)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="steps per mode per round")
    parser.add_argument("--rounds", type=int, default=3)
    return parser


def add_model_flags(parser):
    """--model and its sizes, as the trainer takes them."""
    parser.add_argument("--model", default=RunConfig.model, help="lenet, mlp, transformer, resnet, gpt (on byte windows) or PATH.py:FUNCTION")
    parser.add_argument("--width", type=int, default=RunConfig.width, help="lenet, mlp, resnet: width")
    for flag, help in (("--layers", "transformer: blocks"), ("--d-model", "transformer: token width"),
                       ("--heads", "transformer: heads"), ("--patch", "transformer: P x P patch tokens")):
        parser.add_argument(flag, type=int, help=f"{help} (default {TRANSFORMER[flag[2:].replace('-', '_')]})")


def checked(parser, args):
    """args, or UsageError (one line) for values no run can use."""
    if min(args.width, args.steps, args.rounds) < 1 or args.batch < 4:
        parser.error("--width, --steps and --rounds must be >= 1, --batch >= 4")
    return checked_model(args)


def checked_model(args):
    """args, or UsageError (one line) if the model flags name no model the trainer would take (a
    language model on Debian's fortunes as a corpus)."""
    data = "fortunes" if args.model in NEXT_TOKEN_MODELS else RunConfig.data
    check_model(dataclasses.replace(RunConfig(), model=args.model, layers=args.layers, d_model=args.d_model,
                                    heads=args.heads, patch=args.patch, data=data))
    return args


def network(args):
    """The models.Model the arguments name (a language model reading byte windows of the corpus's
    default length); UsageError (one line) for sizes it cannot take."""
    from ..datasets import Spec
    from ..models import build
    spec = Spec((CORPUS_SEQ_LEN,), 256, 256, task="next-token", text="bytes") if args.model in NEXT_TOKEN_MODELS else None
    try:
        return build(args.model, args.width, args.layers, args.d_model, args.heads, args.patch, spec=spec)
    except ValueError as e:
        raise UsageError(f"--model {args.model}: {e}") from None


@ends_on_signals("python -m manual_dp.bench.modes")   # Ctrl-C, SIGTERM, SIGHUP: one line
def main(argv=None):
    args = parsed_or_exit(parse, argv, "python -m manual_dp.bench.modes")
    configure(args.cpus, model=args.model)      # thread settings before MXNet loads
    from .command import commit
    where = dict(machine(), commit=commit())
    net = parsed_or_exit(network, args, "python -m manual_dp.bench.modes")
    rates, left_out = speed(net, args.batch, args.steps, args.rounds, args.cpus)
    base = rates["sync (fast step)"]
    print(f"{where['cpu']} ({where['vector']}), {where['cores']} cores, commit {where['commit']}; {args.cpus} CPU "
          f"contexts, {net.name} {net.config}, batch {args.batch}, median of {args.rounds} rounds")
    for name, rate in rates.items():
        print(f"  {name:26} {rate:8.0f} img/s  {rate / base:5.2f}x sync")
    for name, why in left_out.items():
        print(f"  {name:26} left out: {why}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "modes.json").write_text(json.dumps(dict(where, model=net.describe(), width=args.width, batch=args.batch,
                                                    cpus=args.cpus, images_per_sec=rates, left_out=left_out), indent=1))


if __name__ == "__main__":
    main()
