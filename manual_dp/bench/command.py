"""`python -m manual_dp.bench`: all-reduce and training benchmarks side by side in one run, written
to DIR/results.json (a list of records with bench, impl, devices and the figures) and PNG plots.

    --quick   the default, under 3 minutes on 2 cores    --full   every payload, count and peer
    --tiny    seconds, synthetic data (for the tests)     --model  the cost model's table and plot
    --memory  every mode's measured memory per context (--width, --batch-size, --cpus)
    --local-sgd   instead, local SGD at H = 1, 4, 16: accuracy and communication rounds (bench/local_sgd.py)
    --compress  every gradient compression trained side by side (manual_dp.bench.compress)

Every measurement runs in a fresh process (manual_dp.bench.worker) whose thread settings are in
its environment before MXNet or PyTorch loads: "tuned" is manual_dp.runtime's choice for its
number of contexts, "default" is MXNet's own (the lesson as written). Figures are medians over
repeats with the first (warm-up) dropped.
"""
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from ..cli.options import OneLineParser, positive
from ..cli.output import ends_on_signals, fail, parsed_or_exit
from ..config import RunConfig
from ..costmodel_cpu import cache_bytes
from ..errors import UsageError
from ..fast.runtime import machine, thread_env, usable_cores
from .plots import FAST

KB, MB = 1024, 1024 * 1024
PLANS = {
    "tiny": dict(payloads=[4 * KB, 64 * KB], comm_devices=[2, 3], lenet_devices=[2], comm_repeats=2, comm_rounds=2,
                 gemm=1024, images=256, batch=64, repeats=2, devices=[1, 2], data="synthetic", peers=False,
                 few=True, overlap_steps=2),
    "quick": dict(payloads=[4 * KB, 64 * KB, 1 * MB, 4 * MB, 16 * MB], comm_devices=[2, 4, 8],
                  lenet_devices=[2, 4], comm_repeats=3, comm_rounds=21, images=4096, batch=256, repeats=3,
                  devices=[1, 2, 4], data="fashion", peers=True, overlap_steps=6, pairs=3),
    "full": dict(payloads=[4 * KB * 4 ** i for i in range(8)], comm_devices=[2, 3, 4, 6, 8],
                 lenet_devices=[2, 4, 8], comm_repeats=5, comm_rounds=7, images=256 * 40, batch=256, repeats=5,
                 devices=[1, 2, 4], data="fashion", peers=True, overlap_steps=10, pairs=5),
}
RUNTIME_KEYS = set(thread_env(1, flags={"avx512f"})) | {"OMP_NUM_THREADS"}


def train_specs(plan, full):
    """(impl, options, env, devices) of every training measurement of the plan."""
    ks, two = plan["devices"], [k for k in plan["devices"] if k == 2] or plan["devices"][-1:]
    specs = [("manual_dp", FAST, "tuned", k) for k in ks]
    specs += [("lesson", {}, "default", k) for k in (two if plan.get("few") else ks)]
    if plan.get("few"):
        return specs
    specs += [("manual_dp", {}, "tuned", k) for k in (ks if full else two)]
    specs += [("manual_dp", dict(FAST, conv_pad=1), "tuned", k) for k in two]   # the autotune's gain
    specs += [("manual_dp", {"deterministic": True}, "tuned", k) for k in two]  # --deterministic's cost
    for name in ("ring", "tree", "scatter_gather", "kvstore") + (("lesson",) if full else ()):
        specs += [("manual_dp", dict(FAST, allreduce=name), "tuned", k) for k in (ks if full else two)]
    if full:  # each allreduce unfused, and each half of the fast step alone
        specs += [("manual_dp", {"allreduce": name, "graph": True}, "tuned", k) for k in two
                  for name in ("reduce_bcast", "ring", "tree", "scatter_gather", "kvstore", "prepared")]
        specs += [("manual_dp", {"allreduce": FAST["allreduce"], "fused": True}, "tuned", k) for k in two]
    if plan["peers"]:
        specs += [("gluon", {"hybrid": h}, "tuned", k) for h in (False, True) for k in (ks if full else two)]
        if full:
            specs += [("lesson", {}, "tuned", k) for k in ks]
        if importlib.util.find_spec("torch"):
            specs += [("torch", {}, "tuned", 1)] + [("torch-ddp", {}, "tuned", k) for k in ks if k > 1]
    return specs


def worker_env(env, devices, model=None):
    """The environment of a measurement: MXNet's defaults, or runtime's choice for `devices` (and
    `model`, if it is not LeNet)."""
    base = {k: v for k, v in os.environ.items() if k not in RUNTIME_KEYS | {"MANUAL_DP_SETTINGS"}}
    return dict(base, MANUAL_DP_RUNTIME="off") if env == "default" else dict(base, **thread_env(devices, model=model))


def run_worker(spec, env, timeout):
    """Records printed by one manual_dp.bench.worker process, or one record saying why there are none."""
    cmd = [sys.executable, "-m", "manual_dp.bench.worker", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [dict(spec, error=f"timed out after {timeout:.0f} s")]
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [dict(spec, error=f"exit {done.returncode}: {tail}")]
    return json.loads(lines[-1])


SPIN = ("import time\nstart, cpu = time.perf_counter(), time.process_time()\n"
        "while time.perf_counter() - start < {s}: pass\nprint(time.process_time() - cpu)")


def cores_available(seconds=1.0):
    """CPU-seconds per second that one busy process per core actually gets right now: what the
    machine leaves to a benchmark (Linux shares CPUs equally between sessions, so one other job
    can take a whole core whatever its niceness)."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN.format(s=seconds)], stdout=subprocess.PIPE, text=True)
             for _ in range(usable_cores())]
    return sum(float(p.communicate(timeout=60 + seconds)[0]) for p in procs) / seconds


def wait_for_cores(wanted, timeout):
    """Cores free now; with `wanted`, first wait (up to `timeout` s) until that many are."""
    deadline = time.time() + timeout
    free = cores_available(0.5)
    while wanted and free < wanted and time.time() < deadline:
        time.sleep(2)
        free = cores_available(0.5)
    return free


def commit():
    """The git commit of this checkout, with "+changes" if the tree differs from it; "unknown"
    outside a git checkout. The notebooks' own outputs do not count as changes: re-executing them
    in place, one after another, rewrites each before the next one prints this."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                                ":(exclude,top)notebooks/*.ipynb"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+changes" if dirty else "")) if head else "unknown"


def measure(plan, args):
    """Every record of the plan: machine, all-reduce, training."""
    where = dict(machine(), commit=commit())
    records = [{"bench": "meta", "impl": "machine", "devices": usable_cores(), "load_before": os.getloadavg(),
                "cores_free_before": cores_available(), "plan": args.plan, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                "cache_bytes": cache_bytes(), **where}]
    print(f"{where['cpu']} ({where['vector']}), {where['cores']} cores, commit {where['commit']}; "
          f"{records[0]['cores_free_before']:.2f} cores free for this run, "
          f"load average {records[0]['load_before'][0]:.1f}", flush=True)
    if args.only in (None, "allreduce"):
        spec = {"bench": "allreduce", "impl": "all", "devices": plan["comm_devices"],
                "payloads": plan["payloads"], "lenet_devices": plan["lenet_devices"], "repeats": plan["comm_repeats"],
                "rounds": plan["comm_rounds"]}
        print(f"allreduce: payloads {plan['payloads'][0]}..{plan['payloads'][-1]} B, "
              f"{plan['comm_devices']} contexts", flush=True)
        records += run_worker(spec, worker_env("tuned", 2), args.timeout)
    if args.only in (None, "train"):
        tuned = run_worker({"bench": "autotune", "impl": "conv_pad"}, worker_env("tuned", 2), args.timeout)
        records += tuned
        if "error" not in tuned[0]:
            print(f"  autotune: the cached graph pads convolution channels to multiples of {tuned[0]['conv_pad']} "
                  f"on this machine (CPU ms per image: {tuned[0].get('cpu_ms_per_image')})", flush=True)
        # the peak: one product on a team of every core's threads, and one on a single thread times
        # the cores (a team can stall when a core is briefly busy elsewhere); the best counts
        for n_cores in sorted({1, usable_cores()}):
            spec = {"bench": "peak", "impl": "gemm", "n": plan.get("gemm", 2048), "repeats": 3, "cores": n_cores}
            records += run_worker(spec, worker_env("tuned", n_cores), args.timeout)
        peaks = {r["impl"]: r["gflops"] for r in records if r["bench"] == "peak" and "error" not in r}
        print(f"  peak: a float32 GEMM at {max(peaks.values() or [0]):.0f} GFLOP/s, the best of "
              + ", ".join(f"{k} {g:.0f}" for k, g in peaks.items()) + " (MXNet's OpenBLAS and oneDNN)", flush=True)
        for env in ("default", "tuned"):  # do cpu(0) and cpu(1) compute at the same time?
            spec = {"bench": "overlap", "env": env, "options": FAST, "steps": plan["overlap_steps"]}
            got = run_worker(spec, worker_env(env, 2), args.timeout)
            records += got
            if "error" not in got[0]:
                print(f"  overlap of cpu(0) and cpu(1), {env} env: {got[0]['overlap']:.0%} of busy time", flush=True)
        for k in plan["lenet_devices"]:      # gradient buckets overlapping backward, side by side
            spec = {"bench": "buckets", "devices": k, "steps": plan["overlap_steps"], "batch": plan["batch"],
                    "rounds": plan["repeats"]}
            got = run_worker(spec, worker_env("tuned", k), args.timeout)
            records += got
            for r in got:
                print(f"  {k} contexts, {r.get('impl', 'buckets'):28} " + (r["error"] if "error" in r else
                      f"{r['step_ms']:7.1f} ms a step, {r['overlap']:.0%} of all-reduce time under compute "
                      f"({r['operator_overlap']:.0%} of its operators' time), "
                      f"buckets ready over {r['ready_spread_ms']:.1f} ms"),
                      flush=True)
        for impl, options, env, k in train_specs(plan, args.plan == "full"):
            records += train_point(plan, args, impl, options, env, k)
        for i, group in enumerate(pair_specs(plan)):
            for impl, options, k in group:
                records += train_point(plan, args, impl, options, "tuned", k, bench="pair", pair=i)
    records[0]["load_after"], records[0]["cores_free_after"] = os.getloadavg(), cores_available()
    return records


def pair_specs(plan):
    """Groups of (impl, options, devices) to measure after the main list, plan['pairs'] of them:
    PyTorch in one process, the fast step on 2 contexts and PyTorch DDP on 2 processes, back to back. The
    PyTorch targets' ratios are medians over these adjacent pairs, so the machine drifting between
    two measurements minutes apart (up to 5% on a quiet machine, up to 40% on a shared virtual
    one) does not decide them."""
    if not (plan.get("pairs") and plan["peers"] and importlib.util.find_spec("torch")):
        return []
    return [[("torch", {}, 1), ("manual_dp", FAST, 2), ("torch-ddp", {}, 2)]] * plan["pairs"]


def train_point(plan, args, impl, options, env, k, bench="train", **extra):
    """Records of one training measurement in a fresh worker process, printed as they come."""
    spec = {"bench": "train", "impl": impl, "options": options, "env": env, "devices": k,
            "batch": plan["batch"], "images": plan["images"], "repeats": plan["repeats"],
            "lr": 0.02, "seed": 0, "data": plan["data"], "data_dir": args.data_dir,
            "threads": usable_cores(), "timeout": args.timeout}
    free = wait_for_cores(args.wait_for_cores, args.timeout)
    got = run_worker(spec, worker_env(env, 1 if impl.startswith("torch") else k), args.timeout)
    prefix = f"  pair {extra['pair'] + 1}:" if bench == "pair" else ""
    print(prefix + format_train(got[0]) + f"  ({free:.1f} cores free)", flush=True)
    return [dict(r, bench=bench, cores_free=free, **extra) for r in got]


def format_train(r):
    from .plots import label
    if "error" in r:
        return f"  {label(r):40} {r['devices']} dev: {r['error']}"
    return (f"  {label(r):40} {r['devices']} dev: {r['images_per_sec']:7.0f} img/s  "
            f"{r['sec_per_epoch']:6.1f} s/epoch  loss {r['final_loss']:.4f}")


def parse(argv):
    """The checked arguments; UsageError (one line) for values no run can use."""
    from .compress import check_settings
    args = build_parser().parse_args(argv)
    check_settings(args)
    check_values(args)
    return args


def check_values(args):
    """UsageError for a value or combination the bench would meet only after measuring for a while
    (a time of 0, more cores than there are, flags of a mode not chosen, an output path that is a
    file, a data directory that is not there)."""
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if not 0 <= args.wait_for_cores <= usable_cores():
        raise UsageError(f"--wait-for-cores {args.wait_for_cores}: this machine has {usable_cores()} cores")
    memory_flags = [f for f in ("width", "batch_size", "cpus") if getattr(args, f) is not None]
    if memory_flags and not args.memory:
        raise UsageError(f"--{memory_flags[0].replace('_', '-')} applies only with --memory")
    args.width, args.batch_size, args.cpus = args.width or RunConfig.width, args.batch_size or RunConfig.batch_size, args.cpus or 2
    modes = [f"--{m.replace('_', '-')}" for m in ("memory", "local_sgd", "compress", "model") if getattr(args, m)]
    if len(modes) > 1:
        raise UsageError(f"{modes[0]} and {modes[1]} are separate runs: choose one")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory")
    if args.data_dir and not Path(args.data_dir).is_dir():
        raise UsageError(f"--data-dir {args.data_dir}: no such directory")


def main(argv=None):
    """Ctrl-C, SIGTERM or SIGHUP end the bench with one line and exit 130 or 128 + signal."""
    with ends_on_signals("manual_dp.bench"):
        bench(parsed_or_exit(parse, argv, "manual_dp.bench"))


def bench(args):
    """The run `args` ask for (see the module docstring)."""
    from .report import report, write
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        sys.exit(fail(f"--out {out}: cannot create it ({e.strerror})", 2, "manual_dp.bench"))
    if args.model:
        print(report_model(out))
        return
    if args.memory:
        from .memory import run
        run(out, args.width, args.batch_size, args.cpus, commit())
        return
    if args.local_sgd:
        from .local_sgd import run as run_local_sgd
        run_local_sgd(args.plan, out, args.data_dir, args.timeout, commit())
        return
    if args.compress:
        from .compress import bench_compress
        m = dict(machine(), commit=commit())
        bench_compress(args.plan, args, f"{m['cpu']} ({m['vector']}), {m['cores']} cores, commit {m['commit']}")
        return
    records = measure(PLANS[args.plan], args)
    records += report(records)
    where = {k: records[0][k] for k in ("cpu", "vector", "cores", "commit")}
    records = [dict(r, **where) for r in records]      # every record names its machine and commit
    write(records, out)
    print(report_model(out, records))


def report_model(out, records=None):
    from .report import model_section
    return model_section(out, records)


def build_parser():
    p = OneLineParser(prog="python -m manual_dp.bench", description=__doc__.split("\n\n")[0])
    size = p.add_mutually_exclusive_group()
    for name in ("quick", "full", "tiny"):
        size.add_argument(f"--{name}", dest="plan", action="store_const", const=name)
    p.set_defaults(plan="quick")
    p.add_argument("--out", default="bench-results", help="directory for results.json and the plots")
    p.add_argument("--only", choices=["allreduce", "train"], help="run one half only")
    p.add_argument("--model", action="store_true",
                   help="print and plot the cost model, fitted to OUT/results.json when it has all-reduce figures")
    p.add_argument("--data-dir", help="Fashion-MNIST directory (as for training)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed to one measurement (with --local-sgd, --compress: to one epoch)")
    p.add_argument("--wait-for-cores", type=float, default=0.0,
                   help="on a shared machine: before each training measurement wait (up to --timeout) "
                        "until this many cores are free, e.g. 1.8 of 2")
    p.add_argument("--memory", action="store_true",
                   help="every mode's measured peak memory per context (OUT/memory.json), nothing else")
    p.add_argument("--width", type=positive, help=f"with --memory: LeNet's width (default {RunConfig.width})")
    p.add_argument("--batch-size", type=positive, help=f"with --memory: the global batch (default {RunConfig.batch_size})")
    p.add_argument("--cpus", type=positive, help="with --memory: CPU contexts (default 2)")
    p.add_argument("--local-sgd", action="store_true",
                   help="instead: local SGD at H = 1, 4, 16 side by side, test accuracy and communication "
                        "rounds per epoch (OUT/local_sgd.json, local_sgd.png; --timeout is per epoch)")
    p.add_argument("--compress", action="store_true",
                   help="instead: train with every --compress setting side by side (manual_dp/bench/compress.py)")
    p.add_argument("--settings", nargs="+", metavar="SPEC",
                   help="with --compress: only these settings, e.g. none fp16 2bit mxnet-2bit powersgd:2")
    return p


if __name__ == "__main__":
    main()
