"""Helpers for tests that start multi-process jobs: bounded, cleaned up, on loopback only."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from manual_dp import checkpoint

PYTHON = sys.executable
# The same thread settings in every process: the float results of MXNet's CPU kernels may depend
# on them (manual_dp.fast.runtime picks them from --cpus unless the environment names them).
PINNED = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
HOROVODRUN = Path(PYTHON).parent / "horovodrun"


def train_cmd(*argv):
    return [PYTHON, "-m", "manual_dp.train", "--no-progress", *map(str, argv)]


def horovod_cmd(n, *argv):
    runner = [str(HOROVODRUN)] if HOROVODRUN.exists() else [PYTHON, "-m", "horovod.runner.launch"]
    return [*runner, "-np", str(n), "-H", f"localhost:{n}", "--gloo", *train_cmd("--backend", "horovod", *argv)]


def launch_cmd(workers, backend, *argv, servers=1):
    return [PYTHON, "-m", "manual_dp.launch", "--workers", str(workers), "--servers", str(servers),
            "--", *train_cmd("--backend", backend, *argv)]


class Job:
    """A process group started in the background, its output in a file; always cleaned up."""

    def __init__(self, cmd, log, env=None):
        self.log = Path(log)
        self.out = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     env=dict(os.environ, **PINNED, **(env or {})))

    def wait(self, timeout):
        """Exit status; the test fails (and the group dies) if it takes longer than `timeout` s."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job still running after {timeout} s:\n{self.output()}") from None

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def output(self):
        if not self.out.closed:
            self.out.flush()
        return self.log.read_text(errors="replace")

    def close(self):
        if self.proc.poll() is None:
            self.kill()
        # members of the group that outlived its leader
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.out.close()


def run_job(cmd, log, timeout=240, env=None):
    """Run `cmd` to the end; returns (exit status, output)."""
    job = Job(cmd, log, env)
    try:
        code = job.wait(timeout)
        return code, job.output()
    finally:
        job.close()


def environ(pid):
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def trainer_pids(marker, **env):
    """Python processes running manual_dp.train whose command line holds `marker` and whose
    environment has every `env` item."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "python" in Path(argv[0]).name and "manual_dp.train" in argv and marker in " ".join(argv):
            e = environ(d.name)
            if all(e.get(k) == v for k, v in env.items()):
                pids.append(int(d.name))
    return pids


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def read_log(path):
    return [json.loads(line) for line in open(path)]


def saved_arrays(directory):
    """Parameters, optimiser state and running statistics (BatchNorm's, if any) of a checkpoint, as
    one list of numpy arrays."""
    state, _ = checkpoint.load(directory)
    return state["params"] + [s for st in state["opt_state"] for s in st] + list(state["extra"].get("running", []))


def assert_same_run(log_a, ck_a, log_b, ck_b, exact=True):
    """Two runs logged the same losses and accuracies and saved the same parameters."""
    a, b = read_log(log_a), read_log(log_b)
    keys = ("epoch", "train_loss", "train_acc", "test_acc")
    if exact:
        assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    else:
        np.testing.assert_allclose([[r[k] for k in keys] for r in a],
                                   [[r[k] for k in keys] for r in b], rtol=1e-5, atol=1e-6)
    for x, y in zip(saved_arrays(ck_a), saved_arrays(ck_b)):
        if exact:
            np.testing.assert_array_equal(x, y)
        else:
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


def two_workers_as_one_process(tmp_path, k, *argv):
    """Run `argv` in one process on 2k CPU contexts and as 2 dist_sync workers of k contexts each;
    assert both end 0 with the same losses and parameters (to float rounding: the cross-process sum
    adds the replicas' gradients in another order). Returns both runs' last log records."""
    for name, cmd in (("one", train_cmd("--cpus", 2 * k, *argv)),
                      ("two", launch_cmd(2, "dist_sync", "--cpus", k, *argv))):
        code, out = run_job([*cmd, "--log-json", str(tmp_path / f"{name}.jsonl"),
                             "--checkpoint-dir", str(tmp_path / name)], tmp_path / f"{name}.txt")
        assert code == 0, out
    assert_same_run(tmp_path / "one.jsonl", tmp_path / "one", tmp_path / "two.jsonl", tmp_path / "two", exact=False)
    return [read_log(tmp_path / f"{name}.jsonl")[-1] for name in ("one", "two")]
