"""Issue 25's sweep, run by hand (CI runs its findings, the rows of tests/test_faults_three.py and
tests/test_signals.py, not the sweep: about 12 minutes on 2 cores):

    python tests/sweep_faults.py WORKDIR DATA_DIR [KIND]

A bounded sweep over the issue's case kinds: flags (a user's model file), tools (train, launch,
plan, bench and its scripts, timeline, flight, diverge) on bad files and values, resume with
changed settings, bad environment variables, and SIGTERM, SIGINT and SIGHUP at several moments.
Every case runs in a session of its own under a timeout. A case is clean if it ends with a
documented status (0, 1, 2, 3, 4, 130, 128 + signal), with one line on stderr when it fails, no
traceback, no hang and no process of its session left. Prints a line per case, then the counts;
writes WORKDIR/results.json. KIND (tools, flags, resume, env, signals) runs one kind.

Before issue 25's item 4 (2026-11-26, 171 cases): 150 clean, 9 tracebacks, 1 hang, 2 with
processes left. At af09881 (AMD EPYC, 2 cores shared, load 2-5): 177 cases, 173 clean, 0
tracebacks, 0 hangs, 0 left; the other 4: the launcher restarting a command whose scheduler exits
1 (as designed: its restart lines), and 3 signals that landed while Python started or ended (a
fixed delay: timeline is 0.6 s long, bench.stages 3.4 s), before a handler was installed or after
it was removed, so the signal's default action ended the process, silently.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable
W = Path(sys.argv[1]).resolve()          # work directory
DATA = str(Path(sys.argv[2]).resolve())
ONLY = sys.argv[3] if len(sys.argv) > 3 else None
TERM, INT, HUP = signal.SIGTERM, signal.SIGINT, signal.SIGHUP
TINY = ["--train-size", "64", "--test-size", "32", "--batch-size", "16", "--epochs", "1", "--no-progress",
        "--data-dir", DATA]
CLEAN_CODES = {0, 1, 2, 3, 4, 130, 129, 143}


def session_alive(sid):
    left = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{d}/stat").read().rsplit(") ", 1)[1].split()
            if int(stat[3]) == sid and stat[0] != "Z":
                left.append(int(d))
        except (OSError, IndexError, ValueError):
            pass
    return left


def run(case):
    kind, name, argv, env, sig, timeout = case
    e = dict(os.environ, **{k: v for k, v in env.items() if v is not None})
    for k, v in env.items():
        if v is None:
            e.pop(k, None)
    p = subprocess.Popen([PY, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e,
                         cwd=W, start_new_session=True)
    hang = False
    try:
        if sig:
            when, s = sig
            if isinstance(when, str):           # wait for a text in a file, e.g. a checkpoint
                deadline = time.monotonic() + timeout
                while not (W / when).exists() and p.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
            else:
                time.sleep(when)
            if p.poll() is None:
                p.send_signal(s)
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hang = True
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    time.sleep(0.3)
    left = session_alive(p.pid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    lines = [l for l in err.strip().splitlines() if l and not l.startswith("[") and "Warning" not in l
             and not l.startswith("  ")]
    code = p.returncode
    tb = "Traceback" in err
    one_line = code == 0 or len(lines) == 1
    clean = not hang and not tb and not left and code in CLEAN_CODES and one_line
    return dict(kind=kind, name=name, code=code, hang=hang, traceback=tb, leftovers=len(left), clean=clean,
                last=(lines[-1] if lines else "")[:300], err_tail=err[-1500:] if not clean else "")


def setup(W, data, tiny):
    """A checkpoint (2 epochs, --cpus 2, sync), a digests file, a trace, garbage files."""
    if not (W / "base_ck" / "checkpoint.npz").exists():
        subprocess.run([PY, "-m", "manual_dp.train", *tiny, "--cpus", "2", "--epochs", "2", "--checkpoint-dir",
                        str(W / "base_ck"), "--digests", str(W / "d.jsonl"), "--log-json", str(W / "log.jsonl")],
                       check=True, cwd=W, capture_output=True)
    if not (W / "trace.json").exists():
        subprocess.run([PY, "-m", "manual_dp.train", *tiny, "--cpus", "2", "--epochs", "1", "--train-size", "160",
                        "--trace", str(W / "trace.json")], check=True, cwd=W, capture_output=True)
    (W / "empty").write_text("")
    (W / "garbage").write_bytes(bytes(range(256)) * 4)
    (W / "null.json").write_text("null")
    (W / "list.json").write_text("[1, 2, 3]")
    (W / "events.json").write_text(json.dumps({"traceEvents": [{"ph": "X", "name": 3, "ts": "a"}]}))
    (W / "half.json").write_text((W / "trace.json").read_text()[:500])
    (W / "d_half.jsonl").write_text((W / "d.jsonl").read_text()[:300])
    (W / "d_header.jsonl").write_text((W / "d.jsonl").read_text().split("\n")[0] + "\n")
    (W / "d_bad_line.jsonl").write_text((W / "d.jsonl").read_text().split("\n")[0] + "\n{\"update\": \"x\"}\n")
    (W / "adir").mkdir(exist_ok=True)
    fl = W / "flights"
    for name, text in {"garbage": "xx", "empty_obj": "{}", "wrong": json.dumps({"rank": "a", "entries": 5}),
                       "entries_bad": json.dumps({"rank": 0, "size": 2, "entries": [{"seq": "x"}]})}.items():
        (fl / name).mkdir(parents=True, exist_ok=True)
        (fl / name / "flight-0.json").write_text(text)
    (fl / "none").mkdir(exist_ok=True)
    (W / "syntax.py").write_text("def build(:\n")
    (W / "raises.py").write_text("def build(**kw):\n    raise RuntimeError('boom')\n")
    (W / "notblock.py").write_text("def build(**kw):\n    return 42\n")
    (W / "importerr.py").write_text("import no_such_module_xyz\ndef build(**kw):\n    pass\n")
    (W / "hosts_bin").write_bytes(b"\xff\xfe\x00\x01")
    (W / "hosts_empty").write_text("# nothing\n")


def fresh_ck(W, name):
    """A copy of the base checkpoint for one resume case."""
    d = W / f"ck_{name}"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(W / "base_ck", d)
    return str(d)


def cases(W, data, tiny):
    setup(W, data, tiny)
    T = ["-m", "manual_dp.train", *tiny]
    out = []
    add = lambda kind, name, argv, env=None, sig=None, timeout=180: out.append((kind, name, argv, env or {}, sig, timeout))

    # tools with bad files
    for f in ("empty", "garbage", "null.json", "list.json", "events.json", "half.json", "adir", "missing.json"):
        add("tools", f"timeline {f}", ["-m", "manual_dp.timeline", f, "-o", "t.png"])
    add("tools", "timeline -o adir", ["-m", "manual_dp.timeline", "trace.json", "-o", "adir"])
    add("tools", "timeline -o missing/x.png", ["-m", "manual_dp.timeline", "trace.json", "-o", "missing/x.png"])
    add("tools", "timeline --link bogus", ["-m", "manual_dp.timeline", "trace.json", "--link", "bogus"])
    add("tools", "timeline ok", ["-m", "manual_dp.timeline", "trace.json", "-o", "t.png"])
    for d in ("garbage", "empty_obj", "wrong", "entries_bad", "none", "../missing", "../../garbage"):
        add("tools", f"flight {d}", ["-m", "manual_dp.flight", f"flights/{d}"])
    for a, b in (("empty", "empty"), ("garbage", "d.jsonl"), ("d.jsonl", "d_half.jsonl"), ("d.jsonl", "d_header.jsonl"),
                 ("d.jsonl", "d_bad_line.jsonl"), ("adir", "d.jsonl"), ("d.jsonl", "d.jsonl"), ("null.json", "list.json"),
                 ("trace.json", "d.jsonl")):
        add("tools", f"diverge {a} {b}", ["-m", "manual_dp.diverge", a, b])
    add("tools", "diverge --replay same", ["-m", "manual_dp.diverge", "d.jsonl", "d.jsonl", "--replay"])
    add("tools", "diverge --replay --update -1", ["-m", "manual_dp.diverge", "d.jsonl", "d.jsonl", "--replay", "--update", "-1"])
    add("tools", "diverge --replay --update 99", ["-m", "manual_dp.diverge", "d.jsonl", "d_half.jsonl", "--replay", "--update", "99"])
    P = ["-m", "manual_dp.plan"]
    for extra in (["--devices", "0", "--memory-per-device", "1G"], ["--devices", "2", "--memory-per-device", "0"],
                  ["--devices", "2", "--memory-per-device", "-1G"], ["--devices", "2", "--memory-per-device", "1e400"],
                  ["--devices", "2", "--memory-per-device", "1G", "--model", "bogus"],
                  ["--devices", "2", "--memory-per-device", "1G", "--model", "syntax.py:build"],
                  ["--devices", "2", "--memory-per-device", "1G", "--model", "raises.py:build"],
                  ["--devices", "2", "--memory-per-device", "1G", "--model", "notblock.py:build"],
                  ["--devices", "2", "--memory-per-device", "1G", "--model", "importerr.py:build"],
                  ["--devices", "2", "--memory-per-device", "1G", "--width", "1000000000"],
                  ["--devices", "2", "--memory-per-device", "1G", "--model", "transformer", "--heads", "0"],
                  ["--devices", "2", "--memory-per-device", "1G", "--model", "transformer", "--d-model", "7", "--heads", "2"],
                  ["--devices", "2", "--memory-per-device", "1G", "--verify", "--steps", "0"],
                  ["--devices", "2", "--memory-per-device", "1G", "--verify", "--top", "0"],
                  ["--devices", "3", "--memory-per-device", "10KiB"],
                  ["--devices", "2", "--memory-per-device", "1G", "--model", "resnet", "--verify", "--top", "1", "--steps", "2"]):
        add("tools", "plan " + " ".join(extra[2:]), P + extra)
    for extra in (["--only", "bogus"], ["--out", "garbage"], ["--quick", "--full"], ["--model", "bogus"],
                  ["--memory", "--width", "0"], ["--memory", "--batch-size", "0", "--out", "."],
                  ["--memory", "--cpus", "0"]):
        add("tools", "bench " + " ".join(extra), ["-m", "manual_dp.bench", *extra])
    for mod, extra in (("meshes", ["--bogus"]), ("meshes", ["--steps", "0"]), ("transformer", ["--steps", "-1"]),
                       ("kernels", ["--batch", "0"]), ("stages", ["--micro-batches", "0"]), ("tensor", ["--width", "0"]),
                       ("zero_memory", ["--width", "-1"]), ("kvstore_compress", ["--workers", "0"]),
                       ("modes", ["--only", "bogus"]), ("precision", ["--precisions", "fp8"])):
        add("tools", f"bench.{mod} " + " ".join(extra), ["-m", f"manual_dp.bench.{mod}", *extra])
    L = ["-m", "manual_dp.launch"]
    for extra in (["--hosts", "hosts_bin", "--", "true"], ["--hosts", "hosts_empty", "--", "true"],
                  ["--hosts", "adir", "--", "true"], ["--port", "0", "--", "true"], ["--start-timeout", "inf", "--", "true"],
                  ["--grace", "nan", "--", "true"], ["--workers", "1", "--", "false"],
                  ["--workers", "1", "--", PY, "-c", "import sys; sys.exit(2)"],
                  ["--workers", "1", "--max-restarts", "2", "--", PY, "-c", "import sys; sys.exit(1)"],
                  ["--workers", "2", "--max-restarts", "1", "--", PY, "-m", "manual_dp.train", "--backend", "dist_sync",
                   *tiny[:-2], "--data-dir", "missing", "--checkpoint-dir", "lck", "--resume"]):
        add("tools", "launch " + " ".join(extra)[:50], L + extra)

    # user models through train
    for f in ("syntax.py:build", "raises.py:build", "notblock.py:build", "importerr.py:build", "missing.py:build",
              "raises.py:nofunc", "garbage:build", "adir:build"):
        add("flags", f"train --model {f}", T + ["--model", f, "--cpus", "1"])

    # resume with changed settings
    for name, extra in (("same", []), ("width", ["--width", "2"]), ("mode zero", ["--mode", "zero"]),
                        ("mode async", ["--mode", "async"]), ("optimizer adam", ["--optimizer", "adam"]),
                        ("bf16", ["--precision", "bf16"]), ("fp16", ["--precision", "fp16"]), ("mlp", ["--model", "mlp"]),
                        ("cpus 1", ["--cpus", "1"]), ("cpus 3", ["--cpus", "3"]), ("batch 32", ["--batch-size", "32"]),
                        ("grad-accum 2", ["--grad-accum", "2"]), ("tensor", ["--mode", "tensor"]),
                        ("pipeline", ["--mode", "pipeline"]), ("deterministic", ["--deterministic"]),
                        ("seed", ["--seed", "1"]), ("lr", ["--lr", "0.1"]), ("epochs 1 < done 2", ["--epochs", "1"]),
                        ("compress 2bit", ["--compress", "2bit"]), ("clip-norm", ["--clip-norm", "1"]),
                        ("mesh dp=2", ["--mesh", "dp=2"]), ("local", ["--mode", "local"]),
                        ("train-size", ["--train-size", "96"]), ("warmup", ["--warmup-epochs", "1"]),
                        ("no-graph", ["--no-graph"]), ("allreduce ring", ["--allreduce", "ring"]),
                        ("digests", ["--digests", "dd.jsonl"]), ("check-replicas", ["--check-replicas", "1"])):
        argv = T + ["--cpus", "2", "--epochs", "3", "--checkpoint-dir", fresh_ck(W, name.replace(" ", "_")), "--resume", *extra]
        add("resume", name, argv)
    # a checkpoint from another mode resumed in sync
    add("resume", "zero ck in sync", T + ["--cpus", "2", "--mode", "zero", "--checkpoint-dir", "zck"])
    add("resume", "zero ck in sync (resume)", T + ["--cpus", "2", "--epochs", "2", "--checkpoint-dir", "zck", "--resume"])

    # bad environment variables
    for k, v in (("MANUAL_DP_CONV_PAD", "abc"), ("MANUAL_DP_CONV_PAD", "0"), ("MANUAL_DP_CONV_PAD", "100000"),
                 ("MANUAL_DP_CONV_PAD", None), ("MANUAL_DP_CACHE", "/nonexistent/dir/x.json"), ("MANUAL_DP_CACHE", "adir"),
                 ("MANUAL_DP_CACHE", "garbage"), ("MANUAL_DP_DATA", "/nonexistent"), ("MANUAL_DP_RUNTIME", "bogus"),
                 ("MANUAL_DP_BOARD", "garbage"), ("MANUAL_DP_BOARD", "127.0.0.1:99999"), ("MANUAL_DP_WORKER", "x|y"),
                 ("DMLC_ROLE", "worker"), ("DMLC_ROLE", "server"), ("DMLC_NUM_WORKER", "abc"),
                 ("MANUAL_DP_LOCAL_RANK", "abc"), ("MANUAL_DP_TEST_SKIP_COLLECTIVE", "garbage"),
                 ("MXNET_ENGINE_TYPE", "Bogus"), ("MXNET_GPU_TEMP_COPY", "abc"), ("OPENBLAS_CORETYPE", "BOGUS"),
                 ("MANUAL_DP_PROBE_PARENT", "abc"), ("MANUAL_DP_SETTINGS", "garbage"), ("MKL_NUM_THREADS", "x"),
                 ("OMP_NUM_THREADS", "100000"), ("MXNET_CPU_TEMP_COPY", "100000"), ("HOME", "/nonexistent"),
                 ("MXNET_EXEC_BULK_EXEC_TRAIN", "x"), ("TMPDIR", "/nonexistent")):
        add("env", f"train {k}={v}", T + ["--cpus", "2"], {k: v, **({"MANUAL_DP_CACHE": str(W / 'c.json')} if k == "MANUAL_DP_CONV_PAD" else {})})
    add("env", "train --backend dist_sync DMLC_ROLE=worker no uri", T + ["--backend", "dist_sync"], {"DMLC_ROLE": "worker"})
    add("env", "plan OMP_NUM_THREADS=abc", ["-m", "manual_dp.plan", "--devices", "2", "--memory-per-device", "1G"], {"OMP_NUM_THREADS": "abc"})
    add("env", "bench MXNET_CPU_TEMP_COPY=-1", ["-m", "manual_dp.bench", "--tiny", "--only", "train", "--out", "bo"], {"MXNET_CPU_TEMP_COPY": "-1"})
    add("env", "launch DMLC_ROLE=server", ["-m", "manual_dp.launch", "--workers", "1", "--", "true"], {"DMLC_ROLE": "server"})

    # signals
    LONG = ["--train-size", "600", "--test-size", "64", "--batch-size", "16", "--epochs", "50", "--no-progress",
            "--data-dir", data]
    for s in (TERM, INT, HUP):
        add("signals", f"train {s.name} at 0.3 s", ["-m", "manual_dp.train", *LONG, "--cpus", "2"], sig=(0.3, s))
        add("signals", f"train {s.name} at 1.5 s", ["-m", "manual_dp.train", *LONG, "--cpus", "2"], sig=(1.5, s))
        add("signals", f"train {s.name} after a checkpoint", ["-m", "manual_dp.train", *LONG, "--cpus", "2",
                                                              "--checkpoint-dir", f"sck_{s.name}"],
            sig=(f"sck_{s.name}/checkpoint.npz", s))
        add("signals", f"train --memory-per-device {s.name} at 2.5 s", ["-m", "manual_dp.train", *LONG, "--cpus", "2",
                                                                        "--width", "16", "--memory-per-device", "10KiB"], sig=(2.5, s))
        add("signals", f"plan --verify {s.name} at 4 s", ["-m", "manual_dp.plan", "--devices", "2", "--memory-per-device", "1G",
                                                        "--verify", "--steps", "50"], sig=(4, s))
        add("signals", f"launch {s.name} at 4 s", ["-m", "manual_dp.launch", "--workers", "2", "--", PY, "-m", "manual_dp.train",
                                                   "--backend", "dist_sync", "--cpus", "1", *LONG], sig=(4, s))
        add("signals", f"bench --memory {s.name} at 3 s", ["-m", "manual_dp.bench", "--memory", "--cpus", "2", "--width", "4",
                                                          "--out", f"bm_{s.name}"], sig=(3, s))
        add("signals", f"diverge --replay {s.name} at 1.5 s", ["-m", "manual_dp.diverge", "d.jsonl", "d.jsonl", "--replay",
                                                              "--update", "2"], sig=(1.5, s))
        add("signals", f"bench.modes {s.name} at 3 s", ["-m", "manual_dp.bench.modes", "--out", f"bmo_{s.name}"], sig=(3, s))
        add("signals", f"bench.stages {s.name} at 3 s", ["-m", "manual_dp.bench.stages"], sig=(3, s))
        add("signals", f"timeline {s.name} at 0.5 s", ["-m", "manual_dp.timeline", "trace.json", "-o", f"t_{s.name}.png"], sig=(0.5, s))
    return out


def main():
    results = []
    for case in cases(W, DATA, TINY):
        if ONLY and ONLY not in case[0]:
            continue
        t = time.monotonic()
        r = run(case)
        r["sec"] = round(time.monotonic() - t, 1)
        results.append(r)
        flag = "ok " if r["clean"] else "BAD"
        print(f"{flag} {r['kind']:8} {r['name'][:60]:60} code {r['code']} {r['sec']}s  {r['last'][:150]}", flush=True)
    (W / "results.json").write_text(json.dumps(results, indent=1))
    n = len(results)
    print(f"cases {n}, clean {sum(r['clean'] for r in results)}, tracebacks {sum(r['traceback'] for r in results)}, "
          f"hangs {sum(r['hang'] for r in results)}, leftovers {sum(bool(r['leftovers']) for r in results)}, "
          f"other unclean {sum(not r['clean'] and not r['traceback'] and not r['hang'] and not r['leftovers'] for r in results)}")


if __name__ == "__main__":
    main()
