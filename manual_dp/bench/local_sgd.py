"""Local SGD side by side (`python -m manual_dp.bench --local-sgd [--tiny|--quick|--full]`).

The same run (data, seed, contexts, inner optimiser and lr) at H = 1, 4, 16, each through the
command line (`python -m manual_dp.train --mode local --sync-every H --log-json ...`) in a fresh
process; from its log, the test accuracy and the communication rounds (all-reduces of the
parameters) of every epoch. H = 1 with outer sgd at lr 1 is sync's step (tests/test_local_sgd.py),
so its row is the synchronous baseline. Writes OUT/local_sgd.json and OUT/local_sgd.png.
"""
import json
import subprocess
import sys
import time
from pathlib import Path

from ..fast.runtime import machine

# runs: (H, outer optimiser, outer lr); sizes: --train-size/--test-size (None: the whole set)
PLANS = {
    "tiny": dict(runs=[(1, "sgd", 1.0), (4, "sgd", 1.0)], epochs=1, train_size=256, test_size=128,
                 batch=32, cpus=2),
    "quick": dict(runs=[(1, "sgd", 1.0), (4, "sgd", 1.0), (16, "sgd", 1.0)], epochs=3,
                  train_size=12000, test_size=2000, batch=256, cpus=2),
    "full": dict(runs=[(1, "sgd", 1.0), (4, "sgd", 1.0), (16, "sgd", 1.0), (16, "nesterov", 0.7)],
                 epochs=10, train_size=None, test_size=None, batch=256, cpus=2),
}


def train_argv(plan, H, outer, outer_lr, log, data_dir):
    """The command line of one run of the plan."""
    argv = [sys.executable, "-m", "manual_dp.train", "--no-progress", "--cpus", plan["cpus"],
            "--epochs", plan["epochs"], "--batch-size", plan["batch"], "--mode", "local",
            "--sync-every", H, "--outer-optimizer", outer, "--outer-lr", outer_lr, "--log-json", log]
    for flag, value in (("--train-size", plan["train_size"]), ("--test-size", plan["test_size"]),
                        ("--data-dir", data_dir)):
        argv += [flag, value] if value is not None else []
    return [str(a) for a in argv]


def run_one(plan, H, outer, outer_lr, out, data_dir, timeout):
    """The record of one run: its epochs from --log-json, or the one line it failed with (`timeout`
    seconds allowed per epoch)."""
    log = Path(out) / f"local_sgd_H{H}_{outer}{outer_lr:g}.jsonl"
    spec = {"bench": "local_sgd", "impl": f"H={H} outer {outer} lr {outer_lr:g}", "devices": plan["cpus"],
            "sync_every": H, "outer_optimizer": outer, "outer_lr": outer_lr}
    timeout *= plan["epochs"]
    try:
        done = subprocess.run(train_argv(plan, H, outer, outer_lr, log, data_dir), capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(spec, error=f"timed out after {timeout:.0f} s")
    if done.returncode:
        return dict(spec, error=(done.stderr.strip().splitlines() or ["no output"])[-1])
    epochs = [json.loads(line) for line in log.read_text().splitlines()]
    return dict(spec, epochs=[{k: r[k] for k in ("epoch", "train_loss", "test_acc", "comm_rounds", "epoch_sec")}
                              for r in epochs], final_test_acc=epochs[-1]["test_acc"])


def format_row(r):
    if "error" in r:
        return f"  {r['impl']:26} {r['error']}"
    accs = " ".join(f"{e['test_acc']:.3f}" for e in r["epochs"])
    rounds = sum(e["comm_rounds"] for e in r["epochs"]) / len(r["epochs"])
    secs = sum(e["epoch_sec"] for e in r["epochs"]) / len(r["epochs"])
    return f"  {r['impl']:26} {rounds:8.1f}   {secs:7.1f}   {accs}"


def plot(records, out):
    """local_sgd.png: test accuracy against epochs and against communication rounds."""
    from .plots import _plt
    plt = _plt()
    fig, (by_epoch, by_round) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in (r for r in records if "epochs" in r):
        epochs, accs = [e["epoch"] for e in r["epochs"]], [e["test_acc"] for e in r["epochs"]]
        rounds = [sum(e["comm_rounds"] for e in r["epochs"][:i + 1]) for i in range(len(epochs))]
        by_epoch.plot(epochs, accs, marker="o", label=r["impl"])
        by_round.plot(rounds, accs, marker="o", label=r["impl"])
    by_epoch.set(xlabel="epoch", ylabel="test accuracy", title="accuracy per epoch")
    by_round.set(xscale="log", xlabel="communication rounds (cumulative)", ylabel="test accuracy",
                 title="accuracy per communication round")
    by_epoch.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(out) / "local_sgd.png", dpi=110)
    plt.close(fig)


def run(plan_name, out, data_dir=None, timeout=300, commit="unknown"):
    """Every run of the plan, side by side; the records, also written to OUT/local_sgd.json."""
    plan, where = PLANS[plan_name], dict(machine(), commit=commit)
    sizes = f"{plan['train_size'] or 'all'} train / {plan['test_size'] or 'all'} test images"
    print(f"local SGD on {where['cpu']}, {where['cores']} cores, commit {commit}: {plan['cpus']} contexts, "
          f"{sizes}, batch {plan['batch']}, {plan['epochs']} epoch(s), the default inner optimiser", flush=True)
    print(f"  {'run':26} {'rounds/epoch':>8}   {'s/epoch':>7}   test acc by epoch", flush=True)
    records = [{"bench": "meta", "impl": "local_sgd", "devices": plan["cpus"], "plan": plan_name,
                "time": time.strftime("%Y-%m-%d %H:%M:%S"), **where}]
    for H, outer, outer_lr in plan["runs"]:
        records.append(dict(run_one(plan, H, outer, outer_lr, out, data_dir, timeout), **where))
        print(format_row(records[-1]), flush=True)
    (Path(out) / "local_sgd.json").write_text(json.dumps(records, indent=1))
    plot(records, out)
    print(f"wrote {Path(out) / 'local_sgd.json'}, {Path(out) / 'local_sgd.png'}")
    return records
