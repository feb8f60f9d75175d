"""Measuring all-reduce: microseconds and GB/s per algorithm, payload and context count, beside the
copy bound (one cpu(0) -> cpu(1) copy of the same payload) and the memory floor (k copies at once:
the traffic no all-reduce over k contexts of one memory can avoid). Each function returns one
record (a dict), allreduce_sweep a list of them; the benchmark (python -m manual_dp.bench) and
notebook 02 call them."""
import ctypes
import resource
import time

import mxnet as mx
import numpy as np
from mxnet import nd

from .fast.collectives import make_allreduce
from .lesson import LENET_SHAPES

LENET_SIZES = [int(np.prod(shape)) for _, shape in LENET_SHAPES]   # 129,068 floats, 516 KB


def timed(fn, repeats, calls):
    """Median seconds per call over `repeats` timings of `calls` back-to-back calls; one extra
    timing first, dropped (warm-up). The engine queue is drained before and after each timing."""
    times = []
    for _ in range(repeats + 1):
        nd.waitall()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        nd.waitall()
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times[1:]))


def calls_for(nbytes, budget=4e6):
    """Back-to-back calls per timing: enough to amortise a waitall, bounded for big payloads."""
    return int(max(1, min(100, budget // max(nbytes, 1))))


def copy_bound(nbytes, repeats):
    """Record for one copy of nbytes from cpu(0) to cpu(1): no all-reduce can move data faster."""
    src, dst = nd.zeros((max(1, nbytes // 4),), ctx=mx.cpu(0)), nd.zeros((max(1, nbytes // 4),), ctx=mx.cpu(1))
    t = timed(lambda: src.copyto(dst), repeats, calls_for(nbytes))
    return {"bench": "memcpy", "impl": "copyto", "devices": 2, "bytes": nbytes,
            "us": t * 1e6, "gbps": nbytes / t / 1e9}


def memory_floor(k, nbytes, repeats):
    """Record for k copies of nbytes at once, cpu(i) -> cpu(i) on every context's own worker.

    CPU contexts share one memory bus, and any all-reduce must at least read every replica once
    and write every replica once: k copies' worth of traffic. Its bus bandwidth (as for an
    all-reduce) is the best any algorithm could score here at k contexts.
    """
    n = max(1, nbytes // 4)
    src = [nd.zeros((n,), ctx=mx.cpu(i)) for i in range(k)]
    dst = [nd.zeros((n,), ctx=mx.cpu(i)) for i in range(k)]

    def copies():
        for s, d in zip(src, dst):
            s.copyto(d)
    t = timed(copies, repeats, calls_for(nbytes * k))
    return {"bench": "memfloor", "impl": f"{k} copies at once", "devices": k, "bytes": nbytes, "us": t * 1e6,
            "busbw_gbps": nbytes / t / 1e9 * 2 * (k - 1) / k if k > 1 else None}


def allreduce_record(name, k, nbytes, seconds, **extra):
    """The record of all-reducing nbytes over k contexts in `seconds` with algorithm `name`.

    algbw = bytes / time; busbw = algbw * 2(k-1)/k, the traffic per link of an optimal all-reduce,
    which is the figure to hold against the copy bound.
    """
    algbw = nbytes / seconds / 1e9
    return dict({"bench": "allreduce", "impl": name, "devices": k, "bytes": nbytes, "us": seconds * 1e6,
                 "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (k - 1) / k if k > 1 else None}, **extra)


def replicas(k, nbytes):
    """k float32 arrays of nbytes, one on each of cpu(0..k-1)."""
    return [nd.zeros((max(1, nbytes // 4),), ctx=mx.cpu(i)) for i in range(k)]


def allreduce_point(name, k, nbytes, repeats):
    """Record for all-reducing one float32 array of nbytes over cpu(0..k-1) with algorithm `name`."""
    arrays, fn = replicas(k, nbytes), make_allreduce(name)
    return allreduce_record(name, k, nbytes, timed(lambda: fn(arrays), repeats, calls_for(nbytes * k)))


SETTLE_CALLS = 12     # warm-up calls at most, until one faults as many pages as the one before
FRESH_FROM = 1 << 20  # bytes from which an allocation is mapped fresh and returned on free (fresh_pages)
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def page_faults():
    """Minor page faults of this process so far: pages the kernel mapped in on first touch."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def fresh_pages():
    """Afterwards (for the rest of the process) glibc maps an allocation of FRESH_FROM bytes or more
    that no free chunk holds fresh, and returns it on free, whatever was freed before (a fixed mmap
    threshold); True where the C library took it (glibc's mallopt).

    An algorithm that copies into new arrays (the lesson's `copyto`) asks for memory every call.
    With glibc's default, whether that memory is new pages depends on the process's history: its
    mmap threshold moves with what was freed before, the heap's top is trimmed or not, and MXNet's
    aligned requests (posix_memalign) do not fit the chunk the last copy freed, so the heap may grow
    for many calls. Measured: the lesson's 16 MB all-reduce on 2 contexts took 3.0 ms in one process
    and 10.3 ms in another (4,096 page faults a call), and after the bench's training every call
    faulted. A fixed threshold takes the history away: such an algorithm pays its fresh pages every
    call, in every process (e.g. 4,097 faults a call at 16 MB on 2 contexts, 28,679 on 8)."""
    try:
        return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, FRESH_FROM))
    except (OSError, AttributeError):          # not glibc: the allocator's history stays in the timings
        return False


def settle(fn):
    """Call fn (draining the engine) until a call faults as many pages as the one before (the
    allocator in its steady state: none, or an algorithm's fresh pages every call), at most
    SETTLE_CALLS times."""
    last = None
    for _ in range(SETTLE_CALLS):
        before = page_faults()
        fn()
        nd.waitall()
        faults = page_faults() - before
        if faults == last:
            return
        last = faults


def allreduce_sweep(names, ks, payloads, rounds):
    """Records for every (algorithm, contexts, payload), in interleaved rounds: each round times
    every point once (fresh replicas, warm-up calls until the heap is steady (settle), then
    calls_for(...) calls back to back), and a record's us is the median over the rounds, its
    page_faults the median per call. On a shared machine a neighbour's burst of work then falls on
    one round of many points rather than on every repeat of a few. The allocator is set first
    (fresh_pages), so that no point's time depends on what the process did before."""
    fresh_pages()
    points = [(name, k, b) for k in ks for name in names for b in payloads]
    times, faults = {p: [] for p in points}, {p: [] for p in points}
    for _ in range(rounds):
        for name, k, nbytes in points:
            arrays, fn = replicas(k, nbytes), make_allreduce(name)
            settle(lambda: fn(arrays))
            calls = calls_for(nbytes * k)
            nd.waitall()
            before, start = page_faults(), time.perf_counter()
            for _ in range(calls):
                fn(arrays)
            nd.waitall()
            times[name, k, nbytes].append((time.perf_counter() - start) / calls)
            faults[name, k, nbytes].append((page_faults() - before) / calls)
    return [allreduce_record(name, k, b, float(np.median(times[name, k, b])), rounds=rounds,
                             page_faults=float(np.median(faults[name, k, b]))) for name, k, b in points]


def lenet_point(name, k, fused, repeats):
    """Record for all-reducing LeNet's 8 gradients over k contexts, one call each or fused into one."""
    sizes = [sum(LENET_SIZES)] if fused else LENET_SIZES
    grads = [[nd.zeros((n,), ctx=mx.cpu(i)) for n in sizes] for i in range(k)]
    fn = make_allreduce(name)

    def reduce_all():
        for j in range(len(sizes)):
            fn([g[j] for g in grads])
    t = timed(reduce_all, repeats, 20)
    return {"bench": "allreduce_lenet", "impl": name, "fused": fused, "devices": k,
            "bytes": 4 * sum(LENET_SIZES), "us": t * 1e6}
