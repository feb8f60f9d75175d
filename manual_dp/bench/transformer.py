"""`python -m manual_dp.bench.transformer`: the small vision transformer (manual_dp.models.transformer),
or with --model gpt the GPT (manual_dp.models.gpt), trained three ways side by side, in adjacent groups
repeated --pairs times:

    torch      PyTorch, the same network holding copies of our initial parameters (bench.peer_torch),
               one process using every core
    manual_dp  manual_dp's fast step (DataParallel: cached graph, fused buffers) on 2 CPU contexts
    lesson     the lesson's step (DataParallel(lesson=True)) on 2 CPU contexts

Every measurement runs in a fresh child process with its own thread settings (as in the main bench):
the same random images and labels (the GPT: random windows of byte tokens, the next token at each
position), the same start, plain SGD at the same lr on the same batches; one warm-up pass of --steps
steps, then REPEATS timed passes, the median kept. The ratios fast / PyTorch and fast / lesson are
medians over the groups, each taken between measurements minutes apart at most; the share of the peak
is examples/s x the model's training FLOPs per example (Model.flops_per_example) over a float32 GEMM's
GFLOP/s, measured in the same run. The GPT's throughput is in tokens/s, and its report adds the work
per rank of causal context-parallel attention, contiguous and balanced cuts (untimed). Writes
OUT/transformer.json (OUT/gpt.json). The models and one measurement: bench/transformer_models.py.
"""
import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from ..cli.options import OneLineParser, positive
from ..cli.output import parsed_or_exit
from ..fast.runtime import machine, usable_cores
from .transformer_models import MODELS, measure

PROG = "python -m manual_dp.bench.transformer"
IMPLS = ("torch", "manual_dp", "lesson")            # one group: measured in this order
LABELS = {"torch": "PyTorch, 1 process, every core", "manual_dp": "manual_dp fast step, 2 contexts",
          "lesson": "the lesson's step, 2 contexts"}
CONTEXTS = 2                                         # manual_dp's CPU contexts
LR = 0.05                                            # RunConfig's lr; plain SGD everywhere
REPEATS = 3                                          # timed passes per measurement, after one warm-up
TIMEOUT = 600.0                                      # seconds allowed to one child process
GEMM = 2048                                          # the peak's matrix size (as the main bench's)


# --- one measurement, in a fresh child process (transformer_models.measure) -------------------------
def child_env(impl, model):
    """The environment of a measurement of `model`: runtime's thread settings for every core in one
    process (PyTorch) or for manual_dp's CPU contexts."""
    from .command import worker_env
    return worker_env("tuned", 1 if impl == "torch" else CONTEXTS, model=model)


def run_child(spec, env, timeout=TIMEOUT):
    """The record printed by one child process (`--child SPEC`), or one saying why there is none."""
    cmd = [sys.executable, "-m", "manual_dp.bench.transformer", "--child", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(spec, error=f"timed out after {timeout:.0f} s")
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(spec, error=f"exit {done.returncode}: {tail}")
    return json.loads(lines[-1])


# --- the run: peak, groups, summary ---------------------------------------------------------------
def peak():
    """({kernel: GFLOP/s}, the best): a float32 GEMM on a team of every core's threads and on one
    thread times the cores (bench.worker's "peak", as the main bench measures it)."""
    from .command import run_worker, worker_env
    found = {}
    for cores in sorted({1, usable_cores()}):
        spec = {"bench": "peak", "impl": "gemm", "n": GEMM, "repeats": 3, "cores": cores}
        found.update({r["impl"]: r["gflops"] for r in run_worker(spec, worker_env("tuned", cores), TIMEOUT)
                      if "error" not in r})
    return found, max(found.values(), default=0.0)


def spec_of(args, impl):
    """What a child measures: `impl` on the command's model and sizes, synthetic data, SGD ("images":
    the examples of a pass)."""
    return {"bench": "train", "impl": impl, "env": "tuned", "options": {}, "model": args.model,
            "layers": args.layers, "d_model": args.d_model, "heads": args.heads,
            "devices": 1 if impl == "torch" else CONTEXTS, "threads": usable_cores(),
            "batch": args.batch_size, "images": args.batch_size * args.steps, "repeats": REPEATS,
            "lr": LR, "seed": 0, "data": "synthetic", **MODELS[args.model].settings(args)}


def impls():
    """The implementations this machine can run: PyTorch's only where it is installed."""
    return [i for i in IMPLS if i != "torch" or importlib.util.find_spec("torch")]


def groups(args, say):
    """Records of --pairs adjacent groups, each implementation once a group in IMPLS' order, each
    in its own child process; say(line) after each."""
    rows = []
    for g in range(args.pairs):
        for impl in impls():
            r = dict(run_child(spec_of(args, impl), child_env(impl, args.model)), group=g, label=LABELS[impl])
            rows.append(r)
            say(f"  group {g + 1}: {format_row(r, MODELS[args.model])}")
    return rows


def add_shares(rows, peak_gflops):
    """Afterwards every measured row has gflops (training FLOPs done per second) and peak_share."""
    for r in rows:
        if "error" not in r:
            r["gflops"] = r["images_per_sec"] * r["flops_per_image"][1] / 1e9
            r["peak_share"] = r["gflops"] / peak_gflops if peak_gflops else None


def summarise(rows, peak_gflops, subject):
    """(per implementation: median images/s (and the subject's rate: tokens/s) over the groups, its
    GFLOP/s and share of the peak; the ratios fast / PyTorch and fast / lesson, each the median over
    the groups that measured both)."""
    from .report import in_adjacent_pairs
    by_impl, by_group = defaultdict(list), defaultdict(dict)
    for r in rows:
        if "error" not in r:
            by_impl[r["impl"]].append(r)
            by_group[r["group"]][r["impl"]] = r
    summary = []
    for impl in IMPLS:
        if by_impl[impl]:
            rates = {k: statistics.median(r[k] for r in by_impl[impl])
                     for k in dict.fromkeys(("images_per_sec", subject.rate))}
            ips, flops = rates["images_per_sec"], by_impl[impl][0]["flops_per_image"][1]
            summary.append({"impl": impl, "label": LABELS[impl], **rates, "groups": len(by_impl[impl]),
                            "gflops": ips * flops / 1e9, "peak_share": ips * flops / 1e9 / peak_gflops if peak_gflops else None,
                            "final_loss": by_impl[impl][0]["final_loss"]})
    ratios = []
    for peer, name in (("torch", "fast / PyTorch"), ("lesson", "fast / lesson")):
        both, values = in_adjacent_pairs(by_group, peer)
        if values:
            ratios.append({"ratio": name, "peer": peer, "median": statistics.median(values), "group_ratios": values,
                           "loss_difference": abs(both[0]["manual_dp"]["final_loss"] - both[0][peer]["final_loss"])})
    return summary, ratios


def format_row(r, subject):
    """One measurement as a line."""
    if "error" in r:
        return f"{r['label']:34} failed: {r['error']}"
    return (f"{r['label']:34} {r[subject.rate]:8.0f} {subject.unit}  "
            f"{r['cpu_ms_per_image']:7.3f} CPU ms/{subject.example}  "
            f"loss {r['final_loss']:.4f}  (load {r['load_before']:.2f})")


def table(summary, ratios, peak_gflops, subject):
    """The summary and the ratios as text."""
    lines = [f"\n{'implementation':34} {subject.unit:>8} {'GFLOP/s':>8} {'% peak':>7} {'loss':>8}   "
             f"(median of the groups; peak: GEMM at {peak_gflops:.0f} GFLOP/s)"]
    for s in summary:
        share = "" if s["peak_share"] is None else f"{s['peak_share']:.1%}"
        lines.append(f"{s['label']:34} {s[subject.rate]:8.0f} {s['gflops']:8.1f} {share:>7} {s['final_loss']:8.4f}")
    for r in ratios:
        lines.append(f"{r['ratio']:14} {r['median']:5.2f}x  (median of {len(r['group_ratios'])} adjacent groups: "
                     + ", ".join(f"{v:.2f}" for v in r["group_ratios"]) + f"; loss difference {r['loss_difference']:.1e})")
    return "\n".join(lines)


def run(args):
    """Measure, print, write OUT/transformer.json (OUT/gpt.json); returns its contents."""
    from .command import commit
    where, subject = dict(machine(), commit=commit()), MODELS[args.model]
    own = subject.settings(args)
    sizes = "".join(f", {k} {v}" for k, v in own.items())
    print(f"{where['cpu']} ({where['vector']}), {where['cores']} cores, commit {where['commit']}; {subject.title} "
          f"layers {args.layers}, d_model {args.d_model}, heads {args.heads}{sizes}; batch {args.batch_size}, "
          f"{args.steps} steps a pass, SGD lr {LR}; load average {os.getloadavg()[0]:.2f}", flush=True)
    notes, lines = subject.notes(own)
    for line in lines:
        print(line, flush=True)
    if "torch" not in impls():
        print("  PyTorch is not installed (pip install -e .[bench]): its rows are left out", flush=True)
    peaks, best = peak()
    print(f"  peak: a float32 GEMM at {best:.0f} GFLOP/s, the best of "
          + ", ".join(f"{k} {g:.0f}" for k, g in peaks.items()), flush=True)
    rows = groups(args, lambda line: print(line, flush=True))
    add_shares(rows, best)
    summary, ratios = summarise(rows, best, subject)
    flops = next((r["flops_per_image"] for r in rows if "error" not in r), None)
    results = dict(where, config={"layers": args.layers, "d_model": args.d_model, "heads": args.heads, **subject.config,
                                  **own, "batch": args.batch_size, "steps": args.steps, "pairs": args.pairs, "lr": LR,
                                  "repeats": REPEATS, "data": "synthetic", "contexts": CONTEXTS},
                   time=time.strftime("%Y-%m-%d %H:%M:%S"), flops_per_image=flops, peaks=peaks, peak_gflops=best,
                   rows=rows, summary=summary, ratios=ratios, **notes, load_after=os.getloadavg()[0])
    out = Path(args.out) / f"{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(table(summary, ratios, best, subject))
    print(f"\nwrote {out}")
    return results


# --- the command line -------------------------------------------------------------------------------
def parse(argv):
    """The checked arguments; UsageError (one line) for values no run can use."""
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="transformer", help="the network (default transformer)")

    def sized(key):
        return " (default " + ", ".join(f"{m} {s.sizes[key]}" for m, s in MODELS.items()) + ")"
    p.add_argument("--layers", type=positive, help="blocks" + sized("layers"))
    p.add_argument("--d-model", type=positive, help="width of a token" + sized("d_model"))
    p.add_argument("--heads", type=positive, help="attention heads, dividing --d-model" + sized("heads"))
    p.add_argument("--seq-len", type=positive, help="gpt: tokens of a window (default the corpora's, 64)")
    p.add_argument("--batch-size", type=positive, help=f"global batch (split over {CONTEXTS} contexts; default "
                   + ", ".join(f"{m} {s.batch}" for m, s in MODELS.items()) + ")")
    p.add_argument("--steps", type=positive, default=10, help=f"SGD steps a pass ({REPEATS} timed passes after one warm-up)")
    p.add_argument("--pairs", type=positive, default=3, help="adjacent groups (PyTorch, fast step, lesson's step)")
    p.add_argument("--out", default="bench-results", help="directory for transformer.json (gpt.json)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    subject = MODELS[args.model]
    for key in ("layers", "d_model", "heads"):
        setattr(args, key, getattr(args, key) or subject.sizes[key])
    args.batch_size = args.batch_size or subject.batch
    if args.seq_len and "seq_len" not in subject.settings(args):
        p.error(f"--seq-len is the GPT's window (--model gpt); --model {args.model} reads 28 rows an image")
    if args.d_model % args.heads:
        p.error(f"--heads {args.heads} does not divide --d-model {args.d_model}")
    if args.batch_size < CONTEXTS:
        p.error(f"--batch-size must be at least {CONTEXTS}, one example per context")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        p.error(f"--out {args.out} is a file, not a directory")
    return args


def interrupted():
    """Ctrl-C: one line, then exit 130 at once (a child being measured got the signal too)."""
    print(f"{PROG}: error: interrupted", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)


def main(argv=None):
    try:
        args = parsed_or_exit(parse, argv, PROG)
        if args.child:
            print(json.dumps(measure(json.loads(args.child))), flush=True)
            return
        run(args)
    except KeyboardInterrupt:
        interrupted()


if __name__ == "__main__":
    main()
