"""Do two CPU contexts compute at the same time? MXNet's profiler records when every operator
ran on which context; the fraction of one context's busy time during which the other was busy
too answers it, whatever else the machine is doing (a loaded machine stretches both alike)."""
import json
import tempfile
import time
from pathlib import Path

import mxnet as mx
import numpy as np
from mxnet import nd, profiler

from ..fast.collectives import make_allreduce
from ..lesson import init_lenet_params
from ..strategies.data.data_parallel import DataParallel
from ..timeline import busy_intervals, overlap


def run(spec):
    """Record of spec['steps'] steps of the fast trainer on cpu(0), cpu(1): busy and both-busy time."""
    ctx = [mx.cpu(0), mx.cpu(1)]
    o = spec.get("options", {})
    model = DataParallel(init_lenet_params(0), ctx, "sgd", make_allreduce(o.get("allreduce", "lesson")),
                         fuse_grads=o.get("fused", False), graph=o.get("graph", False))
    rng = np.random.RandomState(0)
    X, y = rng.rand(256, 1, 28, 28).astype(np.float32), rng.randint(0, 10, 256).astype(np.int32)
    for _ in range(3):
        model.step(X, y, 0.02)
    nd.waitall()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        profiler.set_config(profile_all=True, aggregate_stats=False, filename=str(path))
        profiler.set_state("run")
        for _ in range(spec["steps"]):
            model.step(X, y, 0.02)
        nd.waitall()
        profiler.set_state("stop")
        profiler.dump()
        trace = json.loads(path.read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M" and "args" in e}
    busy = [busy_intervals(trace, pid) for pid in sorted(p for p, n in names.items() if n in ("cpu/0", "cpu/1"))]
    total = [sum(b - a for a, b in u) for u in busy]
    both = overlap(*busy)
    return [{"bench": "overlap", "impl": "manual_dp", "devices": 2, "env": spec["env"], "options": o,
             "busy_ms_per_step": [t / 1e3 / spec["steps"] for t in total],
             "both_busy_ms_per_step": both / 1e3 / spec["steps"], "overlap": both / min(total)}]


# The step variants of the buckets bench: (name, bucket_mb, the cached graph's backward bulked).
BUCKET_VARIANTS = [("one buffer", None, True), ("one buffer, unbulked", None, False),
                   ("buckets 0.1 MB", 0.1, False), ("bucket per parameter", 0, False),
                   ("bucket per parameter, bulked", 0, True)]


def bucket_model(k, bucket_mb, bulk, pad):
    """The fast step on cpu(0..k-1) with `bucket_mb` buckets and the graph's backward bulked or not."""
    from ..fast.graph import ModelGraph
    model = DataParallel(init_lenet_params(0), [mx.cpu(i) for i in range(k)], "momentum", conv_pad=pad,
                         bucket_mb=bucket_mb)
    model.graph = ModelGraph(pad, bulk=bulk)
    return model


def ready_spread(traced_spans):
    """Median over steps of the ms between the first and the last bucket's gradients being ready
    everywhere: ~0 when backward releases them all at once."""
    spreads = []
    for step in {s["step"] for s in traced_spans}:
        ready = {}
        for s in traced_spans:
            if s["step"] == step and s["kind"] == "backward":
                ready[s["bucket"]] = max(ready.get(s["bucket"], 0), s["end"])
        spreads.append((max(ready.values()) - min(ready.values())) / 1e3)
    return float(np.median(spreads))


def run_buckets(spec):
    """Step time of each BUCKET_VARIANTS on spec['devices'] contexts, measured round-robin (so a
    drifting machine hits all alike), and the overlap fraction of a --trace of each."""
    from ..fast.autotune import conv_pad
    from ..timeline import measured_overlap, operator_overlap, spans
    k, steps, pad = spec["devices"], spec["steps"], conv_pad()
    rng = np.random.RandomState(0)
    X, y = rng.rand(spec["batch"], 1, 28, 28).astype(np.float32), rng.randint(0, 10, spec["batch"]).astype(np.int32)
    models = [bucket_model(k, mb, bulk, pad) for _, mb, bulk in BUCKET_VARIANTS]
    times = [[] for _ in models]
    for r in range(spec.get("rounds", 3) + 1):
        for i, model in enumerate(models):
            nd.waitall()
            start = time.perf_counter()
            for _ in range(steps):
                model.step(X, y, 0.02)
            nd.waitall()
            if r:                                    # round 0 warms up
                times[i].append((time.perf_counter() - start) / steps)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for (name, mb, bulk), model, t in zip(BUCKET_VARIANTS, models, times):
            path = Path(tmp) / "trace.json"
            traced = bucket_model(k, float("inf") if mb is None else mb, bulk, pad)
            traced.trace(path, skip=1, steps=3, algorithm="reduce_bcast")
            for _ in range(4):
                traced.step(X, y, 0.02)
            nd.waitall()
            trace = json.loads(path.read_text())
            traced_spans = spans(trace)
            records.append({"bench": "buckets", "impl": name, "devices": k, "bucket_mb": mb, "bulk": bulk,
                            "step_ms": 1e3 * float(np.median(t)), "step_ms_rounds": [1e3 * s for s in t],
                            "overlap": measured_overlap(traced_spans),
                            "operator_overlap": operator_overlap(trace), "ready_spread_ms": ready_spread(traced_spans)})
    return records
