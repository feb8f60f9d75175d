"""`python -m manual_dp.bench.meshes`: issue 22's targets for meshes, sequence and context
parallelism and the pipeline schedules, measured side by side in one run (manual_dp.bench.mesh_runs).

    activations  the largest per-context activation bytes of each layout (one context; tp=2, 4 with
                 and without --sequence-parallel; cp=2, 4 ring and ulysses; dp x pp x tp with and
                 without +sp; pp x cp), each in a fresh process as the trainer measures them; SP/TP
                 beside Megatron-SP's prediction, CP's per context over one context's beside 1/C
    bubbles      gpipe, 1f1b, interleaved (V=2), zb-h1 at p=4, m=8 on an 8-block transformer, three
                 rounds of the four in turn: the dry run's bubble (unit durations; priced with the
                 model's FLOPs; priced with its actions timed on one micro-batch before the run)
                 and the measured one (each action timed alone, the schedule replayed with the
                 measured times), the same replayed with the stages made equal, and each action's
                 measured time beside its two prices
    meshes       --cpus contexts (default 8) as dp x pp x tp (+sp), dp x pp x cp, dp x cp=4, dp x tp=2
                 and (a multiple of 8) dp x pp x cp x tp:
                 each layout's loss beside one context's; images/s, not a speed target

Bubbles and bytes are the targets here; on CPU contexts sharing a few cores speed is not. --quick
measures tiny sizes (and fewer activation layouts) in under a minute, for the tests. Prints the
machine and commit first; --out FILE gets every number as JSON.
"""
import json
import os
from pathlib import Path

from ..cli.options import OneLineParser, trainer_config
from ..cli.output import ends_on_signals, parsed_or_exit
from ..errors import UsageError
from ..fast.runtime import configure, machine, usable_cores

ABOUT = 0.25                # "about the factor", "within 25%": a measured ratio over its prediction
SETTINGS = {                # model flags (parts 1 and 3), batch, steps, the bubble runs' d_model and batch
    "full": dict(model=[], batch=64, steps=3, bubble_d_model=64, bubble_batch=128, layouts=None),
    "quick": dict(model=["--layers", "2", "--d-model", "16", "--heads", "4"], batch=8, steps=2,
                  bubble_d_model=16, bubble_batch=8,
                  layouts=("one context", "tp=2", "tp=2 +sp", "cp=2 ring", "cp=2 ulysses",
                           "dp=2 x pp=2 x tp=2", "dp=2 x pp=2 x tp=2 +sp")),
}
SP_PAIRS = (("tp=2", "tp=2 +sp", 2), ("tp=4", "tp=4 +sp", 4), ("dp=2 x pp=2 x tp=2", "dp=2 x pp=2 x tp=2 +sp", 2))
CP_LAYOUTS = (("cp=2 ring", 2), ("cp=2 ulysses", 2), ("cp=4 ring", 4), ("cp=4 ulysses", 4), ("pp=2 x cp=2", 2))


def megatron_sp(s, h, a, t):
    """Megatron-SP's activations per layer with sequence parallelism over those of tensor
    parallelism alone (Korthikanti et al. 2022): sbh(34/t + 5as/(ht)) / sbh(10 + 24/t + 5as/(ht))."""
    attention = 5 * a * s / (h * t)
    return (34 / t + attention) / (10 + 24 / t + attention)


def build_parser():
    p = OneLineParser(prog="python -m manual_dp.bench.meshes", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and fewer layouts, for the tests")
    p.add_argument("--out", help="write every number to this JSON file (default: print only)")
    p.add_argument("--cpus", type=int, default=8, help="contexts of the mesh runs: a multiple of 4 from 4 to 64 "
                                                        "(default 8: dp=2 x pp=2 x tp=2...)")
    for flag, help in (("--layers", "blocks"), ("--d-model", "token width"), ("--heads", "heads"),
                       ("--patch", "P x P patch tokens")):
        p.add_argument(flag, type=int, help=f"the transformer of the activations and the mesh runs: {help} "
                                            f"(default: the trainer's; --quick's tiny one)")
    p.add_argument("--bubble-layers", type=int, default=8, help="blocks of the bubble runs' transformer, plus "
                                                                 "embed and head (default 8: 10 layers, 8 needed)")
    p.add_argument("--batch", type=int, help="examples a step (default 64; --quick 8)")
    p.add_argument("--steps", type=int, help="steps of each mesh run and bubble run, the first not timed "
                                             "(default 3; --quick 2)")
    return p


def parse(argv):
    """The checked arguments with their settings filled in; UsageError (one line) for bad values."""
    args = build_parser().parse_args(argv)
    plan = dict(SETTINGS["quick" if args.quick else "full"])
    if not (4 <= args.cpus <= 64 and args.cpus % 4 == 0):
        raise UsageError(f"--cpus must be a multiple of 4 from 4 to 64, got {args.cpus}")
    sizes = [(f, getattr(args, f.replace("-", "_"))) for f in ("layers", "d-model", "heads", "patch")]
    if any(v is not None for _, v in sizes):
        plan["model"] = [x for f, v in sizes if v is not None for x in (f"--{f}", str(v))]
    plan["batch"], plan["steps"] = args.batch or plan["batch"], args.steps or plan["steps"]
    if plan["batch"] < max(8, args.cpus) or plan["steps"] < 2:
        raise UsageError(f"--batch must be >= 8 and >= --cpus, --steps >= 2 (got {plan['batch']}, {plan['steps']})")
    if args.bubble_layers < 6:
        raise UsageError(f"--bubble-layers must be >= 6 (interleaved's 4 x 2 stages need 8 layers), "
                         f"got {args.bubble_layers}")
    if args.out and Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} is a directory, not a file")
    trainer_config(plan["model"], plan["batch"], 1, [])        # the model's sizes, as the trainer checks them
    args.plan = plan
    return args


def marked(met):
    return "target met" if met else "target MISSED"


def sp_ratios(acts, s, h, a):
    """[{"layouts", "t", "measured", "predicted", "met"}]: SP's largest per-context activations
    over TP's, beside megatron_sp; met if below 1 and within ABOUT of the prediction."""
    rows = []
    for tp, sp, t in SP_PAIRS:
        if "largest" in acts.get(tp, {}) and "largest" in acts.get(sp, {}):
            measured, predicted = acts[sp]["largest"] / acts[tp]["largest"], megatron_sp(s, h, a, t)
            rows.append(dict(layouts=[tp, sp], t=t, measured=measured, predicted=predicted,
                             met=measured < 1 and abs(measured / predicted - 1) <= ABOUT))
    return rows


def cp_ratios(acts):
    """[{"layout", "c", "measured", "expected", "met"}]: a layout's largest per-context activations
    over one context's, beside 1/C (met: at most ABOUT above it; below it is no miss: ring attention
    keeps none of the T x T scores one context keeps); pp x cp beside 1/(2C), no target."""
    rows, one = [], acts.get("one context", {}).get("largest")
    for name, C in CP_LAYOUTS:
        if one and "largest" in acts.get(name, {}):
            measured, expected = acts[name]["largest"] / one, 1 / C / (2 if name.startswith("pp") else 1)
            rows.append(dict(layout=name, c=C, measured=measured, expected=expected,
                             met=None if name.startswith("pp") else measured / expected - 1 <= ABOUT))
    return rows


def bubble_targets(b):
    """{target: met} of the bubbles (schedule_bubbles' figures)."""
    out = {f"dry run ({how}): {name} below 1f1b": b[name][key] < b["1f1b"][key]
           for how, key in (("unit", "dry_run"), ("FLOPs", "dry_run_flops")) for name in ("interleaved", "zb-h1")}
    out.update({f"measured {name} within {ABOUT:.0%} of the dry run (timed)": abs(f["measured_over_dry_run"] - 1) <= ABOUT
                for name, f in b.items()})
    return out


def print_activations(acts, sp, cp, where):
    from ..memory import format_bytes
    print(f"activations per context (largest; measured in a fresh process each, one scratch buffer per device; "
          f"'shapes': computed from the layer shapes where MXNet's profiler cannot count every context, {where}):")
    for name, r in acts.items():
        print(f"  {name:24} " + (f"left out: {r['left_out']}" if "left_out" in r else
                                 f"{format_bytes(r['largest']):>10} on {r['contexts']} contexts ({r['method']})"))
    for r in sp:
        print(f"  SP/TP {r['layouts'][1]:24} {r['measured']:.3f}, Megatron-SP predicts {r['predicted']:.3f} "
              f"({r['measured'] / r['predicted']:.2f}x): {marked(r['met'])}")
    for r in cp:
        print(f"  {r['layout']:14} / one context {r['measured']:.3f}, " + (
            f"1/C = {r['expected']:.3f} ({r['measured'] / r['expected']:.2f}x): {marked(r['met'])}"
            if r["met"] is not None else
            f"1/(pp C) = {r['expected']:.3f} (no target)"))


def print_bubbles(b, targets, layers):
    rounds = len(next(iter(b.values()))["rounds"])
    print(f"bubbles, p=4, m=8, {layers} layers, medians of {rounds} rounds (idle share of device time; dry run: unit "
          f"durations, priced with the model's FLOPs (strategies/pipeline/stage_costs.py), and with its actions timed on one "
          f"micro-batch before the run (strategies/pipeline/stage_times.py); measured: each action timed alone between "
          f"waitall()s, the schedule replayed with the (phase, stage) medians; stages equal: replayed with the "
          f"per-phase means, every stage alike; per stage: measured over a stage's forward, [FLOPs' price, timed price]):")
    for name, f in b.items():
        print(f"  {name + (' V=2' if f['virtual'] > 1 else ''):15} dry run {f['dry_run']:.3f} "
              f"({f['dry_run_over_compute']:.3f} of compute, formula {f['formula']:.3f}), FLOPs {f['dry_run_flops']:.3f}, "
              f"timed {f['dry_run_timed']:.3f}  measured {f['measured']:.3f} ({f['measured_over_dry_run']:.2f}x timed, "
              f"{f['measured_over_flops']:.2f}x FLOPs', {f['measured_over_unit']:.2f}x unit's)  stages equal "
              f"{f['equal_stages']:.3f}  ms " + " ".join(f"{ph}={ms:.1f}" for ph, ms in f["phase_ms"].items())
              + "  slowest/fastest stage " + " ".join(f"{ph} {x:.1f}x" for ph, x in f["stage_spread"].items()))
        print("      rounds (measured/timed) " + "  ".join(f"{r['measured']:.3f}/{r['dry_run_timed']:.3f} = {r['ratio']:.2f}x"
                                                        for r in f["rounds"]))
        print("      per stage " + " ".join(f"{k} {m:.2f} [{c:.2f}, {t:.2f}]" for k, (m, c, t) in f["durations"].items()))
    for target, met in targets.items():
        print(f"  {target}: {marked(met)}")


def print_meshes(m):
    print("mesh runs (the trainer's layouts from the same parameters; images/s: not a speed target):")
    for name, r in m.items():
        print(f"  {name:22} " + (f"left out: {r['left_out']}" if "left_out" in r else
                                 f"{r['images_per_sec']:7.1f} img/s  loss " + " ".join(f"{l:.5f}" for l in r["losses"])
                                 + (f"  rel. diff {r['loss_rel_diff']:.1e}: {marked(r['loss_rel_diff'] <= 1e-4)}"
                                    if "loss_rel_diff" in r else "")))


@ends_on_signals("python -m manual_dp.bench.meshes")   # Ctrl-C, SIGTERM, SIGHUP: one line
def main(argv=None):
    args = parsed_or_exit(parse, argv, "python -m manual_dp.bench.meshes")
    configure(args.cpus)                             # thread settings before MXNet loads
    import time
    from . import mesh_runs
    from .command import commit, cores_available
    plan = args.plan
    where = dict(machine(), commit=commit(), load_before=os.getloadavg(), cores_free=cores_available(0.5),
                 time=time.strftime("%Y-%m-%d %H:%M:%S"), cpus=args.cpus, bubble_layers=args.bubble_layers,
                 settings=plan)
    print(f"{where['cpu']} ({where['vector']}), {where['cores']} cores, commit {where['commit']}; "
          f"{where['cores_free']:.2f} cores free for this run, load average {where['load_before'][0]:.1f}", flush=True)
    net = mesh_runs.network(trainer_config(plan["model"], plan["batch"], 1, []))
    s, h, a = net.tokens, net.config["d_model"], net.config["heads"]
    acts = mesh_runs.activations(plan["model"], plan["batch"], usable_cores(), plan["layouts"])
    sp, cp = sp_ratios(acts, s, h, a), cp_ratios(acts)
    print_activations(acts, sp, cp, f"transformer {net.config}, {s} tokens, batch {plan['batch']}")
    bubble_net = mesh_runs.bubble_net(args.bubble_layers, plan["bubble_d_model"])
    b = mesh_runs.schedule_bubbles(bubble_net, plan["bubble_batch"], plan["steps"], 0.05)
    bt = bubble_targets(b)
    print_bubbles(b, bt, len(bubble_net.layers))
    m = mesh_runs.meshes(plan["model"], plan["batch"], plan["steps"], args.cpus)
    print_meshes(m)
    targets = dict({f"SP/TP {r['layouts'][1]} about Megatron-SP's": r["met"] for r in sp},
                   **{f"{r['layout']} at most about 1/C of one context": r["met"] for r in cp if r["met"] is not None},
                   **bt,
                   **{f"{name} loss equal to one context's": r["loss_rel_diff"] <= 1e-4
                      for name, r in m.items() if "loss_rel_diff" in r})
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(where, model=net.describe(), activations=acts, sp_ratios=sp,
                                                  cp_ratios=cp, bubbles=b, meshes=m, targets=targets), indent=1))


if __name__ == "__main__":
    main()
