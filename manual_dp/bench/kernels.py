"""Where the fast step's time goes, on any model: every MXNet operator of its cached graph, forward
and backward (MXNet's profiler), then every oneDNN primitive with the kernel that ran it and, for the
convolutions and inner products, its GFLOP/s; then what those products alone allow on this
machine's cores.

    python -m manual_dp.bench.kernels [--model NAME and its sizes] [--batch 128] [--conv-pad N] [--steps 8]

The graph runs forward and backward on cpu(0) with one thread per operator, what each context gets
with two contexts on two cores; `batch` is one context's share of the global batch (128 of the
default 256 on two contexts). Two child processes measure it: one under oneDNN's verbose output
(DNNL_VERBOSE=1, which times each primitive by the clock), one under MXNet's profiler with every
operator its own engine operation (bulking off, so that each is timed: a little more engine work
than the fast step does). Each prints the whole step's CPU time beside its listed total; on a busy
machine a listed total can exceed it. Operators that oneDNN does not run (transposes, elementwise
arithmetic, softmax's backward, batch_dot) appear only in the first table.
"""
import argparse
import json
import os
import re
import subprocess
import sys
from collections import defaultdict

from ..cli.options import OneLineParser
from ..cli.output import ends_on_signals, parsed_or_exit
from .modes import add_model_flags, checked_model, network

PROG = "python -m manual_dp.bench.kernels"
BEGIN, END = "== measured steps begin", "== measured steps end"
OPERATORS = "== operators "                    # + the profiler's JSON, on one line
SHOWN = 0.005                                  # rows below this share of their table's total are summed


def child(args, kind):
    """Warm up, then run args.steps forward and backward passes of the model's cached graph between
    the two marker lines (kind "profile": under MXNet's profiler, printed after them); prints the
    CPU milliseconds per image of the measured steps."""
    from ..fast import autotune
    pad = args.conv_pad or (autotune.conv_pad(say=lambda line: print(line, file=sys.stderr))
                            if args.model == "lenet" else 1)
    run = autotune.graph_steps(pad, args.batch, network(args), timed=kind == "profile")
    run(3)
    if kind == "profile":
        from mxnet import profiler
        profiler.set_config(profile_symbolic=True, profile_imperative=True, profile_memory=False,
                            profile_api=False, aggregate_stats=True, filename=os.devnull)
        profiler.set_state("run")
    print(BEGIN, flush=True)
    start = sum(os.times()[:2])
    run(args.steps)
    cpu = sum(os.times()[:2]) - start
    print(END, flush=True)
    if kind == "profile":
        profiler.set_state("stop")
        print(OPERATORS + json.dumps(json.loads(profiler.dumps(format="json"))["Time"].get("operator", {})))
    print(f"step cpu ms per image {cpu * 1e3 / (args.steps * args.batch):.6f}", flush=True)


def problem_flops(primitive, problem):
    """FLOPs of one call of a convolution or inner product from oneDNN's problem descriptor
    (e.g. mb128_ic24oc56_ih13oh9kh5sh1dh0ph0_iw13ow9kw5sw1dw0pw0, mb128ic896oc128); else 0."""
    dims = {k: int(v) for k, v in re.findall(r"([a-z]+)(\d+)", problem.replace("_", ""))}
    if primitive == "convolution":
        return 2 * dims["mb"] * dims["oc"] * dims["ic"] * dims.get("oh", 1) * dims.get("ow", 1) \
            * dims.get("kh", 1) * dims.get("kw", 1)
    if primitive == "inner_product":
        return 2 * dims["mb"] * dims["oc"] * dims["ic"]
    return 0


def read_verbose(lines):
    """(rows, step cpu ms per image or None) from the verbose child's output: one row per
    (primitive, kernel, direction, problem) of the measured steps: calls, total ms, FLOPs per call."""
    rows, inside, step_ms = defaultdict(lambda: {"calls": 0, "ms": 0.0}), False, None
    for line in lines:
        if line.startswith(BEGIN) or line.startswith(END):
            inside = line.startswith(BEGIN)
        elif line.startswith("step cpu ms per image"):
            step_ms = float(line.split()[-1])
        elif inside and ",exec," in line:
            f = line.split(",")
            if len(f) < 8 or f[1] != "exec":
                continue
            key = (f[3], f[4], f[5], f[-2])
            rows[key]["calls"] += 1
            rows[key]["ms"] += float(f[-1])
    out = [dict(primitive=p, kernel=k, direction=d, problem=prob, flops=problem_flops(p, prob), **v)
           for (p, k, d, prob), v in rows.items()]
    return sorted(out, key=lambda r: -r["ms"]), step_ms


def read_operators(lines):
    """(rows, step cpu ms per image or None) from the profiling child's output: one row per MXNet
    operator of the measured steps (the profiler's aggregate): calls and total ms, slowest first."""
    rows, step_ms = [], None
    for line in lines:
        if line.startswith(OPERATORS):
            stats = json.loads(line[len(OPERATORS):])
            rows = [dict(operator=name, calls=s["Count"], ms=s["Total"]) for name, s in stats.items()]
        elif line.startswith("step cpu ms per image"):
            step_ms = float(line.split()[-1])
    return sorted(rows, key=lambda r: -r["ms"]), step_ms


def measure(argv, model, kind):
    """The output lines of a child run of `kind` ("verbose" or "profile") with the arguments argv."""
    from ..fast.runtime import thread_env, usable_cores
    env = dict(os.environ, **thread_env(usable_cores(), model=model))
    if kind == "verbose":
        env.update(DNNL_VERBOSE="1", MKLDNN_VERBOSE="1")
    done = subprocess.run([sys.executable, "-m", "manual_dp.bench.kernels", *argv, "--child", kind],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError((done.stderr.strip().splitlines() or ["the measuring process failed"])[-1])
    return done.stdout.splitlines()


def listed(total, step_ms, what):
    return (f"listed {what}: {total:.3f} ms per image (their own clocks)"
            + (f"; the whole step: {step_ms:.3f} CPU ms per image" if step_ms else ""))


def report_operators(rows, step_ms, images, steps):
    """Prints MXNet's operators, slowest first; returns their listed ms per image."""
    total = sum(r["ms"] for r in rows) / images
    print(f"{'ms/img':>7} {'share':>6} {'calls/step':>10}  MXNet operator")
    small = [r for r in rows if r["ms"] / images < SHOWN * total]
    for r in rows:
        if r not in small:
            ms = r["ms"] / images
            print(f"{ms:7.3f} {ms / total:6.1%} {r['calls'] / steps:10.1f}  {r['operator']}")
    if small:
        ms = sum(r["ms"] for r in small) / images
        print(f"{ms:7.3f} {ms / total:6.1%} {sum(r['calls'] for r in small) / steps:10.1f}  "
              f"{len(small)} others, each under {SHOWN:.1%}")
    print(listed(total, step_ms, "MXNet operators") + "\n")
    return total


def report(rows, step_ms, images, cores):
    """Prints oneDNN's primitives and what the products alone allow; returns the listed ms per image."""
    total = sum(r["ms"] for r in rows) / images
    print(f"{'ms/img':>7} {'share':>6} {'GFLOP/s':>8}  {'primitive':14} {'kernel':13} {'direction':17} problem")
    for r in rows:
        ms = r["ms"] / images
        if ms < 0.002:
            continue
        rate = f"{r['flops'] * r['calls'] / r['ms'] / 1e6:.1f}" if r["flops"] else ""
        print(f"{ms:7.3f} {ms / total:6.1%} {rate:>8}  {r['primitive']:14} {r['kernel']:13} "
              f"{r['direction']:17} {r['problem']}")
    print("\n" + listed(total, step_ms, "oneDNN primitives"))
    kind = "convolution" if any(r["primitive"] == "convolution" for r in rows) else "inner_product"
    products = sum(r["ms"] for r in rows if r["primitive"] == kind) / images
    if products:
        name = "convolutions" if kind == "convolution" else "inner products (dense layers)"
        print(f"the {name} alone: {products:.3f} ms per image, so at their speed {cores} core(s) train at "
              f"most {cores * 1e3 / products:,.0f} images/s; the whole step at most "
              f"{cores * 1e3 / (step_ms or total):,.0f}")
    return total


def parse(argv):
    """The checked arguments; UsageError (one line) for values no run can use."""
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_model_flags(p)
    p.add_argument("--batch", type=int, default=128, help="images per step on the one context")
    p.add_argument("--conv-pad", type=int, help="--model lenet: the graph's channel padding (default: this "
                                                "machine's autotuned choice)")
    p.add_argument("--steps", type=int, default=8, help="measured steps, after 3 of warm-up")
    p.add_argument("--child", choices=("verbose", "profile"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.batch, args.steps, args.conv_pad or 1, args.width) < 1:
        p.error("--batch, --steps, --width and --conv-pad must be >= 1")
    if args.conv_pad and args.model != "lenet":
        p.error(f"--conv-pad pads LeNet's convolutions in the cached graph; --model {args.model} takes none")
    return checked_model(args)


@ends_on_signals(PROG)   # Ctrl-C, SIGTERM, SIGHUP: one line
def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parsed_or_exit(parse, argv, PROG)
    if args.child:
        return child(args, args.child)
    parsed_or_exit(network, args, PROG)                 # a model file that fails: one line, before the children
    from ..fast.runtime import machine, usable_cores
    from .command import commit
    try:
        verbose, operators = (measure(argv, args.model, kind) for kind in ("verbose", "profile"))
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        sys.exit(f"{PROG}: the measuring process failed: {e}")
    m, images = machine(), args.steps * args.batch
    print(f"{m['cpu']} ({m['vector']}), {m['cores']} cores, commit {commit()}: --model {args.model}, "
          f"{args.steps} steps of {args.batch} images on cpu(0), one thread per operator\n")
    report_operators(*read_operators(operators), images, args.steps)
    report(*read_verbose(verbose), images, m["cores"])


if __name__ == "__main__":
    main()
