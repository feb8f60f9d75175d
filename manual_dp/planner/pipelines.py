"""The planner's predictions for pipelines on every schedule of manual_dp.strategies.schedules
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
"""
from functools import lru_cache

from .. import costmodel
from ..lesson import shard_sizes
from ..memory import FLOAT_BYTES, part_activation_elems, piece_activation_elems
from ..strategies.schedules import held, plan, simulate

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
