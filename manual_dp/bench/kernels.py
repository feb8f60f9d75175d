"""Where the fast step's time goes: every oneDNN primitive of LeNet's cached graph, forward and
backward, with the kernel that ran it, its CPU milliseconds per image and, for the convolutions and
dense layers, its GFLOP/s; then what the convolutions alone allow on this machine's cores.

    python -m manual_dp.bench.kernels [--batch 128] [--conv-pad N] [--steps 8]

The step runs in a child process with oneDNN's verbose output on (DNNL_VERBOSE=1, which times each
primitive) and one thread per operator: what each context gets with two contexts on two cores.
`batch` is one context's share of the global batch (128 of the default 256 on two contexts).
MXNet's own operators (concat, the loss, argmax) are not oneDNN's and are not listed; the whole
step's CPU time is printed beside the listed total (oneDNN times each primitive by the clock, so
on a busy machine the listed total can exceed the step's CPU time).
"""
import argparse
import os
import re
import subprocess
import sys
from collections import defaultdict

from ..cli.options import OneLineParser
from ..cli.output import ends_on_signals, parsed_or_exit

BEGIN, END = "== measured steps begin", "== measured steps end"


def child(batch, conv_pad, steps):
    """Warm up, then run `steps` forward and backward passes between the two marker lines; prints
    the CPU milliseconds per image of the measured steps."""
    from ..fast.autotune import graph_steps
    run = graph_steps(conv_pad, batch)
    run(3)
    print(BEGIN, flush=True)
    start = sum(os.times()[:2])
    run(steps)
    cpu = sum(os.times()[:2]) - start
    print(END, flush=True)
    print(f"step cpu ms per image {cpu * 1e3 / (steps * batch):.6f}", flush=True)


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
    """(rows, step cpu ms per image or None) from the child's output: one row per (primitive,
    kernel, direction, problem) of the measured steps: calls, total ms, FLOPs per call."""
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


def measure(batch, conv_pad, steps):
    """Run the child under oneDNN's verbose output; read_verbose(its output lines)."""
    from ..fast.runtime import thread_env, usable_cores
    env = dict(os.environ, **thread_env(usable_cores()), DNNL_VERBOSE="1", MKLDNN_VERBOSE="1")
    cmd = [sys.executable, "-m", "manual_dp.bench.kernels", "--child", "--batch", str(batch),
           "--steps", str(steps)] + (["--conv-pad", str(conv_pad)] if conv_pad else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError((done.stderr.strip().splitlines() or ["the measuring process failed"])[-1])
    return read_verbose(done.stdout.splitlines())


def report(rows, step_ms, images, cores):
    """Prints the table and what the convolutions allow; returns the listed ms per image."""
    total = sum(r["ms"] for r in rows) / images
    print(f"{'ms/img':>7} {'share':>6} {'GFLOP/s':>8}  {'primitive':14} {'kernel':13} {'direction':17} problem")
    for r in rows:
        ms = r["ms"] / images
        if ms < 0.002:
            continue
        rate = f"{r['flops'] * r['calls'] / r['ms'] / 1e6:.1f}" if r["flops"] else ""
        print(f"{ms:7.3f} {ms / total:6.1%} {rate:>8}  {r['primitive']:14} {r['kernel']:13} "
              f"{r['direction']:17} {r['problem']}")
    conv = sum(r["ms"] for r in rows if r["primitive"] == "convolution") / images
    print(f"\nlisted oneDNN primitives: {total:.3f} ms per image (their own clocks)"
          + (f"; the whole step: {step_ms:.3f} CPU ms per image" if step_ms else ""))
    print(f"the convolutions alone: {conv:.3f} ms per image, so at their speed {cores} core(s) train at most "
          f"{cores * 1e3 / conv:,.0f} images/s; the whole step at most {cores * 1e3 / (step_ms or total):,.0f}")
    return total


def parse(argv):
    """The checked arguments; UsageError (one line) for values no run can use."""
    p = OneLineParser(prog="python -m manual_dp.bench.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=128, help="images per step on the one context")
    p.add_argument("--conv-pad", type=int, help="the graph's channel padding (default: this machine's autotuned choice)")
    p.add_argument("--steps", type=int, default=8, help="measured steps, after 3 of warm-up")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.batch, args.steps, args.conv_pad or 1) < 1:
        p.error("--batch, --steps and --conv-pad must be >= 1")
    return args


@ends_on_signals("python -m manual_dp.bench.kernels")   # Ctrl-C, SIGTERM, SIGHUP: one line
def main(argv=None):
    args = parsed_or_exit(parse, argv, "python -m manual_dp.bench.kernels")
    if args.child:
        from ..fast import autotune
        pad = args.conv_pad or autotune.conv_pad(say=lambda line: print(line, file=sys.stderr))
        return child(args.batch, pad, args.steps)
    from ..fast.runtime import machine, usable_cores
    from .command import commit
    rows, step_ms = measure(args.batch, args.conv_pad, args.steps)
    m = machine()
    print(f"{m['cpu']} ({m['vector']}), {m['cores']} cores, commit {commit()}: {args.steps} steps of "
          f"{args.batch} images on cpu(0), one thread per operator\n")
    report(rows, step_ms, args.steps * args.batch, m["cores"])


if __name__ == "__main__":
    main()
