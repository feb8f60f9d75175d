"""The layouts of N devices the planner weighs: data, ZeRO 1/2/3, tensor, pipeline (each schedule,
with and without recompute) and their products with data parallelism (hybrid; tensor groups).

A Layout names how the N devices are used: dp data-parallel replicas, each of tp tensor ranks times
pp pipeline stages (dp * tp * pp = N). KINDS is the registry: per kind, how to predict its memory
and time (planner/predict.py) and the train flags that run it; a kind whose strategy exists also
has a builder in planner/verify.py's BUILDERS.

Which layouts a model can run, it says itself (models.contract): tensor groups of T that
Model.tensor_refusal accepts, pipelines of at most as many stages as it has layers, and for a
model with running statistics (BatchNorm) data parallelism alone, the one strategy that carries them.
"""
from collections import namedtuple

from ..config import MODE_DEFAULTS

Layout = namedtuple("Layout", "kind dp tp pp zero_stage schedule micro recompute")

MICRO_BATCHES = MODE_DEFAULTS["micro_batches"]       # micro-batches per pipeline


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


def model_of(width=1, model=None):
    """The models.Model laid out: `model`, or the lesson's LeNet of `width`."""
    if model is not None:
        return model
    from ..models.lenet import LeNet
    return LeNet(width)


def candidates(devices, batch_size, net):
    """[(layout, why net cannot run it, or None)] for every layout of `devices` devices whose
    replicas each get at least one example (and each micro-batch at least one), in a fixed order."""
    stats = (f"{net.name} keeps BatchNorm's running statistics, which only data parallelism "
             f"(--mode sync) carries") if net.stats() else None
    out = [(layout("data", devices), None)] + [(layout("zero", devices, zero_stage=s), stats) for s in (1, 2, 3)]
    out += [(layout("tensor", devices // t, tp=t), stats or net.tensor_refusal(t)) for t in divisors(devices)[1:]]
    for s in divisors(devices)[1:]:
        dp = devices // s
        micro = min(MICRO_BATCHES, max(1, batch_size // dp))
        why = stats or (f"{net.name} has {len(net.layers)} layers to cut between" if s > len(net.layers) else None)
        out += [(layout("pipeline", dp, pp=s, schedule=sched, micro=micro, recompute=rc), why)
                for sched in ("gpipe", "1f1b") for rc in (False, True)]
    return [(l, why) for l, why in out if batch_size >= l.dp]


def enumerate_layouts(devices, batch_size, width=1, model=None):
    """Every layout of `devices` devices that the model (default LeNet of `width`) can run and whose
    replicas each get at least one example (and each micro-batch at least one), in a fixed order."""
    return [l for l, why in candidates(devices, batch_size, model_of(width, model)) if not why]


def family(l):
    """A left-out layout's name without its schedule: "zero2", "tensor T=8", "pipeline S=8 x dp 2"."""
    if l.kind == "pipeline":
        return f"pipeline S={l.pp}" + (f" x dp {l.dp}" if l.dp > 1 else "")
    return name(l)


def left_out(devices, batch_size, width=1, model=None):
    """One line naming the layouts the model cannot run and why (pipelines by depth, every schedule
    alike); None if it runs them all."""
    why_of = {}
    for l, why in candidates(devices, batch_size, model_of(width, model)):
        if why and family(l) not in why_of.setdefault(why, []):
            why_of[why].append(family(l))
    if not why_of:
        return None
    return "left out: " + "; ".join(f"{', '.join(names)} ({why})" for why, names in why_of.items())
