"""`python -m manual_dp.bench --memory [--width W] [--batch-size B] [--cpus N]`: every mode's
measured peak per context, split into parameters, gradients, optimiser state and
activations/temporaries, each mode measured in a fresh process with one scratch buffer per
device (manual_dp.cli.memcheck), as a table and as records in OUT/memory.json."""
import json

from ..cli.memcheck import probe_modes
from ..config import RunConfig
from ..memory import format_bytes
from ..fast.runtime import machine

COLUMNS = ("peak_bytes", "param_bytes", "grad_bytes", "state_bytes", "activation_bytes")


def records(width, batch_size, n, commit):
    """One record per mode that fits n CPU contexts: {"bench": "memory", "impl": mode, ...}, each
    naming the machine and `commit` (the checkout's, from bench.command)."""
    cfg = RunConfig(cpus=n, width=width, batch_size=batch_size)
    where = dict(machine(), commit=commit)
    return [dict(where, bench="memory", impl=mode, devices=n, width=width, batch=batch_size, memory=report)
            for mode, report in probe_modes(cfg, "cpu", n).items()]


def table(recs):
    """The records as a text table: a row per mode and context."""
    head = f"{'mode':9} {'context':8} " + " ".join(f"{c.removesuffix('_bytes'):>11}" for c in COLUMNS)
    rows = [f"{r['impl']:9} {c:8} " + " ".join(f"{format_bytes(m[k]):>11}" for k in COLUMNS)
            for r in recs for c, m in r["memory"].items()]
    return "\n".join([head] + rows)


def run(out, width, batch_size, n, commit):
    """Measure, print the table, write OUT/memory.json; returns the records."""
    recs = records(width, batch_size, n, commit)
    if recs:
        r = recs[0]
        print(f"memory per context, measured ({r['memory'][next(iter(r['memory']))]['method']}, one scratch "
              f"buffer per device): LeNet x{width}, "
              f"batch {batch_size}, {n} CPU contexts; {r['cpu']}, {r['cores']} cores, commit {r['commit']}")
    print(table(recs))
    (out / "memory.json").write_text(json.dumps(recs, indent=1))
    return recs
