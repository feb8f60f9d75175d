"""python -m manual_dp.bench.link: LeNet's synchronous step under emulated links (manual_dp.fast.link),
measured beside the cost model's prediction, on 2 and 4 CPU contexts.

For each context count, link and all-reduce: `plain` the step measured without a link (compute and
the all-reduce through shared memory), `predicted` plain + the cost model's all-reduce of the fused
gradient over the link (LinkSpec.allreduce_seconds: no overlap), `linked` the step measured with the
link, fused; `buckets` the same with --bucket-mb's buckets, whose all-reduces overlap the backward.
Times in ms, the best of `rounds` rounds of `steps` steps, the three taking turns (a shared machine
is only ever slower). Each emulated transfer costs some 0.3-0.7 ms of its own (the operator's Python
call on MXNet's thread; measured on 2026-11-28), so a link whose hop takes less (pcie3 and faster,
for LeNet's 0.5 MB) is not resolved: its rows measure that floor, not the link. --zero: sync (ring,
fused) beside ZeRO stages 1 and 3 (their ring reduce-scatters and all-gathers), plain and linked.
"""
import argparse
import itertools
import time

import mxnet as mx
import numpy as np
from mxnet import nd

from ..errors import UsageError
from ..fast.collectives import make_allreduce
from ..fast.link import EmulatedLink
from ..lesson import init_lenet_params
from ..links import parse_link
from ..strategies.data.data_parallel import DataParallel
from ..strategies.zero.zero import ZeroRedundancy

BATCH, BUCKET_MB = 256, 0.1          # conv_pad=1 below: the convolutions unpadded (no autotune)


def stepper(k, allreduce, wire=None, bucket_mb=None, zero_stage=None):
    """One step of LeNet's fast step on cpu(0..k-1), batch BATCH, as a function; 3 steps taken.
    zero_stage: ZeRO of that stage instead, its ring collectives over `wire`."""
    ctx = [mx.cpu(i) for i in range(k)]
    model = ZeroRedundancy(init_lenet_params(0), ctx, "sgd", zero_stage, wire=wire) if zero_stage else \
        DataParallel(init_lenet_params(0), ctx, "sgd", make_allreduce(allreduce, wire), conv_pad=1, bucket_mb=bucket_mb)
    rng = np.random.RandomState(0)
    X, y = rng.rand(BATCH, 1, 28, 28).astype(np.float32), rng.randint(0, 10, BATCH).astype(np.int32)
    for _ in range(3):                                  # the graph built, the first steps' costs paid
        model.step(X, y, 0.01)
    nd.waitall()
    return lambda: model.step(X, y, 0.01)


def best_ms(steppers, steps, rounds):
    """Milliseconds per step of each stepper, the best of `rounds` rounds of `steps` steps, the
    steppers taking turns round by round (a load that comes and goes falls on all of them)."""
    best = [float("inf")] * len(steppers)
    for _ in range(rounds):
        for i, step in enumerate(steppers):
            start = time.perf_counter()
            for _ in range(steps):
                step()
            nd.waitall()
            best[i] = min(best[i], 1e3 * (time.perf_counter() - start) / steps)
    return best


def rows(devices, links, algorithms, steps, rounds):
    """One dict per (devices, link, algorithm): plain, predicted, linked and buckets ms."""
    grad_bytes = sum(p.size * 4 for p in init_lenet_params(0))
    out = []
    for k, algorithm, name in itertools.product(devices, algorithms, links):
        spec = parse_link(name)
        plain, linked, buckets = best_ms([stepper(k, algorithm), stepper(k, algorithm, EmulatedLink(spec)),
                                          stepper(k, algorithm, EmulatedLink(spec), BUCKET_MB)], steps, rounds)
        out.append(dict(devices=k, link=spec.name, algorithm=algorithm, plain=plain, linked=linked,
                        predicted=plain + 1e3 * spec.allreduce_seconds(algorithm, k, grad_bytes), buckets=buckets))
    return out


def zero_rows(devices, links, steps, rounds):
    """Per (devices, link): ms per step of sync (ring, fused) and ZeRO stages 1 and 3, plain and linked."""
    out = []
    for k, name in itertools.product(devices, links):
        wire = EmulatedLink(parse_link(name))
        plain = best_ms([stepper(k, "ring", zero_stage=z) for z in (None, 1, 3)], steps, rounds)
        linked = best_ms([stepper(k, "ring", wire, zero_stage=z) for z in (None, 1, 3)], steps, rounds)
        out.append(f"{k:>7} {parse_link(name).name:18} " + " ".join(f"{a:>7.1f} {b:>7.1f}" for a, b in zip(plain, linked)))
    return "\n".join([f"{'devices':>7} {'link':18} {'sync':>7} {'linked':>7} {'zero1':>7} {'linked':>7} "
                      f"{'zero3':>7} {'linked':>7}"] + out)


def format_rows(records):
    lines = [f"{'devices':>7} {'link':18} {'algorithm':13} {'plain':>7} {'predicted':>9} {'linked':>7} "
             f"{'linked/pred':>11} {'buckets':>8}"]
    for r in records:
        lines.append(f"{r['devices']:>7} {r['link']:18} {r['algorithm']:13} {r['plain']:>7.1f} {r['predicted']:>9.1f} "
                     f"{r['linked']:>7.1f} {r['linked'] / r['predicted']:>11.2f} {r['buckets']:>8.1f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m manual_dp.bench.link", description=__doc__.split("\n")[0])
    p.add_argument("--devices", default="2,4", help="context counts (default 2,4)")
    p.add_argument("--links", nargs="+", default=["eth1", "eth10", "pcie3"], metavar="LINK",
                   help="--link values, a preset or GBPS,LATENCY_US each (default eth1 eth10 pcie3)")
    p.add_argument("--algorithms", default="reduce_bcast,ring", help="all-reduces (default reduce_bcast,ring)")
    p.add_argument("--steps", type=int, default=10, help="steps a round (default 10)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the best kept (default 5)")
    p.add_argument("--zero", action="store_true", help="sync (ring) beside ZeRO stages 1 and 3, plain and "
                                                       "linked, instead (ms per step)")
    a = p.parse_args(argv)
    try:
        for name in a.links:
            parse_link(name)
    except UsageError as e:
        p.error(str(e))
    devices = [int(k) for k in a.devices.split(",")]
    print(zero_rows(devices, a.links, a.steps, a.rounds) if a.zero else
          format_rows(rows(devices, a.links, a.algorithms.split(","), a.steps, a.rounds)))


if __name__ == "__main__":
    main()
