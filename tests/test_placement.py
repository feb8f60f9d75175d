"""Every context computes its own share: on CPU contexts MXNet checks only the device type when ops
mix arrays, so a layout whose work for one context silently runs on another (a batch left on
cpu(0)) still trains correctly and passes every equality test. MXNet's profiler counts what each
context allocates in a step: here, in a fresh process with one scratch buffer per context (as
cli.memcheck measures), every context of each layout whose work is even allocates at least a third
of what the busiest one does. A cp x tp grid whose second row ran its first cell on cpu(0) gave
0.08 MiB against 18.6 (tensor.copies, fixed)."""
import json
import os
import subprocess
import sys

import pytest

LAYOUTS = {                                # 4 contexts each, the work shared evenly between them
    "sync": ["--mode", "sync"],
    "lesson": ["--mode", "sync", "--allreduce", "lesson", "--no-fuse-grads", "--no-graph"],
    "zero 3": ["--mode", "zero", "--zero-stage", "3"],
    "local": ["--mode", "local", "--sync-every", "2"],
    "async": ["--mode", "async"],
    "dp=2 x tp=2": ["--mesh", "dp=2,tp=2"],
    "dp=2 x tp=2 +sp": ["--mesh", "dp=2,tp=2", "--sequence-parallel"],
    "dp=2 x tp=2 zero 2": ["--mesh", "dp=2,tp=2", "--zero-stage", "2"],
    "dp=2 x cp=2 ring": ["--mesh", "dp=2,cp=2", "--attention", "ring"],
    "dp=2 x cp=2 ulysses": ["--mesh", "dp=2,cp=2", "--attention", "ulysses"],
    "cp=2 x tp=2": ["--mode", "context", "--context-parallel", "2", "--tensor-parallel", "2"],
    "dp=2 x pp=2": ["--mesh", "dp=2,pp=2", "--micro-batches", "2"],
    "pp=2 x tp=2": ["--mesh", "pp=2,tp=2", "--micro-batches", "2"],
    "pp=2 x cp=2": ["--mesh", "pp=2,cp=2", "--micro-batches", "2"],
}
PROBE = """
import json, sys
import manual_dp
import mxnet as mx
from manual_dp import memory
from manual_dp.bench.mesh_runs import built
from manual_dp.cli.options import trainer_config
out = {}
for name, flags in json.loads(sys.argv[1]).items():
    cfg = trainer_config(["--model", "transformer", "--layers", "2", "--d-model", "32", "--heads", "4"], 32, 4, flags)
    report = memory.measure(lambda: built(cfg, 4), [mx.cpu(i) for i in range(4)], 32)
    out[name] = {c: [r["activation_bytes"], r["method"]] for c, r in report.items()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def measured():
    env = dict(os.environ, MXNET_CPU_TEMP_COPY="1")
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(LAYOUTS)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_context_computes_its_share(measured, name):
    report = measured[name]
    assert len(report) == 4 and {method for _, method in report.values()} == {"profiler"}, report
    busiest = max(b for b, _ in report.values())
    assert busiest > 0 and all(b >= busiest / 3 for b, _ in report.values()), report
