"""The layouts of N devices the planner weighs: data, ZeRO 1/2/3, tensor, pipeline (each schedule,
with and without recompute) and their products with data parallelism (hybrid; tensor groups).

A Layout names how the N devices are used: dp data-parallel replicas, each of tp tensor ranks times
pp pipeline stages (dp * tp * pp = N). KINDS is the registry: per kind, how to predict its memory
and time (planner/predict.py) and the train flags that run it; a kind whose strategy exists also
has a builder in planner/verify.py's BUILDERS.
"""
from collections import namedtuple

Layout = namedtuple("Layout", "kind dp tp pp zero_stage schedule micro recompute")

MAX_STAGES = 4          # LeNet's four weighted layers (strategies/stages.py CUTS)
MICRO_BATCHES = 4       # micro-batches per pipeline (config.MODE_DEFAULTS)


def layout(kind, dp, tp=1, pp=1, zero_stage=None, schedule=None, micro=1, recompute=False):
    return Layout(kind, dp, tp, pp, zero_stage, schedule, micro, recompute)


def name(l):
    """A short name: "zero2", "pipeline S=2 1f1b M=4 +recompute x dp 2", "tensor T=2 x dp 2"."""
    if l.kind == "data":
        return "data"
    if l.kind == "zero":
        return f"zero{l.zero_stage}"
    if l.kind == "tensor":
        head = f"tensor T={l.tp}"
    else:
        head = f"pipeline S={l.pp} {l.schedule} M={l.micro}" + (" +recompute" if l.recompute else "")
    return head + (f" x dp {l.dp}" if l.dp > 1 else "")


def mode(l):
    """The --mode of manual_dp.train that runs layout l."""
    if l.kind == "pipeline":
        return "hybrid" if l.dp > 1 else "pipeline"
    return {"data": "sync"}.get(l.kind, l.kind)


def train_flags(l):
    """The python -m manual_dp.train flags that run layout l."""
    if l.kind == "data":
        return f"--mode sync --cpus {l.dp}"
    if l.kind == "zero":
        return f"--mode zero --zero-stage {l.zero_stage} --cpus {l.dp}"
    if l.kind == "tensor":
        return f"--mode tensor --tensor-parallel {l.tp} --cpus {l.dp * l.tp}"
    return (f"--mode {mode(l)} --stages {l.pp} --schedule {l.schedule} --micro-batches {l.micro}"
            + (" --recompute" if l.recompute else "") + f" --cpus {l.dp * l.pp}")


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(devices, batch_size, width=1):
    """Every layout of `devices` devices whose replicas each get at least one example (and each
    micro-batch at least one), in a fixed order. Tensor groups of T need T to divide the split
    axes (strategies/tensor.py SPLIT: conv1's 20W channels, the 128W hidden units)."""
    out = [layout("data", devices)] + [layout("zero", devices, zero_stage=s) for s in (1, 2, 3)]
    out += [layout("tensor", devices // t, tp=t) for t in divisors(devices)
            if t > 1 and (20 * width) % t == 0 and (128 * width) % t == 0]
    for s in (d for d in divisors(devices) if 1 < d <= MAX_STAGES):
        dp = devices // s
        micro = min(MICRO_BATCHES, max(1, batch_size // dp))
        out += [layout("pipeline", dp, pp=s, schedule=sched, micro=micro, recompute=rc)
                for sched in ("gpipe", "1f1b") for rc in (False, True)]
    return [l for l in out if batch_size >= l.dp]
