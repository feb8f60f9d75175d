"""The house plan moves every strategy (issue 36), and must change no bit: every layout of
tests/golden_layouts.py, in one process and in two, gives the digest it gave at GOLDEN, the commit
before the move.

The reference is the digests recorded at GOLDEN on this kind of CPU (tests/golden_layouts.json,
keyed by CPU family, model and the flags that choose MXNet's kernels), or, on a CPU not recorded
there, the same configurations computed by GOLDEN's own tree (taken from git) in this run."""
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import io
from pathlib import Path

import numpy as np
import pytest

from conftest import write_dataset
from jobs import HOROVODRUN, PYTHON, launch_cmd, horovod_cmd, read_log, run_job, saved_arrays
from test_distributed import needs_horovod

GOLDEN = "5c37cc2c49203ae121df332ced6f736ecc5f8869"
HERE = Path(__file__).parent
RECORDED = HERE / "golden_layouts.json"
JOB = ["--epochs", "1", "--train-size", "256", "--test-size", "64", "--batch-size", "128", "--seed", "0"]
JOBS = {     # name: (how many processes, the launcher, flags)
    "dist_sync 2 x sync": ("dist_sync", "--cpus", "1"),
    "dist_sync 2 x zero3 det": ("dist_sync", "--cpus", "1", "--mode", "zero", "--zero-stage", "3", "--deterministic"),
    "horovod 2 x det": ("horovod", "--cpus", "1", "--deterministic"),
}


def machine():
    """The kind of CPU, as far as MXNet's kernels can tell: vendor, family, model, vector flags."""
    info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    fields = {k.strip(): v for k, v in (line.split(":", 1) for line in info.splitlines() if ":" in line)}
    flags = sorted(f for f in fields.get("flags", "").split() if f.startswith(("avx", "fma", "amx")))
    return " ".join(fields.get(k, "?").strip() for k in ("vendor_id", "cpu family", "model")) + " " + " ".join(flags)


@pytest.fixture(scope="module")
def golden_tree(tmp_path_factory):
    """GOLDEN's manual_dp/ in a folder of its own (None where git has no such commit)."""
    top = HERE.parent
    archive = subprocess.run(["git", "-C", str(top), "archive", GOLDEN, "manual_dp"], capture_output=True)
    if archive.returncode:
        return None
    tree = tmp_path_factory.mktemp("golden")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree)
    return tree


def computed(tree=None, names=()):
    """tests/golden_layouts.py's digests, by this package or by the one in `tree`."""
    env = dict(os.environ, PYTHONPATH=str(tree)) if tree else dict(os.environ)
    done = subprocess.run([sys.executable, str(HERE / "golden_layouts.py"), *names], capture_output=True,
                          text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def recorded(kind):
    """The digests recorded at GOLDEN on this kind of CPU, or None."""
    book = json.loads(RECORDED.read_text()) if RECORDED.exists() else {}
    return book.get(machine(), {}).get(kind)


def reference(kind, golden_tree, compute):
    """The recorded digests of `kind`, else GOLDEN's tree's; skip only where neither can be had."""
    found = recorded(kind)
    if found is None and golden_tree is None:
        pytest.skip(f"no digests recorded for this CPU ({machine()}) and no commit {GOLDEN[:7]} in git")
    return found if found is not None else compute(golden_tree)


def test_every_layout_in_one_process_keeps_its_bits(golden_tree):
    want = reference("in-process", golden_tree, computed)
    got = computed()
    assert set(got) == set(want)
    changed = [name for name in want if got[name] != want[name]]
    assert not changed, f"these layouts' bits changed since {GOLDEN[:7]}: {changed}"


def job_digest(tmp_path, name, tree=None):
    """The SHA-256 of what job `name` saved (parameters, optimiser state) and logged (losses)."""
    backend, *flags = JOBS[name]
    out = tmp_path / name.replace(" ", "_") / ("golden" if tree else "now")
    out.mkdir(parents=True)
    argv = [*flags, *JOB, "--data-dir", str(tmp_path / "data"), "--log-json", str(out / "log.jsonl"),
            "--checkpoint-dir", str(out / "ck")]
    cmd = horovod_cmd(2, *argv) if backend == "horovod" else launch_cmd(2, backend, *argv)
    env = {"PYTHONPATH": str(tree)} if tree else {}
    code, text = run_job(cmd, out / "out.txt", env=env)
    assert code == 0, text
    losses = [r["train_loss"] for r in read_log(out / "log.jsonl")]
    return hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in saved_arrays(out / "ck"))
                          + repr(losses).encode()).hexdigest()


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_horovod) if n.startswith("horovod") else n
                                  for n in JOBS])
def test_every_layout_in_two_processes_keeps_its_bits(tmp_path, golden_tree, name):
    write_dataset(tmp_path / "data", n_train=256, n_test=64)
    want = reference("processes", golden_tree, lambda tree: {name: job_digest(tmp_path, name, tree)})
    assert job_digest(tmp_path, name) == want[name]


if __name__ == "__main__":   # record this CPU's digests (run at GOLDEN only): python tests/test_golden_layouts.py
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        write_dataset(Path(d) / "data", n_train=256, n_test=64)
        book = json.loads(RECORDED.read_text()) if RECORDED.exists() else {}
        book[machine()] = {"in-process": computed(),
                           "processes": {n: job_digest(Path(d), n) for n in JOBS
                                         if not n.startswith("horovod") or HOROVODRUN.exists()}}
        RECORDED.write_text(json.dumps(book, indent=1, sort_keys=True) + "\n")
        print(f"recorded {machine()}")
