"""python -m manual_dp.bench.straggler: LeNet's images/s under --straggler I:FACTOR, sync beside async
and local SGD, on the same CPU contexts.

Each layout is built as the CLI builds it for LeNet (sync: the fast fused step with --allreduce's
default; async: a master on cpu(0), replicas STALENESS updates stale at most; local: replicas meeting
every H steps), once plain and once wrapped in the Straggler. Steps are taken as the training loop
takes them (manual_dp.loop.run_epoch): the host waits only on the first context's loss LOOKAHEAD steps
back, so whatever the engine's dependencies let run ahead does. Images/s: the best of `rounds`
rounds of `steps` steps (a multiple of every H), the layouts taking turns round by round.

What a straggler can cost here: the math of every layout takes every context's shard of every batch
(async's master applies the sum of all towers' gradients of one batch; local SGD averages every
replica), so the slow context's own chain (its compute, then its delay, step after step) bounds every
layout's throughput. Async lets the others run up to S updates ahead of it and local SGD up to H
steps: they gain what the slow context's delay (a sleep, which holds no core) lets the others'
compute fill, not the delay itself. With --moving the slow context moves on every update (each slow
one step in k): sync still pays the delay every step, while a context of async or local SGD can
catch up in the steps it is fast, as long as its lead allows (S updates, H steps).
"""
import argparse
import collections
import time

import mxnet as mx
import numpy as np
from mxnet import nd

from ..lesson import init_lenet_params
from ..links import parse_straggler
from ..errors import UsageError
from ..strategies.data.async_dp import AsyncDataParallel
from ..strategies.data.data_parallel import DataParallel
from ..strategies.data.local_sgd import LocalSGD
from ..strategies.wrappers.straggler import MEASURED, Straggler

BATCH, LOOKAHEAD, LR = 256, 2, 0.01


def layouts(staleness, sync_every):
    """name: a function of (params, contexts) building that layout for LeNet with sgd."""
    out = {"sync": lambda params, ctx: DataParallel(params, ctx, "sgd", conv_pad=1)}
    for s in staleness:
        out[f"async S={s}"] = lambda params, ctx, s=s: AsyncDataParallel(params, ctx, "sgd", staleness=s)
    for h in sync_every:
        out[f"local H={h}"] = lambda params, ctx, h=h: LocalSGD(params, ctx, "sgd", sync_every=h)
    return out


def stepper(build, k, straggler=None, compute_s=None, moving=False):
    """A function taking `n` steps of the layout `build` on cpu(0..k-1) as the training loop does,
    wrapped in a Straggler(*straggler, compute_s) if given; its first steps taken (and the straggler
    measured, unless compute_s is given)."""
    model = build(init_lenet_params(0), [mx.cpu(i) for i in range(k)])
    model = Straggler(model, *straggler, compute_s=compute_s, moving=moving) if straggler else model
    rng = np.random.RandomState(0)
    X, y = rng.rand(BATCH, 1, 28, 28).astype(np.float32), rng.randint(0, 10, BATCH).astype(np.int32)

    def steps(n):
        pending = collections.deque()
        for _ in range(n):
            pending.append(model.step(X, y, LR)[0][0])       # the first context's loss, as the loop keeps
            if len(pending) > LOOKAHEAD:
                pending.popleft().wait_to_read()
        nd.waitall()

    steps(MEASURED + 1)
    steps.compute_s = model.compute_s if straggler else None
    steps.delay_s = model.delay_s if straggler else 0.0
    return steps


def best_images_per_s(steppers, steps, rounds):
    """Images/s of each stepper, the best of `rounds` rounds of `steps` steps, taking turns."""
    best = [0.0] * len(steppers)
    for _ in range(rounds):
        for i, run in enumerate(steppers):
            start = time.perf_counter()
            run(steps)
            best[i] = max(best[i], steps * BATCH / (time.perf_counter() - start))
    return best


def measure(k, straggler, staleness, sync_every, steps, rounds, moving=False):
    """{layout: (plain images/s, images/s with the straggler, the straggler's delay a step in s)}: every
    layout's straggler given the same compute time, sync's plain step timed warm (each Straggler
    timing its own would give each layout a delay in proportion to its own step)."""
    builds = layouts(staleness, sync_every)
    compute_s = 1 / best_images_per_s([stepper(builds["sync"], k)], steps, 1)[0] * BATCH
    steppers = [stepper(b, k, s, compute_s if s else None, moving) for b in builds.values() for s in (None, straggler)]
    rates = best_images_per_s(steppers, steps, rounds)
    return {name: (rates[2 * i], rates[2 * i + 1], steppers[2 * i + 1].delay_s) for i, name in enumerate(builds)}


def format_rates(rates, straggler, moving=False):
    sync_plain, sync_slow, _ = rates["sync"]
    lines = [f"{'layout':10} {'plain img/s':>11} {'straggler img/s':>15} {'kept':>6} {'vs sync':>8} "
             f"{'vs sync plain':>13} {'delay ms':>8}   (straggler {straggler.context}:{straggler.factor:g}"
             f"{', moving' if moving else ''})"]
    for name, (plain, slow, delay) in rates.items():
        lines.append(f"{name:10} {plain:>11.0f} {slow:>15.0f} {slow / plain:>6.2f} {slow / sync_slow:>8.2f} "
                     f"{slow / sync_plain:>13.2f} {1e3 * delay:>8.1f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m manual_dp.bench.straggler", description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=4, help="CPU contexts (default 4)")
    p.add_argument("--straggler", default="1:3", help="CONTEXT:FACTOR (default 1:3)")
    p.add_argument("--staleness", default="1,3", help="async's staleness values (default 1,3)")
    p.add_argument("--sync-every", default="4", help="local SGD's H values (default 4)")
    p.add_argument("--steps", type=int, default=12, help="steps a round, a multiple of every H (default 12)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the best kept (default 3)")
    p.add_argument("--moving", action="store_true", help="the slow context moves on by one every update "
                                                         "(each is slow one step in DEVICES), the delay the same")
    a = p.parse_args(argv)
    try:
        straggler = parse_straggler(a.straggler, a.devices)
        staleness, sync_every = [int(s) for s in a.staleness.split(",")], [int(h) for h in a.sync_every.split(",")]
    except (UsageError, ValueError) as e:
        p.error(str(e))
    if any(a.steps % h for h in sync_every):
        p.error(f"--steps {a.steps} is not a multiple of every --sync-every ({a.sync_every})")
    print(format_rates(measure(a.devices, straggler, staleness, sync_every, a.steps, a.rounds, a.moving),
                       straggler, a.moving))


if __name__ == "__main__":
    main()
