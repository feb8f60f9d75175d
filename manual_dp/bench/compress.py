"""`python -m manual_dp.bench --compress`: every --compress setting trained side by side, one
fresh `python -m manual_dp.train` process each, on the same data, seed and contexts; a table of
bytes sent per step, test accuracy against the uncompressed run, and images/s. The row mxnet-2bit
is the same run through MXNet's own 2bit in kvstore('device') (manual_dp.bench.kvstore_compress):
the scheme's accuracy, apart from this project's code of it.

    --tiny    1 epoch of 512 images (seconds; for the tests)
    --quick   2 epochs of 12,000 images (a few minutes)
    --full    the default run: 10 epochs of all 60,000 (the figures the targets speak of)

Targets (issue 11): 2bit and 1bit send at most 1/16 and 1/32 of float32 plus their headers; fp16,
2bit and PowerSGD of rank 2 or more end within 1 point of the uncompressed test accuracy.
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ..checks import parse_compress
from ..config import RunConfig
from ..errors import UsageError

REFERENCE = "mxnet-2bit"              # the same run through MXNet's own kvstore 2bit (kvstore_compress)
SETTINGS = ["none", "fp16", "2bit", REFERENCE, "2bit:0.05", "1bit", "topk:1291", "powersgd:1", "powersgd:2",
            "powersgd:4"]                                   # topk:1291: 1% of LeNet's 129,068
PLANS = {"tiny": ["--epochs", "1", "--train-size", "512", "--test-size", "256", "--batch-size", "64"],
         "quick": ["--epochs", "2", "--train-size", "12000", "--test-size", "2000"],
         "full": []}
HEADER_BYTES = 4 * 8 + 4              # 1bit's scale per LeNet parameter; 2bit's last 4-byte block
ACCURACY_TARGET = ("fp16", "2bit", "powersgd:2", "powersgd:4")


def check_settings(args):
    """UsageError for a --settings list the bench cannot run (before any run starts)."""
    if args.settings and not args.compress:
        raise UsageError("--settings applies only with --compress")
    for spec in args.settings or []:
        if spec != REFERENCE:
            parse_compress(spec)


def run_one(spec, plan, args, out):
    """The last epoch's record of one training run with --compress `spec`, or of MXNet's own 2bit
    for REFERENCE (or an error record)."""
    log = Path(out) / f"compress-{spec.replace(':', '_')}.jsonl"
    cmd = [sys.executable, "-m", "manual_dp.bench.kvstore_compress"] if spec == REFERENCE else \
        [sys.executable, "-m", "manual_dp.train", "--no-progress", "--compress", spec]
    cmd += ["--cpus", str(args.cpus), "--log-json", str(log), *PLANS[plan]]
    cmd += ["--data-dir", args.data_dir] if args.data_dir else []
    epochs = int(PLANS[plan][PLANS[plan].index("--epochs") + 1]) if "--epochs" in PLANS[plan] else RunConfig.epochs
    timeout = args.timeout * epochs                                   # --timeout is per epoch, as --local-sgd's
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"compress": spec, "error": f"timed out after {timeout:.0f} s"}
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"compress": spec, "error": f"exit {done.returncode}: {tail}"}
    history = [json.loads(line) for line in open(log)]
    last = history[-1]
    return {"compress": spec, "test_acc": last["test_acc"],
            "images_per_sec": sum(r["images_per_sec"] for r in history) / len(history),
            "bytes_per_step": last.get("compress_bytes_per_step", last.get("fp32_bytes_per_step")),
            "fp32_bytes_per_step": last.get("fp32_bytes_per_step")}


def targets(rows):
    """Each row with its ratios to the uncompressed run and whether it meets its target."""
    base = next((r for r in rows if r["compress"] == "none" and "error" not in r), None)
    fp32 = next((r["fp32_bytes_per_step"] for r in rows if r.get("fp32_bytes_per_step")), None)
    ours_2bit = next((r for r in rows if r["compress"] == "2bit" and "error" not in r), None)
    out = []
    for r in rows:
        r = dict(r)
        if r["compress"] == REFERENCE and "error" not in r and ours_2bit:   # MXNet's own: the same payload
            r["bytes_per_step"] = ours_2bit["bytes_per_step"]
            r["acc_points_vs_2bit"] = 100 * (r["test_acc"] - ours_2bit["test_acc"])
        if "error" not in r and base:
            r["bytes_per_step"] = r["bytes_per_step"] or fp32
            r["bytes_fraction"] = r["bytes_per_step"] / fp32 if fp32 else 1.0
            r["acc_points_vs_none"] = 100 * (r["test_acc"] - base["test_acc"])
            r["speed_vs_none"] = r["images_per_sec"] / base["images_per_sec"]
            limit = {"2bit": 16, "1bit": 32}.get(r["compress"].partition(":")[0])
            if limit and fp32:
                r["bytes_target_met"] = r["bytes_per_step"] <= fp32 / limit + HEADER_BYTES
            if r["compress"].partition(":")[0] in ("fp16", "2bit") or r["compress"] in ACCURACY_TARGET:
                r["accuracy_target_met"] = r["acc_points_vs_none"] >= -1.0
        out.append(r)
    return out


def table(rows):
    """The rows as a text table, one line each."""
    lines = [f"{'compress':12} {'bytes/step':>11} {'of fp32':>8} {'test acc':>9} {'vs none':>8} "
             f"{'img/s':>7} {'vs none':>8}  targets"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['compress']:12} {r['error']}")
            continue
        met = [f"{k.split('_')[0]} {'met' if r[k] else 'MISSED'}"
               for k in ("bytes_target_met", "accuracy_target_met") if k in r]
        met += [f"manual_dp's 2bit {-r['acc_points_vs_2bit']:+.2f} points from it"] if "acc_points_vs_2bit" in r else []
        lines.append(f"{r['compress']:12} {r['bytes_per_step']:>11,} {r.get('bytes_fraction', 1):>8.4f} "
                     f"{r['test_acc']:>9.4f} {r.get('acc_points_vs_none', 0):>+8.2f} "
                     f"{r['images_per_sec']:>7.0f} {r.get('speed_vs_none', 1):>8.2f}  {', '.join(met)}")
    return "\n".join(lines)


def bench_compress(plan, args, where):
    """Every setting trained in turn; the table printed, the records in OUT/compress.json."""
    out, settings = Path(args.out), getattr(args, "settings", None) or SETTINGS
    print(f"compression: {len(settings)} runs of python -m manual_dp.train {' '.join(PLANS[plan]) or '(defaults)'} "
          f"--cpus {args.cpus}; {where}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=out) as logs:
        for spec in settings:
            rows.append(run_one(spec, plan, args, logs))
            print(f"  {spec}: " + (rows[-1].get("error") or f"test acc {rows[-1]['test_acc']:.4f}, "
                                   f"{rows[-1]['images_per_sec']:.0f} img/s"), flush=True)
    rows = targets(rows)
    print(table(rows))
    (out / "compress.json").write_text(json.dumps([dict(r, plan=plan, machine=where) for r in rows], indent=1))
    return rows
