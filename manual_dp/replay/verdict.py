"""`diverge A B --replay`: update t run again in A's layout and in B's, from one state, and the
first layer whose output (forward order) or whose output's gradient (backward order) differs.

No MXNet here: each run is replayed by manual_dp.replay.worker in a process of its own, started
with that run's thread settings, A first (it computes the state after update t-1 and the batch),
then B from A's state. Each replay's digest line is checked against its run's file: "gives the
run's digests" means the replay computed the bits the run did, so what it finds is what happened
in the run; where it does not (a user's own thread variables; --mode sync's cached graph, captured
as --no-graph), the two layouts are still compared from one state, and the lines say so.

The order of the verdict: every layer's output from the first layer on, then the gradient of
every layer's output from the last layer back; if all are identical, the update's digests
(digests.compare: the parameter gradients, summed over the batch, then parameters and state).
Data parallelism computes every row's activations and output gradients whatever the split, so
two data-parallel layouts usually part only there, at the sum over the rows.
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..config import device_request
from ..digests import compare, config_of, read
from ..fast.runtime import thread_env, user_environment

MAX_CONTEXTS = 256    # contexts a replay rebuilds in one process at most (100,000 hung the worker building them)
SAME = ("model", "width", "layers", "d_model", "heads", "patch", "init_scale", "seed", "batch_size", "train_size",
        "data_dir", "optimizer")   # what two runs must share for one to be replayed from the other's state


class ReplayError(Exception):
    """Input --replay cannot work from, in one line."""


def check_pair(a, b):
    """ReplayError unless runs a and b (header dicts) can be rebuilt here and replayed from one state."""
    for label, run in (("A", a), ("B", b)):
        if run.get("processes", 1) > 1 or run.get("backend", "local") != "local":
            raise ReplayError(f"{label} ran as {run.get('processes')} processes ({run.get('backend')}): --replay "
                              f"rebuilds runs of one process only")
        kind, n = device_request(config_of(run))
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CONTEXTS:
            raise ReplayError(f"{label}'s header names {str(n)[:20]} {kind} contexts: --replay rebuilds 1 to "
                              f"{MAX_CONTEXTS} in one process")
        if run.get("grad_accum", 1) > 1:
            raise ReplayError(f"{label} used --grad-accum {run['grad_accum']}: --replay takes one batch an update")
    differ = [f"{k} {a.get(k)!r} against {b.get(k)!r}" for k in SAME if a.get(k) != b.get(k)]
    if differ:
        raise ReplayError("the runs differ in " + ", ".join(differ) + ": --replay compares two layouts of one "
                          "model, data and optimiser")


def parting_update(a, b):
    """The first update whose digests differ in the two files' records; None if none does."""
    by_update = {r["update"]: r for r in b}
    for ra in a:
        rb = by_update.get(ra["update"])
        if rb and [x[2] for x in ra["tensors"]] != [x[2] for x in rb["tensors"]]:
            return ra["update"]
    return None


def run_env(run):
    """This process's environment with the thread settings `python -m manual_dp.train` would give
    `run` (variables the user set are kept)."""
    env = user_environment()
    kind, n = device_request(config_of(run))
    chosen = thread_env(n if kind == "cpu" else 0, per_op=1 if run.get("deterministic") else None)
    env.update({k: v for k, v in chosen.items() if k not in env})
    return env


def replay_in_child(role, path, run, t, directory, say):
    """worker ROLE's results (meta, arrays); ReplayError with its line if it refused."""
    done = subprocess.run([sys.executable, "-m", "manual_dp.replay.worker", role, str(path), str(t), str(directory)],
                          env=run_env(run), capture_output=True, text=True)
    for line in done.stdout.splitlines():
        say(line)
    if done.returncode:
        err = done.stderr.strip().splitlines()
        raise ReplayError(err[-1] if done.returncode == 2 and err else
                          f"replaying {role} failed (exit {done.returncode}): {err[-1] if err else 'no message'}")
    with np.load(Path(directory) / f"{role}.npz") as z:
        meta = json.loads(z["meta"].tobytes().decode())
        return meta, {k: z[k] for k in z.files if k != "meta"}


def replay_runs(path_a, path_b, update=None, say=print):
    """(status, message) of --replay on two digest files; ReplayError or DigestError on bad input."""
    runs, lines = zip(*[read(p) for p in (path_a, path_b)])
    for label, path, run, found in zip("AB", (path_a, path_b), runs, lines):
        if run is None:
            raise ReplayError(f"{label} ({path}) has no header saying how its run was made (written before "
                              f"--replay existed): train it again with --digests")
        if not found:
            raise ReplayError(f"{label} ({path}) holds a header and no update: its run made no update to replay")
    check_pair(*runs)
    parted = parting_update(*lines)
    t = update or parted or 1
    files = [next((r for r in found if r["update"] == t), None) for found in lines]
    if files[1] is None:
        raise ReplayError(f"update {t}: B's file holds no such update")
    with tempfile.TemporaryDirectory(prefix="manual_dp-replay-") as directory:
        results = []
        for label, path, run, line in zip("AB", (path_a, path_b), runs, files):
            meta, arrays = replay_in_child(label, path, run, t, directory, say)
            same = line is None or compare([meta["line"]], [line])[0] == 0
            why = (f"its state before update {t} was not A's: the runs parted at update {parted}"
                   if label == "B" and parted and parted < t else "other threads or kernels here than in the run")
            say(f"{label} ({layout(run)}): the replayed update " + (
                f"cannot be checked (its file holds no update {t})" if line is None else
                "gives the run's digests" if same else f"does not give the run's digests ({why})"))
            if meta["graph_off_same"] is not None:
                say(f"{label}: --mode sync's cached graph runs the layers as one symbol, not layer by layer: "
                    f"captured with --no-graph, which gives {'the same' if meta['graph_off_same'] else 'other'} "
                    f"digests")
            results.append((meta, arrays))
    names = results[0][0]["names"]
    for i, name in enumerate(names):
        why = results[0][0]["notes"][i] or results[1][0]["notes"][i]
        if why:
            say(f"{name}: not compared ({why})")
    return first_difference(t, names, *results)


def layout(run):
    """A run's layout in a few words."""
    devices = f"{run['gpus']} gpus" if run.get("gpus") else f"{run.get('cpus') or 'default'} cpus"
    extras = [f"--{k.replace('_', '-')} {run[k]}" for k in ("tensor_parallel", "stages", "micro_batches", "schedule",
                                                            "context_parallel", "zero_stage") if run.get(k)]
    flags = ["--deterministic"] if run.get("deterministic") else []
    flags += ["--no-graph"] if run.get("mode") == "sync" and run.get("graph") is False else []
    return ", ".join([f"--mode {run['mode']}", devices] + extras + flags)


def differ(a, b):
    """(max abs difference, relative to A's largest magnitude) if a and b differ in any bit, else None."""
    if a.shape != b.shape:
        return float("inf"), float("inf")
    if a.tobytes() == b.tobytes():
        return None
    gap = float(abs(a.astype("float64") - b).max())
    return gap, gap / max(float(abs(a).max()), 1e-300)


def first_difference(t, names, A, B):
    """(status, message): the first layer output, then output gradient, then update tensor that differs."""
    (meta_a, arrays_a), (meta_b, arrays_b) = A, B
    seen = []
    for kind, order in (("out", range(len(names))), ("grad", reversed(range(len(names))))):
        for i in order:
            key = f"{kind}{i}"
            if key not in arrays_a or key not in arrays_b:
                continue
            gap = differ(arrays_a[key], arrays_b[key])
            what = f"{names[i]}'s output" if kind == "out" else f"the gradient of {names[i]}'s output"
            if gap:
                return 1, (f"the runs part at update {t} in the {'forward' if kind == 'out' else 'backward'}: "
                           f"{what} is the first that differs (max abs difference {gap[0]:.3g}, relative "
                           f"{gap[1]:.3g}); " + (f"identical before it: {', '.join(seen)}" if seen else
                                                  "the first compared"))
            seen.append(what)
    status, message = compare([meta_a["line"]], [meta_b["line"]])
    layers = (f"every layer output and output gradient compared is identical ({len(seen)})" if seen
              else "no layer could be compared")
    if status:
        name = message.split(" is the first tensor")[0].rsplit(" ", 1)[-1]
        owner = meta_a["param_layers"].get(name)
        return 1, (f"{layers}; the runs part at update {t} after the backward"
                   + (f", in layer {owner}'s parameters" if owner else "") + ": "
                   + message.split(": ", 1)[1].replace("; every tensor before it is identical",
                                                         " (every tensor before it in the digest order is identical)"))
    return 0, f"identical: update {t} replayed in both layouts: {layers}, and every digest of the update equal"
