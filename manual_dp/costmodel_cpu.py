"""Cost model of an all-reduce over CPU contexts of one machine: the kind of link where the
"devices" share one memory and a few cores. Nothing crosses a wire, and manual_dp.costmodel's link
form (alpha per message on the critical path + beta per byte over the busiest link) fitted to this
machine's measurements missed by 38-85% (docs/performance.md). The form here prices what runs:

    time = c + max(alpha * calls, latency * calls + moved * (beta_cache * s + beta_memory * (1 - s)))
    s = min(1, last-level cache bytes / footprint)

  calls        engine operations (adds and copies) one all-reduce makes
  alpha        seconds per call for Python to issue it (argument parsing, wrappers, the C call)
  latency      seconds per call for the engine to run it beside its bytes (a worker thread taking
               it up once the operation it waits for is done)
  moved        bytes the operations read and write: an add of two arrays into one moves 3n, a copy
               2n; MXNet's add_n reads its m arrays in one pass up to m = 4, beyond that copies the
               first and adds each other one in a pass of its own (add_n_moves)
  footprint    bytes one all-reduce touches: the replicas and any buffer of the algorithm's own
  s            the share of the footprint the last-level cache holds (its size read from
               /sys/devices/system/cpu/cpu0/cache, not fitted): those bytes move at cache speed
               (beta_cache s/byte), the rest at main memory's (beta_memory)
  c            seconds per all-reduce besides: the shape checks, reshapes and chunk views, the
               wait for the last operation

The max: operations are issued by one Python thread while the engine runs the ones before, so
back to back (as measured, and as a training step calls them) an all-reduce costs the slower of
the two. Small payloads are bound by issuing, and their bytes cost nothing (measured: 64 KB no
slower than 4 KB); large ones by the engine. The engine's operations run one after another: MXNet
orders operations per array and each algorithm here chains them (the ring's transfer i -> i+1
writes the array that i+1 -> i+2 reads; reduce_bcast's copies all read the first replica), so
their costs add up whatever the core count. The tree's pairs in one round could run side by side,
but beyond the cache they share one memory bus: no term for contexts beyond the cores.

Five parameters per algorithm, fitted by `fit` to the 15 points (3 context counts x 5 payloads)
of `python -m manual_dp.bench --quick` so that the worst relative error is least.
"""
from pathlib import Path

import numpy as np

from .config import CACHE_BYTES_UNKNOWN
from .minimax import minimax

PARAMETERS = ("c", "alpha", "latency", "beta_cache", "beta_memory")
CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


def add_n_moves(m):
    """Bytes (in arrays) MXNet's add_n of m arrays into one reads and writes on CPU."""
    return m + 1 if m <= 4 else 2 + 3 * (m - 1)


# algorithm: k -> (engine calls, bytes moved / n, footprint / n) of one all-reduce over k contexts.
LEDGER = {
    # per other replica: a copy to the first context, an add into it, a copy back; one copy in flight
    "lesson": lambda k: (3 * (k - 1), 7 * (k - 1), k + 1),
    # one add_n of the k replicas on the first context, k-1 copies back
    "reduce_bcast": lambda k: (k, add_n_moves(k) + 2 * (k - 1), k),
    "prepared": lambda k: (k, add_n_moves(k) + 2 * (k - 1), k),
    # kvstore('device'): replica 0 and k-1 copies into the store's buffers, add_n, k copies out
    "kvstore": lambda k: (2 * k + 1, 4 * k + add_n_moves(k), 2 * k),
    # 2(k-1) steps of k transfers of n/k: k(k-1) adds (3 n/k each), k(k-1) copies (2 n/k each)
    "ring": lambda k: (2 * k * (k - 1), 5 * (k - 1), k),
    # k-1 pairwise adds up the tree (3n each), k-1 copies down (2n each)
    "tree": lambda k: (2 * (k - 1), 5 * (k - 1), k),
    # k add_n of k chunks of n/k, then k(k-1) copies of n/k
    "scatter_gather": lambda k: (k * k, add_n_moves(k) + 2 * (k - 1), k),
}


def cache_bytes(cache_dir=CACHE_DIR):
    """Size of the largest (last-level) data or unified cache cpu0 sees, from `cache_dir`;
    CACHE_BYTES_UNKNOWN where that directory does not say (not Linux, a container hiding it)."""
    sizes = []
    for index in Path(cache_dir).glob("index*"):
        try:
            kind, size = (index / "type").read_text().strip(), (index / "size").read_text().strip()
        except OSError:
            continue
        digits, unit = size.rstrip("KMGkmg"), size[len(size.rstrip("KMGkmg")):].upper()
        if kind in ("Data", "Unified") and digits.isdigit() and unit in ("", "K", "M", "G"):
            sizes.append(int(digits) << {"": 0, "K": 10, "M": 20, "G": 30}[unit])
    return max(sizes) if sizes else CACHE_BYTES_UNKNOWN


def terms(algorithm, k, n, cache):
    """(issuing, running): the two rows of coefficients whose products with the parameters
    (c, alpha, latency, beta_cache, beta_memory) are c + Python's and c + the engine's seconds for
    all-reducing n bytes over k contexts under a last-level cache of `cache` bytes."""
    if algorithm not in LEDGER:
        raise ValueError(f"no CPU cost model for allreduce {algorithm!r}")
    if k <= 1:
        return np.zeros(5), np.zeros(5)
    calls, moved, footprint = LEDGER[algorithm](k)
    share = min(1.0, cache / (footprint * n)) if n > 0 else 1.0
    return (np.array([1.0, calls, 0.0, 0.0, 0.0]),
            np.array([1.0, 0.0, calls, moved * n * share, moved * n * (1 - share)]))


def allreduce_time(algorithm, k, n, params, cache):
    """Seconds to all-reduce n bytes over k CPU contexts; params as PARAMETERS (0 for k <= 1)."""
    issuing, running = terms(algorithm, k, n, cache)
    return float(max(issuing @ params, running @ params))


def fit(points, algorithm, cache):
    """PARAMETERS, all >= 0, minimising the worst relative error |predicted / measured - 1| over
    points [(k, bytes, seconds)] of one algorithm.

    With each point known to be bound by issuing or by running, the model is linear and the best
    fit is a linear programme (minimax.minimax). Points are tried bound by issuing up to each
    payload per call, the rest by running; each split is refitted, with every point moved to the
    side the fitted parameters make slower, until it no longer changes; the best fit is kept.
    """
    t = np.array([s for _, _, s in points], dtype=float)
    rows = [terms(algorithm, k, n, cache) for k, n, _ in points]
    issuing = np.array([i for i, _ in rows]) / t[:, None]
    running = np.array([r for _, r in rows]) / t[:, None]
    per_call = [LEDGER[algorithm](k)[1] * n / LEDGER[algorithm](k)[0] for k, n, _ in points]
    best, best_err = np.zeros(5), np.inf
    for cut in range(len(points) + 1):
        bound = np.zeros(len(points), dtype=bool)
        bound[np.argsort(per_call, kind="stable")[:cut]] = True
        seen = set()
        while bound.tobytes() not in seen:
            seen.add(bound.tobytes())
            x, _ = minimax(np.where(bound[:, None], issuing, running))
            err = float(np.abs(np.maximum(issuing @ x, running @ x) - 1).max())
            if err < best_err:
                best, best_err = x, err
            bound = issuing @ x >= running @ x
    return tuple(float(v) for v in best)


def worst_error(points, algorithm, params, cache):
    """max |predicted / measured - 1| over points [(k, bytes, seconds)]."""
    return max(abs(allreduce_time(algorithm, k, n, params, cache) / t - 1) for k, n, t in points)
