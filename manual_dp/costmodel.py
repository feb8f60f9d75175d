"""Cost model of a data-parallel step: compute, then an all-reduce priced as

    time = alpha * messages + beta * bytes over the busiest link + gamma * bytes added by one device

(alpha: latency per message, beta: seconds per byte of the link, gamma: seconds per byte summed),
fitted to the measured all-reduce figures and extrapolated to other links and device counts.
This is the form for links (LINKS); CPU contexts of one machine, which share its memory and cores,
have a form of their own (manual_dp.costmodel_cpu).
"""
import itertools
import math
from collections import namedtuple

import numpy as np

# Stated link assumptions: (latency per message in s, bandwidth in bytes/s).
LINKS = {
    "PCIe 3.0 x16": (10e-6, 12e9),
    "NVLink (V100)": (5e-6, 150e9),
    "25 Gb/s Ethernet": (50e-6, 25e9 / 8),
    "100 Gb/s Ethernet": (20e-6, 100e9 / 8),
}

# A workload: gradient bytes and arrays, compute per step = fixed_s + per_image_s * images per device.
Workload = namedtuple("Workload", "name bytes arrays fixed_s per_image_s batch")
WORKLOADS = {
    # LeNet on a GPU is launch-bound: ~2 ms a step whatever the batch (stated assumption).
    "LeNet": Workload("LeNet", 516_272, 8, 2e-3, 1e-6, 256),
    # ResNet-50 fp32 on a V100: ~400 images/s, 32 images per device (stated assumption).
    "ResNet-50": Workload("ResNet-50", 102_228_128, 161, 5e-3, 2.5e-3, 32),
}


def terms(algorithm, k, n):
    """(messages on the critical path, bytes over the busiest link, bytes added by the busiest device)
    of all-reducing n bytes over k devices."""
    if k <= 1:
        return 0.0, 0.0, 0.0
    if algorithm in ("ring", "scatter_gather"):
        # scatter_gather: each device takes in k-1 chunks of n/k per half through its one port, as
        # in the ring; that its chunks could arrive at once (NVSwitch, shared memory) is not credited
        return 2 * (k - 1), 2 * (k - 1) / k * n, (k - 1) / k * n
    if algorithm == "tree":
        rounds = math.ceil(math.log2(k))
        return 2 * rounds, 2 * rounds * n, rounds * n
    if algorithm in ("lesson", "reduce_bcast", "kvstore", "prepared"):  # everything through device 0
        return 2 * (k - 1), 2 * (k - 1) * n, (k - 1) * n
    raise ValueError(f"no cost model for allreduce {algorithm!r}")


def message_time(n, alpha, beta):
    """Seconds one message of n bytes takes over one link: alpha + beta * n (the all-reduce's terms
    for a single hop; manual_dp.fast.link delays every emulated transfer by it)."""
    return alpha + beta * n


def allreduce_time(algorithm, k, n, alpha, beta, gamma=0.0):
    """Seconds to all-reduce n bytes over k devices: its messages' alpha + beta * bytes, plus gamma."""
    m, b, a = terms(algorithm, k, n)
    return m * message_time(b / m, alpha, beta) + gamma * a if m else 0.0


def fit(points, algorithm):
    """(alpha, beta, 0.0), alpha and beta >= 0, minimising the relative error over points
    [(k, bytes, seconds)] of one algorithm.

    In every algorithm here a device adds half as many bytes as cross its busiest link, so gamma
    cannot be told apart from beta: the fitted beta is the combined cost, beta + gamma / 2.
    Each subset of the unknowns is solved by least squares and the best non-negative solution
    kept (an exact non-negative least squares for this size).
    """
    rows = np.array([terms(algorithm, k, n)[:2] for k, n, _ in points], dtype=float)
    t = np.array([s for _, _, s in points], dtype=float)
    A, b = rows / t[:, None], np.ones(len(t))           # relative error: A x / t - 1
    best, best_err = np.zeros(2), np.inf
    for cols in ((0,), (1,), (0, 1)):
        x_sub, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
        if (x_sub < 0).any():
            continue
        x = np.zeros(2)
        x[list(cols)] = x_sub
        err = float(np.sum((A @ x - b) ** 2))
        if err < best_err:
            best, best_err = x, err
    return float(best[0]), float(best[1]), 0.0


def comm_time(w, k, alpha, beta, gamma=0.0, algorithm="ring", fused=True):
    """Seconds per step spent all-reducing w's gradients: once fused, else once per array."""
    arrays = 1 if fused else w.arrays
    return arrays * allreduce_time(algorithm, k, w.bytes / arrays, alpha, beta, gamma)


def step_time(w, k, alpha, beta, gamma=0.0, algorithm="ring", fused=True, scaling="weak"):
    """Seconds per step of workload w on k devices, compute then all-reduce (no overlap).
    weak: w.batch images per device; strong: w.batch images in all, split over the devices."""
    images = w.batch if scaling == "weak" else w.batch / k
    return w.fixed_s + w.per_image_s * images + comm_time(w, k, alpha, beta, gamma, algorithm, fused)


def efficiency(w, k, alpha, beta, gamma=0.0, algorithm="ring", fused=True, scaling="weak"):
    """Throughput on k devices over k times that on one: T1/Tk (weak), T1/(k Tk) (strong)."""
    t1 = step_time(w, 1, alpha, beta, gamma, algorithm, fused, scaling)
    tk = step_time(w, k, alpha, beta, gamma, algorithm, fused, scaling)
    return t1 / tk if scaling == "weak" else t1 / (k * tk)


def table(devices=(8, 64, 1024), algorithms=("ring", "tree", "reduce_bcast"), scaling="weak"):
    """Rows (workload, link, algorithm, devices, step ms, comm ms, efficiency) for the stated links."""
    rows = []
    for w, (link, (alpha, bw)), alg, k in itertools.product(WORKLOADS.values(), LINKS.items(),
                                                            algorithms, devices):
        rows.append({"workload": w.name, "link": link, "algorithm": alg, "devices": k,
                     "step_ms": 1e3 * step_time(w, k, alpha, 1 / bw, 0.0, alg, True, scaling),
                     "comm_ms": 1e3 * comm_time(w, k, alpha, 1 / bw, 0.0, alg, True),
                     "efficiency": efficiency(w, k, alpha, 1 / bw, 0.0, alg, True, scaling)})
    return rows


def format_table(rows):
    lines = [f"{'workload':10} {'link':18} {'algorithm':12} {'devices':>7} {'step ms':>9} "
             f"{'comm ms':>9} {'efficiency':>10}"]
    for r in rows:
        lines.append(f"{r['workload']:10} {r['link']:18} {r['algorithm']:12} {r['devices']:>7} "
                     f"{r['step_ms']:>9.2f} {r['comm_ms']:>9.2f} {r['efficiency']:>10.3f}")
    return "\n".join(lines)


def bucketed_schedule(forward_s, backward_s, bucket_bytes, k, alpha, beta, gamma=0.0, algorithm="ring"):
    """The predicted timeline of a step whose gradients are all-reduced in buckets: forward, then
    backward producing bucket b after backward_s[0] + ... + backward_s[b]; one all-reduce at a
    time on the link, each starting once its bucket is ready and the previous one is done (one
    bucket holding everything: no overlap). Times in s from the step's start:
    {"forward": (s, e), "backward": [(s, e)], "allreduce": [(s, e)], "step_s", "overlap"}, where
    overlap is the share of all-reduce time hidden under forward and backward."""
    ready = forward_s + np.cumsum(backward_s)
    starts = np.concatenate([[forward_s], ready[:-1]])
    comm, free = [], 0.0
    for r, n in zip(ready, bucket_bytes):
        start = max(r, free)
        free = start + allreduce_time(algorithm, k, n, alpha, beta, gamma)
        comm.append((float(start), float(free)))
    compute_end = float(ready[-1]) if len(ready) else forward_s
    total = sum(e - s for s, e in comm)
    hidden = sum(max(0.0, min(e, compute_end) - s) for s, e in comm)
    return {"forward": (0.0, forward_s), "backward": [(float(a), float(b)) for a, b in zip(starts, ready)],
            "allreduce": comm, "step_s": max([compute_end] + [e for _, e in comm]),
            "overlap": hidden / total if total > 0 else 0.0}


def overlap_prediction(w, k, alpha, beta, bucket_bytes, algorithm="ring", backward_share=2 / 3):
    """(step s without buckets, step s with buckets of `bucket_bytes`, share of communication hidden)
    for workload w on k devices (weak scaling). Stated assumptions: backward is `backward_share` of
    the compute and produces the gradient bytes at an even rate."""
    compute = w.fixed_s + w.per_image_s * w.batch
    n = max(1, math.ceil(w.bytes / bucket_bytes)) if bucket_bytes > 0 else w.arrays
    sizes = [w.bytes / n] * n
    forward, backward = compute * (1 - backward_share), [compute * backward_share / n] * n
    one = bucketed_schedule(forward, [compute * backward_share], [w.bytes], k, alpha, beta, 0.0, algorithm)
    many = bucketed_schedule(forward, backward, sizes, k, alpha, beta, 0.0, algorithm)
    return one["step_s"], many["step_s"], many["overlap"]
