"""python -m manual_dp.bench.link: LeNet's synchronous step under emulated links (manual_dp.fast.link),
measured beside the cost model's prediction, on 2 and 4 CPU contexts.

For each context count, link and all-reduce: `plain` the step measured without a link (compute and
the all-reduce through shared memory), `predicted` plain + the cost model's all-reduce of the fused
gradient over the link (LinkSpec.allreduce_seconds: no overlap), `linked` the step measured with the
link, fused; `buckets` the same with --bucket-mb's buckets, whose all-reduces overlap the backward.
Times in ms, the best of `rounds` rounds of `steps` steps (a shared machine is only ever slower).
"""
import argparse
import time

import mxnet as mx
import numpy as np
from mxnet import nd

from ..fast.collectives import make_allreduce
from ..fast.link import EmulatedLink
from ..lesson import init_lenet_params
from ..links import parse_link
from ..strategies.data.data_parallel import DataParallel

BATCH, BUCKET_MB = 256, 0.1          # conv_pad=1 below: the convolutions unpadded (no autotune)


def step_ms(k, allreduce, wire=None, bucket_mb=None, steps=10, rounds=3):
    """Milliseconds per step of LeNet's fast step on cpu(0..k-1), batch BATCH, best of `rounds`."""
    model = DataParallel(init_lenet_params(0), [mx.cpu(i) for i in range(k)], "sgd",
                         make_allreduce(allreduce, wire), conv_pad=1, bucket_mb=bucket_mb)
    rng = np.random.RandomState(0)
    X, y = rng.rand(BATCH, 1, 28, 28).astype(np.float32), rng.randint(0, 10, BATCH).astype(np.int32)
    for _ in range(3):                                  # the graph built, the first steps' costs paid
        model.step(X, y, 0.01)
    nd.waitall()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            model.step(X, y, 0.01)
        nd.waitall()
        best = min(best, (time.perf_counter() - start) / steps)
    return 1e3 * best


def rows(devices, links, algorithms, steps, rounds):
    """One dict per (devices, link, algorithm): plain, predicted, linked and buckets ms."""
    grad_bytes = sum(p.size * 4 for p in init_lenet_params(0))
    out = []
    for k in devices:
        for algorithm in algorithms:
            plain = step_ms(k, algorithm, steps=steps, rounds=rounds)
            for name in links:
                spec = parse_link(name)
                linked, buckets = (step_ms(k, algorithm, EmulatedLink(spec), b, steps, rounds)
                                   for b in (None, BUCKET_MB))
                out.append(dict(devices=k, link=spec.name, algorithm=algorithm, plain=plain, linked=linked,
                                predicted=plain + 1e3 * spec.allreduce_seconds(algorithm, k, grad_bytes),
                                buckets=buckets))
    return out


def format_rows(records):
    lines = [f"{'devices':>7} {'link':8} {'algorithm':13} {'plain':>7} {'predicted':>9} {'linked':>7} "
             f"{'linked/pred':>11} {'buckets':>8}"]
    for r in records:
        lines.append(f"{r['devices']:>7} {r['link']:8} {r['algorithm']:13} {r['plain']:>7.1f} {r['predicted']:>9.1f} "
                     f"{r['linked']:>7.1f} {r['linked'] / r['predicted']:>11.2f} {r['buckets']:>8.1f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m manual_dp.bench.link", description=__doc__.split("\n")[0])
    p.add_argument("--devices", default="2,4", help="context counts (default 2,4)")
    p.add_argument("--links", default="eth1,eth10,pcie3", help="--link values (default eth1,eth10,pcie3)")
    p.add_argument("--algorithms", default="reduce_bcast,ring", help="all-reduces (default reduce_bcast,ring)")
    p.add_argument("--steps", type=int, default=10, help="steps a round (default 10)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the best kept (default 3)")
    a = p.parse_args(argv)
    print(format_rows(rows([int(k) for k in a.devices.split(",")], a.links.split(","), a.algorithms.split(","),
                           a.steps, a.rounds)))


if __name__ == "__main__":
    main()
