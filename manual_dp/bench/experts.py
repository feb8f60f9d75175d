"""`python -m manual_dp.bench.experts`: tokens/s of expert parallelism against replicated experts.

The MoE GPT (--experts E, top-1, capacity factor 1) on each count of CPU contexts in --cpus, every
run from the same parameters on one random batch of byte windows: --mode sync (every context holds
every expert: replicated) beside --mode expert with one group of all the contexts (E/N experts a
context) and, on 4 or more, groups of 2 (ep=2 x dp=k/2); the dense GPT of the same blocks (one MLP)
under sync for reference, and sync with the lesson's step (no cached graph, one operator at a time,
as expert parallelism runs its step). The runs take turns for --rounds rounds of --steps steps after one that
warms up (graphs, kernels); each keeps its median.

The all-to-all's share of an EP step: one more pass of each EP run with its groups' exchanges timed
(strategies/expert/exchange.py's send and back), MXNet's engine drained before each and its output
waited for after. The backward's all-to-alls run inside autograd's backward, where they cannot be
drained, and exchange the same bytes back: they are taken to last as long as the forward's, so
share = 2 x the forward's exchanges / that synced step. Prints the machine and commit first; writes
DIR/experts.json.
"""
import json
import time
from pathlib import Path

import numpy as np

from ..cli.options import OneLineParser
from ..cli.output import ends_on_signals, parsed_or_exit
from ..config import CORPUS_SEQ_LEN
from ..fast.runtime import configure, machine
from ..strategies.expert.exchange import ExpertGroup
from .modes import step_seconds

PROG = "python -m manual_dp.bench.experts"


class TimedGroup(ExpertGroup):
    """An ExpertGroup whose send and back are timed with the engine drained around them: `took`
    the seconds, `sent` the bytes that crossed between contexts."""

    def __init__(self, ctx, experts):
        super().__init__(ctx, experts)
        self.took, self.sent = 0.0, 0

    def timed(self, exchange, arrays, crossing):
        import mxnet as mx
        mx.nd.waitall()
        start = time.perf_counter()
        out = exchange()
        for o in out:
            o.wait_to_read()
        self.took += time.perf_counter() - start
        self.sent += crossing * np.dtype(arrays[0].dtype).itemsize
        return out

    def send(self, slots):
        N = self.size
        return self.timed(lambda: super(TimedGroup, self).send(slots), slots, sum(s.size for s in slots) * (N - 1) // N)

    def back(self, outputs, rows):
        per = [o.size // o.shape[1] for o in outputs]                 # E/N * d elements a row
        crossing = sum(p * (o.shape[1] - r) for p, o, r in zip(per, outputs, rows))
        return self.timed(lambda: super(TimedGroup, self).back(outputs, rows), outputs, crossing)


def gpt(args, experts):
    """The GPT of the arguments' sizes on byte windows; its MLPs `experts` experts (0: dense)."""
    from ..datasets import Spec
    from ..models import build
    from ..models.moe import Experts
    spec = Spec((CORPUS_SEQ_LEN,), 256, 256, task="next-token", text="bytes")
    return build("gpt", 1, args.layers, args.d_model, args.heads, None, spec=spec,
                 experts=Experts(experts) if experts else None)


def runs(args, k):
    """{name: strategy} of the compared runs on cpu(0..k-1), each from its model's seed-0 parameters."""
    import mxnet as mx
    from ..strategies.data.data_parallel import DataParallel
    from ..strategies.expert.expert_parallel import ExpertParallel
    ctx, dense, moe = [mx.cpu(i) for i in range(k)], gpt(args, 0), gpt(args, args.experts)
    out = {f"k={k} dense GPT, sync": DataParallel(dense.init_params(0), ctx, "momentum", model=dense),
           f"k={k} MoE, sync (experts replicated)": DataParallel(moe.init_params(0), ctx, "momentum", model=moe),
           f"k={k} MoE, sync, the lesson's step": DataParallel(moe.init_params(0), ctx, "momentum", lesson=True,
                                                              model=moe),
           f"k={k} MoE, expert ep={k}": ExpertParallel(moe.init_params(0), ctx, "momentum", k, model=moe)}
    if k >= 4 and k % 2 == 0 and args.experts % 2 == 0:
        out[f"k={k} MoE, expert ep=2 x dp={k // 2}"] = ExpertParallel(moe.init_params(0), ctx, "momentum", 2, model=moe)
    return out


def exchange_share(model, X, y, steps):
    """{"step_s", "forward_all_to_all_s", "share", "bytes_per_step"} of `steps` steps of the
    ExpertParallel `model` with its groups' exchanges timed (the backward's taken as the forward's)."""
    import mxnet as mx
    model.groups = [TimedGroup(g.ctx, g.experts) for g in model.groups]
    mx.nd.waitall()
    start = time.perf_counter()
    for _ in range(steps):
        model.step(X, y, 0.01)
    mx.nd.waitall()
    step = (time.perf_counter() - start) / steps
    forward = sum(g.took for g in model.groups) / steps
    return {"step_s": step, "forward_all_to_all_s": forward, "share": min(1.0, 2 * forward / step),
            "bytes_per_step": 2 * sum(g.sent for g in model.groups) // steps}


def measure(args, k):
    """{name: {"tokens_per_s", ...}} of the runs on k contexts, EP runs with their exchange's share."""
    from ..memory import random_batch
    models = runs(args, k)
    X, y = random_batch(args.batch, spec=next(iter(models.values())).net.spec)
    secs = step_seconds(models, X, y, args.steps, args.rounds)
    out = {name: {"tokens_per_s": args.batch * CORPUS_SEQ_LEN / s, "step_s": s} for name, s in secs.items()}
    for name, model in models.items():
        if "expert ep=" in name:
            out[name].update(exchange_share(model, X, y, args.steps))
    return out


def parse(argv):
    """The checked arguments; UsageError (one line) for values no run can use."""
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_out", help="directory for experts.json")
    p.add_argument("--experts", type=int, default=4, help="experts of each MoE block (default 4)")
    p.add_argument("--layers", type=int, default=2, help="blocks (default 2)")
    p.add_argument("--d-model", type=int, default=64, help="token width (default 64)")
    p.add_argument("--heads", type=int, default=4, help="heads (default 4)")
    p.add_argument("--batch", type=int, default=32, help="windows a step (default 32)")
    p.add_argument("--steps", type=int, default=2, help="steps per run per round (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="rounds after the warm-up (default 3)")
    p.add_argument("--cpus", default="2,4", help="counts of CPU contexts, comma-separated (default 2,4)")
    args = p.parse_args(argv)
    try:
        args.cpus = [int(c) for c in args.cpus.split(",")]
    except ValueError:
        p.error(f"--cpus takes counts like 2,4, got {args.cpus}")
    if min(args.steps, args.rounds, args.layers) < 1 or args.experts < 2:
        p.error("--steps, --rounds and --layers must be >= 1, --experts >= 2")
    bad = [k for k in args.cpus if not 2 <= k <= 64 or args.experts % k or args.batch < k]
    if bad:
        p.error(f"--cpus {bad[0]}: each count must be 2 to 64, divide --experts {args.experts} and be <= --batch")
    return args


def report(where, args, results):
    """The printed table: tokens/s, each against sync with replicated experts, and the all-to-all's share."""
    print(f"{where['cpu']} ({where['vector']}), {where['cores']} cores, commit {where['commit']}; GPT of "
          f"{args.layers} blocks, d_model {args.d_model}, {args.experts} experts top-1; batch {args.batch} x "
          f"{CORPUS_SEQ_LEN} tokens, median of {args.rounds} rounds of {args.steps} steps")
    for k, rows in results.items():
        base = rows[f"k={k} MoE, sync (experts replicated)"]["tokens_per_s"]
        for name, r in rows.items():
            extra = (f"  all-to-all {100 * r['share']:4.1f}% of the step ({r['bytes_per_step'] / 2 ** 20:.2f} MiB "
                     f"a step)" if "share" in r else "")
            print(f"  {name:36} {r['tokens_per_s']:9.0f} tokens/s  {r['tokens_per_s'] / base:5.2f}x replicated{extra}")


@ends_on_signals(PROG)   # Ctrl-C, SIGTERM, SIGHUP: one line
def main(argv=None):
    args = parsed_or_exit(parse, argv, PROG)
    configure(max(args.cpus), model="gpt")      # thread settings before MXNet loads
    from .command import commit
    where = dict(machine(), commit=commit())
    try:
        results = {k: measure(args, k) for k in args.cpus}
    except ValueError as e:                     # sizes the GPT refuses (heads, width)
        raise SystemExit(f"{PROG}: {e}") from None
    report(where, args, results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "experts.json").write_text(json.dumps(dict(where, layers=args.layers, d_model=args.d_model, heads=args.heads,
                                                      experts=args.experts, batch=args.batch, runs=results), indent=1))


if __name__ == "__main__":
    main()
