"""`python -m manual_dp.bench.checkpoints [--repeats R] [--every K] [TRAINER FLAGS]`: what saving a
checkpoint every K updates costs the step, written in the step's thread and from a thread of its own
(--async-checkpoint), against no checkpoint, side by side in one run.

Each way trains one epoch of `python -m manual_dp.train` in a child process (the GPT on fortunes by
default: Adam's two moments make its state three times its parameters), R times, the ways alternated;
the epoch's seconds (its record's epoch_sec, which a mid-epoch save falls inside of; every way takes
the same updates) are compared. Prints each way's median and its ratio to no checkpoint.
"""
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ..cli.output import fail
from .command import commit
from ..fast.runtime import machine

PROG = "python -m manual_dp.bench.checkpoints"
BASE = ["--model", "gpt", "--data", "fortunes", "--train-size", "3200", "--test-size", "64", "--cpus", "2"]
WAYS = {"none": [], "in the step": ["--checkpoint-every", "{every}"],
        "async": ["--checkpoint-every", "{every}", "--async-checkpoint"]}


def epoch_step(argv, ck):
    """Seconds of one epoch of `manual_dp.train ARGV` (every way takes the same updates); RuntimeError
    with the run's last line if it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        cmd = [sys.executable, "-m", "manual_dp.train", *argv, "--epochs", "1", "--log-json", str(log),
               "--no-progress", "--checkpoint-dir", str(ck)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError((done.stderr.strip().splitlines() or ["failed"])[-1])
        record = json.loads(log.read_text().splitlines()[-1])
    return record["epoch_sec"]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    repeats, every = 3, 10
    for name in ("--repeats", "--every"):
        if name in argv:
            i = argv.index(name)
            try:
                value = int(argv[i + 1])
            except (IndexError, ValueError):
                sys.exit(fail(f"{name} takes a whole number", 2, prog=PROG))
            repeats, every = (value, every) if name == "--repeats" else (repeats, value)
            del argv[i:i + 2]
    if repeats < 1 or every < 1:
        sys.exit(fail("--repeats and --every must be at least 1", 2, prog=PROG))
    flags = BASE + argv
    print(f"{PROG}: {machine()}, commit {commit()}; python -m manual_dp.train {' '.join(flags)}, a checkpoint "
          f"every {every} updates; {repeats} epoch(s) each way, alternated", flush=True)
    seconds = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for way, extra in WAYS.items():
                ck = Path(tmp) / f"{r}-{way.replace(' ', '_')}"
                try:
                    sec = epoch_step(flags + [a.format(every=every) for a in extra], ck)
                except RuntimeError as e:
                    sys.exit(fail(f"{way}: {e}", 1, prog=PROG))
                seconds[way].append(sec)
    base = statistics.median(seconds["none"])
    for way, secs in seconds.items():
        print(f"{way:12} epoch {statistics.median(secs):6.2f} s (median; all: "
              f"{', '.join(f'{s:.2f}' for s in secs)})  {statistics.median(secs) / base:5.3f}x no checkpoint")


if __name__ == "__main__":
    main()
