"""The layouts of N devices the planner weighs, each a device mesh (manual_dp.mesh): data, ZeRO 1/2/3,
tensor (with and without sequence parallelism), context (ring and Ulysses attention), pipelines on
every schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1; with and without recompute), each of the last
three times data parallelism, dp x cp x tp (kind "context" with tp > 1: a C x T grid per replica,
ContextTensorParallel), and the meshes of MeshParallel on GPipe, 1F1B and interleaved 1F1B: dp x pp
x tp (each pipeline stage a tensor group, with and without sequence parallelism), dp x pp x cp (each
stage a context-parallel group, ring or Ulysses) and dp x pp x cp x tp (each stage a C x T grid).

A Layout names how the N devices are used: dp data-parallel replicas, each of tp tensor ranks times
pp pipeline stages times cp context blocks (dp * pp * cp * tp = N). KINDS of planner/predict.py
say how to predict each kind's memory and time; `train_flags` the flags that run it; a kind whose
strategy exists also has a builder in planner/verify.py's BUILDERS.

Which layouts a model can run, it says itself (models.contract): tensor groups of T that
Model.tensor_refusal accepts, context groups of C that Model.sequence_refusal accepts for the
attention (and sequence parallelism the same for T), C x T grids that Model.grid_refusal accepts,
pipelines of at most as many stages as it has layers (interleaved: V times as many), dp x pp x tp
both of those and layers that split on their own (Layer.split_forward: not LeNet's whole-model
split), dp x pp x cp and dp x pp x cp x tp a pipeline's and a stage group's (mesh.group_stages.group_refusal:
no +sp with cp, as MeshParallel refuses it), and for a model with running statistics (BatchNorm)
data parallelism, ZeRO, pipelines and tensor groups without +sp, the strategies that carry them.
"""
from collections import namedtuple

from ..config import ATTENTIONS, MODE_DEFAULTS
from ..mesh import Mesh

Layout = namedtuple("Layout", "kind dp tp pp zero_stage schedule micro recompute cp attention sp virtual")

MICRO_BATCHES = MODE_DEFAULTS["micro_batches"]       # micro-batches per pipeline
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
MESH_SCHEDULES = SCHEDULES[:3]                       # MeshParallel refuses zb-h1
VIRTUAL = 2                                          # interleaved: chunks (virtual stages) a device


def layout(kind, dp, tp=1, pp=1, zero_stage=None, schedule=None, micro=1, recompute=False, cp=1, attention=None,
           sp=False, virtual=1):
    return Layout(kind, dp, tp, pp, zero_stage, schedule, micro, recompute, cp, attention, sp, virtual)


def mesh(l):
    """The manual_dp.mesh.Mesh that lays l out."""
    return Mesh(dp=l.dp, pp=l.pp, cp=l.cp, tp=l.tp)


def name(l):
    """The mesh, then what runs on it: "dp=4 data", "dp=4 zero2", "dp=2 x tp=2 +sp", "dp=2 x cp=2 ring",
    "cp=2 x tp=2 ulysses", "dp=2 x pp=2 interleaved V=2 M=4 +recompute", "dp=2 x pp=2 x tp=2 +sp 1f1b M=4",
    "pp=2 x cp=2 x tp=2 ring gpipe M=4"."""
    head = str(mesh(l))
    if l.kind in ("data", "zero"):
        return f"{head} {'data' if l.kind == 'data' else f'zero{l.zero_stage}'}"
    if l.kind == "tensor":
        return head + (" +sp" if l.sp else "")
    if l.kind == "context":
        return f"{head} {l.attention}"
    if l.kind == "mesh":
        head += (" +sp" if l.sp else "") + (f" {l.attention}" if l.cp > 1 else "")
    return (f"{head} {l.schedule}" + (f" V={l.virtual}" if l.virtual > 1 else "") + f" M={l.micro}"
            + (" +recompute" if l.recompute else ""))


def mode(l):
    """The --mode of manual_dp.train that runs layout l."""
    if l.kind == "pipeline":
        return "hybrid" if l.dp > 1 else "pipeline"
    return {"data": "sync"}.get(l.kind, l.kind)


def mesh_flag(l):
    """--mesh with the dimensions l uses (dp first), e.g. "--mesh dp=2,cp=2"; MeshParallel's meshes
    dp and pp always, "--mesh dp=1,pp=2,tp=2", "--mesh dp=1,pp=2,cp=2,tp=2"."""
    m = mesh(l)
    dims = ["dp", "pp"] + [d for d in ("cp", "tp") if getattr(m, d) > 1] if l.kind == "mesh" else m.used()
    return "--mesh " + ",".join(f"{d}={getattr(m, d)}" for d in dims)


def train_flags(l):
    """The python -m manual_dp.train flags that run layout l (--mesh where a mesh says it)."""
    n = l.dp * l.tp * l.pp * l.cp
    if l.kind == "data":
        return f"--mode sync --cpus {n}"
    if l.kind == "zero":
        return f"--mode zero --zero-stage {l.zero_stage} --cpus {n}"
    if l.kind == "tensor":
        return f"{mesh_flag(l)}" + (" --sequence-parallel" if l.sp else "") + f" --cpus {n}"
    if l.kind == "context":
        return f"{mesh_flag(l)} --attention {l.attention} --cpus {n}"
    return (f"{mesh_flag(l)}" + (" --sequence-parallel" if l.sp else "") + (f" --attention {l.attention}" if l.cp > 1 else "")
            + f" --schedule {l.schedule}" + (f" --virtual-stages {l.virtual}" if l.virtual > 1 else "")
            + f" --micro-batches {l.micro}" + (" --recompute" if l.recompute else "") + f" --cpus {n}")


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def model_of(width=1, model=None):
    """The models.Model laid out: `model`, or the lesson's LeNet of `width`."""
    if model is not None:
        return model
    from ..models.lenet import LeNet
    return LeNet(width)


def pipeline_refusal(net, S, schedule, micro):
    """Why `net` cannot run an S-device pipeline on `schedule` with `micro` micro-batches, or None."""
    L = len(net.layers)
    if S > L:
        return f"{net.name} has {L} layers to cut between"
    if schedule == "interleaved" and VIRTUAL * S > L:
        return f"interleaved: {S} devices x {VIRTUAL} virtual stages need {VIRTUAL * S} layers, {net.name} has {L}"
    if schedule == "interleaved" and micro > S and micro % S:
        return f"interleaved: {micro} micro-batches are not a multiple of {S} devices"
    return None


def pipelines(devices, batch_size, net):
    """[(layout, why not)] of every pipeline (times data parallelism) of `devices` devices (a model
    with BatchNorm: each micro-batch normalised with its own statistics)."""
    out = []
    for s in divisors(devices)[1:]:
        dp = devices // s
        micro = min(MICRO_BATCHES, max(1, batch_size // dp))
        for sched in SCHEDULES:
            why = pipeline_refusal(net, s, sched, micro)
            out += [(layout("pipeline", dp, pp=s, schedule=sched, micro=micro, recompute=rc,
                            virtual=VIRTUAL if sched == "interleaved" else 1), why)
                    for rc in (False, True)]
    return out


def mesh_refusal(net, S, T, schedule, micro, sp):
    """Why `net` cannot run dp x pp=S x tp=T on `schedule` (+sp if sp), as MeshParallel refuses it, or None."""
    if not net.splits_by_layer():
        return f"{net.name} splits as a whole model; tp x pp needs layers that split on their own"
    why, seq = net.tensor_refusal(T) or pipeline_refusal(net, S, schedule, micro), sp and net.sequence_refusal(T, None)
    return why or (f"--sequence-parallel: {seq}" if seq else None)


def meshes(devices, batch_size, net, stats):
    """[(layout, why not)] of every dp x pp x tp (pp, tp >= 2) of `devices` devices."""
    out = []
    for s in divisors(devices)[1:]:
        for t in divisors(devices // s)[1:]:
            dp = devices // (s * t)
            micro = min(MICRO_BATCHES, max(1, batch_size // dp))
            out += [(layout("mesh", dp, tp=t, pp=s, schedule=sched, micro=micro, sp=sp,
                            virtual=VIRTUAL if sched == "interleaved" else 1),
                     stats or mesh_refusal(net, s, t, sched, micro, sp)) for sched in MESH_SCHEDULES for sp in (False, True)]
    return out


def group_refusal(net, C, T, attention):
    """Why `net` cannot run on a group of C blocks of tokens x T tensor ranks (C > 1), as
    ContextTensorParallel and mesh.group_stages.group_refusal refuse it, or None."""
    return net.grid_refusal(C, T, attention) if T > 1 else net.sequence_refusal(C, attention)


def grids(devices, net, stats):
    """[(layout, why not)] of every dp x cp x tp (cp, tp >= 2) of `devices` devices."""
    return [(layout("context", devices // (c * t), tp=t, cp=c, attention=a), stats or group_refusal(net, c, t, a))
            for c in divisors(devices)[1:] for t in divisors(devices // c)[1:] for a in ATTENTIONS]


def context_meshes(devices, batch_size, net, stats):
    """[(layout, why not)] of every dp x pp x cp and dp x pp x cp x tp (pp, cp >= 2) of `devices`
    devices: MeshParallel's schedules, no +sp (MeshParallel refuses it beside cp)."""
    out = []
    for s in divisors(devices)[1:]:
        for c in divisors(devices // s)[1:]:
            for t in divisors(devices // (s * c)):
                dp = devices // (s * c * t)
                micro = min(MICRO_BATCHES, max(1, batch_size // dp))
                out += [(layout("mesh", dp, tp=t, pp=s, cp=c, attention=a, schedule=sched, micro=micro,
                                virtual=VIRTUAL if sched == "interleaved" else 1),
                         stats or group_refusal(net, c, t, a) or pipeline_refusal(net, s, sched, micro))
                        for a in ATTENTIONS for sched in MESH_SCHEDULES]
    return out


def candidates(devices, batch_size, net):
    """[(layout, why net cannot run it, or None)] for every layout of `devices` devices whose
    replicas each get at least one example (and each micro-batch at least one), in a fixed order."""
    stats = (f"{net.name} keeps BatchNorm's running statistics, which data parallelism, ZeRO, "
             f"pipelines and tensor groups carry") if net.stats() else None
    out = [(layout("data", devices), None)] + [(layout("zero", devices, zero_stage=s), None) for s in (1, 2, 3)]
    for t in divisors(devices)[1:]:
        why, sp = net.tensor_refusal(t), net.sequence_refusal(t, None)
        out += [(layout("tensor", devices // t, tp=t), why),
                (layout("tensor", devices // t, tp=t, sp=True), why or stats or (sp and f"--sequence-parallel: {sp}"))]
    out += [(layout("context", devices // c, cp=c, attention=a), stats or net.sequence_refusal(c, a))
            for c in divisors(devices)[1:] for a in ATTENTIONS]
    out += grids(devices, net, stats) + pipelines(devices, batch_size, net) + meshes(devices, batch_size, net, stats)
    out += context_meshes(devices, batch_size, net, stats)
    return [(l, why) for l, why in out if batch_size >= l.dp]


def enumerate_layouts(devices, batch_size, width=1, model=None):
    """Every layout of `devices` devices that the model (default LeNet of `width`) can run and whose
    replicas each get at least one example (and each micro-batch at least one), in a fixed order."""
    return [l for l, why in candidates(devices, batch_size, model_of(width, model)) if not why]


def family(l, why):
    """A left-out layout's name without its schedule: "dp=4 zero2", "tp=8 +sp", "dp=2 x pp=2",
    "cp=4 ulysses", "pp=2 x cp=4 ulysses"; "pp=2 interleaved" if only the interleaved schedule is refused."""
    if l.kind not in ("pipeline", "mesh"):
        return name(l)
    return str(mesh(l)) + (" +sp" if why.startswith("--sequence-parallel") else "") + (
        f" {l.attention}" if l.cp > 1 else "") + (" interleaved" if why.startswith("interleaved") else "")


def left_out(devices, batch_size, width=1, model=None):
    """One line naming the layouts the model cannot run and why (pipelines by their mesh, every
    schedule alike); None if it runs them all."""
    why_of = {}
    for l, why in candidates(devices, batch_size, model_of(width, model)):
        if why and family(l, why) not in why_of.setdefault(why, []):
            why_of[why].append(family(l, why))
    if not why_of:
        return None
    return "left out: " + "; ".join(f"{', '.join(names)} ({why})" for why, names in why_of.items())
