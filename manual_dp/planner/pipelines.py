"""The planner's predictions for pipelines on every schedule of manual_dp.strategies.pipeline.schedules
(GPipe, 1F1B, interleaved 1F1B with V chunks a device, ZB-H1), each times data parallelism: the
model cut into S V stages (Model.cuts), stage k on device k % S, as PipelineParallel runs them.

Memory per device: the parameters of its stages (P_d + P_d + c P_d), and activations: per stage,
the examples the schedule holds at once (schedules.held, per stage: GPipe all M micro-batches, 1F1B
S - s, ZB-H1 S until W, interleaved by its order) times the stage's elements per example
(memory.part_activation_elems); with recompute those micro-batches' stage inputs plus the
activations of those being recomputed (one micro-batch; ZB-H1 those between B and W). A device's
stages' peaks are added (interleaved: V a device), as PipelineParallel.layout prices them: an upper
bound, exact for one stage a device.

Time: every stage is priced at the slowest device's cost (the tick model): F its forward FLOPs,
B its backward (input and weight gradients; ZB-H1 splits it into B, the input gradients, the
stage's layers but the first's, and W, the weight gradients, one forward's worth each: a real ZB's
split, not SplitPass's 1.5 backwards on MXNet), the forward again under recompute (in B), each
chunk of an interleaved device 1/V of the device's. compute = M micro-batches of F + B + W; the
bubble is the schedule's simulated makespan (schedules.simulate with those durations) less that,
so (S - 1)/M of compute for GPipe and 1F1B, (S - 1)/(V M) interleaved, (S - 1)(F + B - W)/(M (F + B
+ W)) ZB-H1 for M >= S. Past SIMULATED devices the simulation is not run: 1F1B's (S - 1) ticks are
charged, an upper bound for the other schedules. On CPU contexts (shared) no bubble; ZB-H1's
backward costs 1.5 backwards there (SplitPass runs the chain twice).
Communication: per boundary between consecutive stages, per micro-batch, the activation forward and
its gradient back (S V - 1 boundaries); then each device's gradients all-reduced over dp.

dp x pp x tp (strategies/mesh/mesh_parallel.py, Megatron's "3-D parallelism"; the mesh_ functions): the
same stages, each a tensor group of T contexts split as tensor parallelism splits the whole model
(planner/sequence.py), with or without +sp.
Memory per context (rank 0 of a group: the largest share), exactly as MeshParallel.layout and
its arrays price it:
  state        its stages' parameters, the split ones 1/T (Param.split), the rest whole:
               (2 + c) x that (c: the optimiser's copies)
  activations  per stage on it: the h examples the schedule holds there (schedules.held), 1/T of
               them at the stage's whole activations (memory.part_activation_elems, its received
               input included), the other h - h/T at what every rank holds whole
               (strategies/tensor.held_whole of the stage's layers: what f and g join, not under
               +sp; the layers outside the split runs; the stage's input unless +sp hands on a
               block of tokens between split layers); an interleaved device's stages added.
Time:
  compute      a pipeline's, each stage's FLOPs over T (on CPU contexts, sharing one machine,
               every context's work one after another: no bubble, nothing saved)
  comm         the tensor collectives of the busiest device's stages (one ring all-reduce over T
               per micro-batch and entry of its layers' Model.tensor_traffic; +sp sends the same
               bytes as an all-gather and a reduce-scatter), the boundary copies (per micro-batch
               the activation forward and its gradient back, the T ranks sending in parallel, a
               1/T block of tokens under +sp between split layers), and the busiest context's
               gradient all-reduce over dp (under +sp a replicated parameter's over dp x T),
               float32 (MeshParallel takes no --precision).
Not counted: as for tensor layouts and pipelines (the collectives' temporaries, the residual sums
whole on every rank; the tensor collectives stretched by the bubble).

dp x pp x cp and dp x pp x cp x tp (MeshParallel with context_parallel C: each stage a
context-parallel group, or a C x T grid, ring or Ulysses attention; no +sp):
  state        as dp x pp x tp (T = 1: the stages' whole parameters)
  activations  per stage, 1/(C T) of the h examples held there at the stage's activations, and on
               the first stage the images of the other h - h/(C T), copied whole to every context:
               MeshParallel.layout's floor (attention's extra, planner/sequence.py's
               attention_held, and a grid's f and g joins not counted there, nor here)
  compute      a pipeline's, each stage's FLOPs over C T
  comm         per micro-batch and stage on the busiest device: the attention's ring hops or
               all-to-alls over C (blocks d/T wide), each row's f and g over T on its block of
               tokens, the pooled vector's sum over C where the stage holds the head
               (planner/sequence.py prices each as for dp x cp x tp); the boundary copies, each
               context's block of tokens (1/C of the activation; the T ranks of a row send in
               parallel); the gradient all-reduce of a rank's parameters over dp x C.
"""
from functools import lru_cache

from .. import costmodel
from ..lesson import shard_sizes
from ..memory import FLOAT_BYTES, part_activation_elems, piece_activation_elems
from ..strategies.context.context import attention_layers
from ..strategies.pipeline.schedules import held, plan, simulate
from ..strategies.tensor.tensor_layout import even_split, held_whole
from . import sequence

SIMULATED = 256          # devices up to which a pipeline's schedule is simulated (quadratic in S)


def stage_cuts(l, net):
    """The layers of each of the S V stages (Model.cuts); stage k on device k % S."""
    return net.cuts(l.pp * l.virtual)


def devices_of(l, per_stage):
    """Per device, the sum of `per_stage` over its stages (k % S)."""
    out = [0] * l.pp
    for k, v in enumerate(per_stage):
        out[k % l.pp] += v
    return out


def replica_plan(l, n):
    """The Plan a replica of n examples runs, as PipelineParallel.plan makes it: min(M, n)
    micro-batches, interleaved rounded down to a multiple of S above S."""
    m = min(l.micro, n)
    if l.schedule == "interleaved" and m > l.pp and m % l.pp:
        m -= m % l.pp
    return plan(l.schedule, l.pp, m, l.virtual)


def activations(l, net, n):
    """Activation elements held at the peak by each device of a replica of n examples."""
    p = replica_plan(l, n)
    sizes = shard_sizes(n, p.n_micro)
    kept = held(p, sizes, per="stage")
    redone = held(p, sizes, per="stage", since="B", until="W") if p.split else [max(sizes)] * p.n_stages
    per_stage = []
    for pieces, h, r in zip(stage_cuts(l, net), kept, redone):
        full = part_activation_elems(pieces, model=net)
        per_stage.append(h * part_activation_elems(("input", pieces[0]), model=net) + r * full
                         if l.recompute else h * full)
    return devices_of(l, per_stage)


def phases(net, pieces, l):
    """(F, B, W) FLOPs per example of a stage of layers `pieces` (Layer.flops; see the docstring)."""
    f = [net.layers[p].flops for p in pieces]
    forward = sum(f)
    inputs = sum(x for x, p in zip(f, pieces) if p)            # no input gradient for layer 0
    redo = forward if l.recompute else 0
    if l.schedule == "zb-h1":
        return forward, inputs + redo, forward
    return forward, inputs + forward + redo, 0


@lru_cache(maxsize=256)
def makespan(name, S, M, V, durations):
    """Seconds of a replica's schedule with every stage's phases taking `durations` ((phase, s)...)."""
    times = simulate(plan(name, S, M, V), dict(durations))
    return max(end for _, end in times.values())


def compute(l, net, n, batch, dev, seconds):
    """(compute seconds, bubble seconds) of a step on device type dev (see the module's docstring)."""
    per_stage = [phases(net, pieces, l) for pieces in stage_cuts(l, net)]
    if dev.shared:                     # every device's work on one machine, one after another
        f, b, w = (sum(x[i] for x in per_stage) for i in range(3))
        return seconds(batch * (f + (1.5 * (b + w) if l.schedule == "zb-h1" else b + w)), dev.rate), 0.0
    device = [tuple(sum(x[i] for k, x in enumerate(per_stage) if k % l.pp == d) for i in range(3))
              for d in range(l.pp)]
    p = replica_plan(l, n)
    micro = shard_sizes(n, p.n_micro)[0]
    f, b, w = (seconds(x * micro, dev.rate) for x in max(device, key=sum))
    work = p.n_micro * (f + b + w)
    if l.pp > SIMULATED or not work:
        return work, (l.pp - 1) * (f + b + w)
    durations = {"F": f / l.virtual, "B": b / l.virtual} | ({"W": w} if p.split else {})
    return work, max(0.0, makespan(l.schedule, l.pp, p.n_micro, l.virtual, tuple(sorted(durations.items()))) - work)


def communication(l, net, n, layers, low, dev):
    """Seconds of the boundary copies and the per-device gradient all-reduce over dp."""
    inputs = piece_activation_elems(model=net)
    cuts = stage_cuts(l, net)
    boundary = sum(2 * l.micro * dev.alpha + 2 * n * inputs[pieces[0]][0] * FLOAT_BYTES * dev.beta
                   for pieces in cuts[1:])
    held_bytes = devices_of(l, [sum(layers[p] for p in pieces) for pieces in cuts])
    return boundary + max(costmodel.allreduce_time("ring", l.dp, b * low, dev.alpha, dev.beta) for b in held_bytes)


def rank_kept(p, T):
    """Elements a tensor rank keeps of Param p: 1/T if split, else whole."""
    return p.size // T if p.split is not None else p.size


def mesh_state(l, net, c):
    """Parameter + gradient + optimiser state elements of each pipeline rank's contexts."""
    stages = [sum(rank_kept(p, l.tp) for i in pieces for p in net.layers[i].params) for pieces in stage_cuts(l, net)]
    return [(2 + c) * k for k in devices_of(l, stages)]


def group_whole(l, net, pieces):
    """Per example elements every context of a stage's group holds whole (beyond its share): a tensor
    group's held_whole; a context-parallel group or grid the images, on the first stage (MeshParallel.layout)."""
    if l.cp == 1:
        return held_whole(net, pieces, l.sp)
    return net.layers[0].inputs if pieces[0] == 0 else 0


def mesh_activations(l, net, n):
    """Activation elements at the peak of rank 0 of each pipeline rank's groups, for a replica of n examples."""
    p = replica_plan(l, n)
    per_stage = []
    for pieces, h in zip(stage_cuts(l, net), held(p, shard_sizes(n, p.n_micro), per="stage")):
        share = even_split(h, l.cp * l.tp)[0]
        per_stage.append(part_activation_elems(pieces, model=net) * share + group_whole(l, net, pieces) * (h - share))
    return devices_of(l, per_stage)


def mesh_compute(l, net, n, batch, dev, seconds):
    """(compute seconds, bubble seconds) of a step (see the module's docstring, dp x pp x tp; with cp over C T)."""
    if dev.shared:
        return compute(l, net, n, batch, dev, seconds)
    return compute(l, net, n, batch, dev, lambda flops, rate: seconds(flops, rate) / (l.cp * l.tp))


def mesh_tensor_comm(l, net, sizes, dev):
    """Seconds of the collectives inside the groups of the busiest pipeline rank's stages,
    micro-batches of `sizes`: f and g over T (on a block of tokens under cp), and under cp the
    attention's ring hops or all-to-alls and the pooled sum over C (planner/sequence.py)."""
    def stage(pieces):
        traffic = [t for i in pieces for t in net.layers[i].extra.get("traffic", ())]
        attention = [a for a, i in zip(attention_layers(net), attention_ids(net)) if i in pieces]
        pooled = len(net.layers) - 1 in pieces and l.cp > 1
        return sum(sequence.row_tensor_communication(l, traffic, m, dev) + sequence.attention_communication(
            l, attention, m, dev) + (sequence.pooled_communication(l, net, m, dev) if pooled else 0) for m in sizes)
    return max(devices_of(l, [stage(pieces) for pieces in stage_cuts(l, net)]))


def attention_ids(net):
    """The indices of the model's attention layers (a layer with a head_dim), in order."""
    return [i for i, layer in enumerate(net.layers) if "head_dim" in layer.extra]


def mesh_boundary_comm(l, net, n, n_micro, dev):
    """Seconds of the copies between consecutive stages: activation forward, gradient back."""
    split = [bool(layer.split_forward) for layer in net.layers]
    total = 0.0
    for pieces in stage_cuts(l, net)[1:]:
        first = pieces[0]
        elems = net.layers[first].inputs / (l.tp if l.sp and split[first] and split[first - 1] else l.cp)
        total += 2 * n_micro * dev.alpha + 2 * n * elems * FLOAT_BYTES * dev.beta
    return total


def mesh_grad_comm(l, net, dev):
    """Seconds of the busiest pipeline rank's gradient all-reduces over dp (+sp: the replicated over
    dp x T; cp: every shard over dp x C)."""
    params = [[p for i in pieces for p in net.layers[i].params] for pieces in stage_cuts(l, net)]
    shards = devices_of(l, [sum(p.size // l.tp for p in ps if p.split is not None) for ps in params])
    whole = devices_of(l, [sum(p.size for p in ps if p.split is None) for ps in params])

    def ring(k, elems):
        return costmodel.allreduce_time("ring", k, elems * FLOAT_BYTES, dev.alpha, dev.beta)
    if l.cp > 1:
        return max(ring(l.dp * l.cp, s + w) for s, w in zip(shards, whole))
    return max(ring(l.dp, s) + ring(l.dp * (l.tp if l.sp else 1), w) for s, w in zip(shards, whole))


def mesh_communication(l, net, n, dev):
    """Seconds of a step's collectives for a replica of n examples (see the module's docstring, dp x pp x tp)."""
    p = replica_plan(l, n)
    return (mesh_tensor_comm(l, net, shard_sizes(n, p.n_micro), dev) + mesh_boundary_comm(l, net, n, p.n_micro, dev)
            + mesh_grad_comm(l, net, dev))
