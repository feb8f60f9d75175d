"""Do two CPU contexts compute at the same time? MXNet's profiler records when every operator
ran on which context; the fraction of one context's busy time during which the other was busy
too answers it, whatever else the machine is doing (a loaded machine stretches both alike)."""
import json
import tempfile
from pathlib import Path

import mxnet as mx
import numpy as np
from mxnet import nd, profiler

from ..fast.collectives import make_allreduce
from ..lesson import init_lenet_params
from ..strategies.data_parallel import DataParallel
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
