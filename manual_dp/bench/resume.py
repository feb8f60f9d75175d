"""`python -m manual_dp.bench.resume [--layouts NAME,...] [--stop T]`: the A x B matrix of issue 39. A run
stopped mid-epoch in layout A (`--max-steps T`) and resumed in layout B ends, under `--deterministic`,
with the bits of one context's uninterrupted run, for every pair.

Every run is `python -m manual_dp.train` in a child process on the same small vision transformer (2
blocks of width 16; 2 epochs of 10 updates; --deterministic --tensor-pieces 2: the pieces tensor
parallelism sums in, so that every layout adds in one order; a pipeline takes the pieces of a model
whose layers split one by one, which LeNet's do not); a cell is "same bits" when B's final checkpoint holds one context's
parameters and optimiser state exactly, else the largest difference relative to the largest value.
"""
import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from .. import checkpoint
from .command import commit
from ..fast.runtime import machine

RUN = ["--model", "transformer", "--layers", "2", "--d-model", "16", "--heads", "2", "--train-size", "320", "--test-size", "64", "--batch-size", "32", "--epochs", "2", "--no-progress",
       "--deterministic", "--tensor-pieces", "2"]
LAYOUTS = {"1 context": ["--cpus", "1"], "sync x3": ["--cpus", "3"],
           "zero-3 x2": ["--cpus", "2", "--mode", "zero", "--zero-stage", "3"],
           "1f1b x2": ["--cpus", "2", "--mode", "pipeline", "--schedule", "1f1b"],
           "tensor x2": ["--cpus", "2", "--mode", "tensor", "--tensor-parallel", "2"],
           "dp2 x pp2": ["--cpus", "4", "--mesh", "dp=2,pp=2"]}


def train(argv, ck):
    """Run `manual_dp.train ARGV --checkpoint-dir CK`; RuntimeError with its last line if it fails."""
    done = subprocess.run([sys.executable, "-m", "manual_dp.train", *RUN, *argv, "--checkpoint-dir", str(ck)],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError((done.stderr.strip().splitlines() or ["failed"])[-1])


def arrays(ck):
    state, _ = checkpoint.load(ck)
    return list(state["params"]) + [s for st in state["opt_state"] for s in st]


def verdict(got, want):
    """"same bits", or the largest difference relative to the largest value."""
    if all(np.array_equal(g, w) for g, w in zip(got, want)):
        return "same bits"
    scale = max(float(np.abs(w).max()) for w in want)
    return f"{max(float(np.abs(g - w).max()) for g, w in zip(got, want)) / scale:.1e}"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m manual_dp.bench.resume", description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--stop", type=int, default=13, help="the update A stops after (default 13: epoch 2, batch 3)")
    a = p.parse_args(argv)
    names = a.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not 1 <= a.stop < 20:
        p.error(f"--layouts takes {', '.join(LAYOUTS)}; --stop 1 to 19 (got {', '.join(unknown) or a.stop})")
    print(f"python -m manual_dp.bench.resume: {machine()}, commit {commit()}; {' '.join(RUN)}; "
          f"A stops after update {a.stop}, B resumes to the end", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        train(LAYOUTS["1 context"], Path(tmp) / "straight")
        want = arrays(Path(tmp) / "straight")
        print(f"{'A / B':12}" + "".join(f"{b:>12}" for b in names))
        for i, A in enumerate(names):
            cells = []
            for j, B in enumerate(names):
                ck = Path(tmp) / f"{i}-{j}"
                train(LAYOUTS[A] + ["--max-steps", str(a.stop)], ck)
                train(LAYOUTS[B] + ["--resume"], ck)
                cells.append(verdict(arrays(ck), want))
            print(f"{A:12}" + "".join(f"{c:>12}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
