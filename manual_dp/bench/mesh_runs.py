"""The measurements of `python -m manual_dp.bench.meshes`, one function a part (the command,
manual_dp.bench.meshes, prints them and judges the targets). Import after the thread settings are
in the environment (fast.runtime.configure): this module loads MXNet.

    activations   per context, each layout in a fresh process as the trainer measures it (cli.memcheck)
    bubbles       gpipe, 1f1b, interleaved and zb-h1 at p=4, m=8: simulated (the dry run) and measured
    meshes        layouts of N contexts a few steps each: the loss beside one context's, images/s

Every layout is named by the trainer's own flags and built by the trainer's own code
(meshes.trainer_config: cli.options.parse; cli.build.build_model), so what is measured here is what
`python -m manual_dp.train` would run.
"""
from time import perf_counter

import mxnet as mx
import numpy as np
from mxnet import nd

from ..cli.build import build_model, network
from ..cli.memcheck import read_probes
from ..cli.options import trainer_config
from ..errors import UsageError
from ..memory import random_batch
from ..mesh import Mesh
from ..models import build
from ..multiprocess.world import World
from ..strategies.pipeline.pipeline import PipelineParallel
from ..strategies.pipeline.pipeline_pass import ReplicaPass, SplitPass, cut
from ..strategies.pipeline.schedules import bubbles, formula, plan, run_order, simulate
from ..strategies.pipeline.stage_costs import plan_costs, priced, relative
from ..strategies.pipeline.stage_times import stage_times

STAGES, MICRO = 4, 8                                          # issue 22's p and m
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
MEMORY_LAYOUTS = (                                            # (name, contexts, the trainer's flags)
    ("one context", 1, []),
    ("tp=2", 2, ["--mesh", "tp=2"]), ("tp=2 +sp", 2, ["--mesh", "tp=2", "--sequence-parallel"]),
    ("tp=4", 4, ["--mesh", "tp=4"]), ("tp=4 +sp", 4, ["--mesh", "tp=4", "--sequence-parallel"]),
    ("cp=2 ring", 2, ["--mesh", "cp=2", "--attention", "ring"]),
    ("cp=2 ulysses", 2, ["--mesh", "cp=2", "--attention", "ulysses"]),
    ("cp=4 ring", 4, ["--mesh", "cp=4", "--attention", "ring"]),
    ("cp=4 ulysses", 4, ["--mesh", "cp=4", "--attention", "ulysses"]),
    ("dp=2 x pp=2 x tp=2", 8, ["--mesh", "dp=2,pp=2,tp=2"]),
    ("dp=2 x pp=2 x tp=2 +sp", 8, ["--mesh", "dp=2,pp=2,tp=2", "--sequence-parallel"]),
    ("pp=2 x cp=2", 4, ["--mesh", "pp=2,cp=2"]),
)


def mesh_layouts(n):
    """[(name, trainer flags)] of the meshes of n contexts (n a multiple of 4; 8: issue 22's, and
    dp x pp x cp x tp, on a multiple of 8)."""
    d = n // 4
    meshes = [(f"dp={d},pp=2,tp=2", []), (f"dp={d},pp=2,tp=2", ["--sequence-parallel"]),
              (f"dp={d},pp=2,cp=2", []), (f"dp={d},cp=4", []), (f"dp={2 * d},tp=2", [])]
    meshes += [(f"dp={n // 8},pp=2,cp=2,tp=2", [])] if n % 8 == 0 else []
    return [(str(Mesh.parse(m, n)) + (" +sp" if extra else ""), ["--mesh", m] + extra) for m, extra in meshes]


def built(cfg, n):
    """The trainer's strategy for cfg on cpu(0..n-1), from the seed's parameters."""
    params = network(cfg).init_params(cfg.seed, cfg.init_scale)
    return build_model(cfg, params, [mx.cpu(i) for i in range(n)], World())


def activations(model_flags, batch, at_once, names=None):
    """{layout: {"contexts", "method", "activation_bytes": {context: bytes}, "largest"}} of the
    MEMORY_LAYOUTS named in `names` (default all), each measured in a fresh process with one scratch buffer per device
    (cli.memcheck's probe), `at_once` processes at a time; {"contexts", "left_out": why} for a
    layout the trainer refuses or whose process fails."""
    out, ready = {}, []
    layouts = [(name, n, flags) for name, n, flags in MEMORY_LAYOUTS if names is None or name in names]
    for name, n, flags in layouts:
        try:
            cfg = trainer_config(model_flags, batch, n, flags)
            built(cfg, n)                                  # the trainer's refusals (heads, tokens...)
            ready.append((name, n, cfg))
        except UsageError as e:
            out[name] = {"contexts": n, "left_out": str(e)}
    for i in range(0, len(ready), at_once):
        reports = read_probes({name: (cfg, n) for name, n, cfg in ready[i:i + at_once]}, "cpu")
        for name, n, _ in ready[i:i + at_once]:
            report = reports[name]
            out[name] = {"contexts": n, "left_out": "its measuring process failed"} if report is None else {
                "contexts": n, "method": next(iter(report.values()))["method"],
                "activation_bytes": {c: r["activation_bytes"] for c, r in report.items()},
                "largest": max(r["activation_bytes"] for r in report.values())}
    return {name: out[name] for name, _, _ in layouts}


class Timed(PipelineParallel):
    """PipelineParallel(measure=True) that also keeps, per replica pass, the median measured seconds
    of each (phase, stage) in `took`: PipelineParallel.run_replica, less the peaks, plus that list
    (PipelineParallel keeps only the bubble those durations replay to)."""

    took = None

    def run_replica(self, row, places, P, Xr, yr):
        p = self.plan(Xr.shape[0])
        Xs, ys = cut(Xr, p.n_micro), cut(yr, p.n_micro)
        self.bubbles.append(bubbles(p, simulate(p))[0])
        run = (SplitPass if p.split else ReplicaPass)(Xs, ys, P, places, self.stages, self.elems,
                                                      self.recompute, self.S, True)
        metrics = run.run(run_order(p))
        took = run.median_durations()
        self.measured.append(bubbles(p, simulate(p, took), took)[0])
        self.took = (self.took or []) + [took]
        return metrics


def per_phase(took):
    """{phase: mean seconds} over every stage and pass of `took` (Timed.took): the stages equal."""
    seconds = {}
    for durations in took:
        for (phase, _), s in durations.items():
            seconds.setdefault(phase, []).append(s)
    return {phase: float(np.mean(s)) for phase, s in seconds.items()}


def stage_medians(took, phase):
    """[median seconds of `phase` on stage k over the passes] for every stage k."""
    by_stage = {}
    for durations in took:
        for (ph, k), s in durations.items():
            if ph == phase:
                by_stage.setdefault(k, []).append(s)
    return [float(np.median(by_stage[k])) for k in sorted(by_stage)]


def side_by_side(took, costs, timed):
    """{"F0": [measured, FLOPs, timed], ...}: each (phase, stage)'s median measured seconds
    (Timed.took) over a stage's median forward, beside its price from the FLOPs and from its
    actions timed before the run (both in the same unit)."""
    forward = float(np.mean(stage_medians(took, "F")))
    return {f"{ph}{k}": [float(np.median([t[(ph, k)] for t in took if (ph, k) in t])) / forward, c, timed[(ph, k)]]
            for (ph, k), c in sorted(costs.items(), key=lambda kv: (kv[0][1], "FBW".index(kv[0][0])))}


def one_schedule(net, params, ctx, name, V, X, y, steps, lr):
    """(durations timed before the run, relative; the measured bubble; Timed.took) of schedule
    `name` at p=STAGES, m=MICRO: its actions timed on one micro-batch (strategies/pipeline/stage_times.py),
    one warm-up step, `steps` measured steps."""
    model = Timed(params, ctx, "momentum", MICRO, stages=STAGES, schedule=name, model=net,
                  virtual_stages=V, measure=True)
    timed = relative(stage_times(model, X.shape[0] // MICRO, repeats=20))
    model.step(X, y, lr)
    model.end_epoch(lr)
    model.took = []
    for _ in range(steps):
        model.step(X, y, lr)
    return timed, model.end_epoch(lr)["bubble_measured"], model.took


def schedule_bubbles(net, batch, steps, lr, rounds=3):
    """{schedule: figures} at p=STAGES, m=MICRO on cpu(0..3), `rounds` rounds of every schedule in
    turn (a drift of the machine reaches each alike), each round's figures kept ("rounds": the dry
    run's timed bubble, the measured one, their ratio) and their medians:
      dry_run, dry_run_over_compute, formula   unit durations (idle share of device time; over
                     ideal compute beside the papers' formula)
      dry_run_flops  priced with the model's FLOPs (strategies/pipeline/stage_costs.py)
      dry_run_timed  priced with its actions timed on one micro-batch before the run
                     (strategies/pipeline/stage_times.py): what the measured bubble is compared with
      measured       each action of the run timed alone, the schedule replayed with the (phase,
                     stage) medians (end_epoch's "bubble_measured"), over ratios to both prices
      equal_stages   the same replayed with the stages made equal (per-phase means)
      phase_ms, stage_spread, durations   per-phase means, each phase's slowest stage over its
                     fastest, each (phase, stage)'s measured median beside its two prices"""
    ctx, params = [mx.cpu(i) for i in range(STAGES)], net.init_params(0)
    X, y = random_batch(batch)
    runs = {name: [] for name, _ in SCHEDULES}
    for _ in range(rounds):
        for name, V in SCHEDULES:
            runs[name].append(one_schedule(net, params, ctx, name, V, X, y, steps, lr))
    out = {}
    for name, V in SCHEDULES:
        p = plan(name, STAGES, MICRO, V)
        (share, ratio), costs = bubbles(p, simulate(p)), plan_costs(net, p)
        flops = priced(p, costs)[0]
        took = [t for _, _, took in runs[name] for t in took]
        each = [dict(dry_run_timed=priced(p, timed)[0], measured=measured) for timed, measured, _ in runs[name]]
        for r in each:
            r["ratio"] = r["measured"] / r["dry_run_timed"]
        by_times, measured = (float(np.median([r[k] for r in each])) for k in ("dry_run_timed", "measured"))
        timed = {key: float(np.median([t[key] for t, _, _ in runs[name]])) for key in costs}
        equal = per_phase(took)
        out[name] = dict(virtual=V, dry_run=share, dry_run_over_compute=ratio, formula=formula(p),
                         dry_run_flops=flops, dry_run_timed=by_times, measured=measured,
                         measured_over_flops=measured / flops, measured_over_dry_run=measured / by_times,
                         measured_over_unit=measured / share, rounds=each,
                         equal_stages=bubbles(p, simulate(p, equal), equal)[0],
                         phase_ms={ph: s * 1e3 for ph, s in equal.items()},
                         stage_spread={ph: max(m) / min(m) for ph in equal for m in [stage_medians(took, ph)]},
                         durations=side_by_side(took, costs, timed))
    return out


def bubble_net(blocks, d_model):
    """The transformer of the bubble runs: `blocks` blocks + embed + head (issue 22's 8: 10 layers;
    interleaved's 4 x 2 stages need 8), width d_model."""
    return build("transformer", layers=blocks, d_model=d_model, heads=4)


def run_steps(model, X, y, lr, steps):
    """(loss per example of each step, seconds of the steps after the first)."""
    losses, start = [], None
    for i in range(steps):
        if i == 1:
            nd.waitall()
            start = perf_counter()
        metrics = model.step(X, y, lr)
        losses.append(sum(float(l.asscalar()) for l, _ in metrics) / len(X))
    nd.waitall()
    return losses, perf_counter() - start


def meshes(model_flags, batch, steps, n):
    """{"one context": {...}, layout: {...}} of mesh_layouts(n): each built by the trainer from the
    same parameters, `steps` momentum steps on one random batch: the loss of each step, its largest
    relative difference from one context's, and images/s of the steps after the first; a layout
    the trainer refuses: {"left_out": why}."""
    X, y = random_batch(batch, seed=1)
    ref_cfg = trainer_config(model_flags, batch, 1, [])
    ref, seconds = run_steps(built(ref_cfg, 1), X, y, ref_cfg.lr, steps)
    out = {"one context": dict(contexts=1, losses=ref, images_per_sec=(steps - 1) * batch / seconds)}
    for name, flags in mesh_layouts(n):
        try:
            cfg = trainer_config(model_flags, batch, n, flags)
            model = built(cfg, n)
        except UsageError as e:
            out[name] = dict(contexts=n, left_out=str(e))
            continue
        losses, seconds = run_steps(model, X, y, cfg.lr, steps)
        out[name] = dict(contexts=n, losses=losses, images_per_sec=(steps - 1) * batch / seconds,
                         loss_rel_diff=max(abs(a - b) / abs(b) for a, b in zip(losses, ref)))
    return out
