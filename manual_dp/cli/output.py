"""What the command line shows and writes: progress bar, one line per epoch, the JSON log."""
import json
import os
import sys
import tempfile
from pathlib import Path


def write_atomic(path, text):
    """Replace the file at `path` with `text`: a crash or a full disk leaves the old file or the
    new, never half, and no temporary file (each writer its own temporary name)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_log(path, history):
    """The whole history as JSON lines (strict JSON: no NaN), replaced atomically after every
    checkpoint, so the log matches the checkpoint; --resume rewrites it from the checkpoint."""
    write_atomic(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in history))


class Progress:
    """A one-line progress bar on a terminal's stderr; silent elsewhere."""

    def __init__(self, epoch, epochs, enabled):
        self.prefix, self.enabled = f"epoch {epoch}/{epochs}", enabled

    def __call__(self, done, total):
        if self.enabled and (done == total or done % 5 == 0):
            filled = 30 * done // total
            sys.stderr.write(f"\r{self.prefix} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
            sys.stderr.flush()

    def close(self):
        if self.enabled:
            sys.stderr.write("\r" + " " * 60 + "\r")


def describe(cfg):
    """One line on what the mode does with these settings."""
    return {"sync": f"sync: replicas in lock-step, gradients all-reduced ({cfg.allreduce}"
                    f"{', fused' if cfg.fuse_grads else ''}{', cached graph' if cfg.graph else ''})",
            "async": f"async: master on the first context, replicas up to {cfg.staleness} updates stale",
            "model": "model: convs on the first context, dense layers on the second",
            "pipeline": f"pipeline: model split, {cfg.micro_batches} GPipe micro-batches",
            "hybrid": f"hybrid: data parallel over 2-stage pipelines, {cfg.micro_batches} micro-batches "
                      f"each ({cfg.allreduce})",
            }[cfg.mode] + (f", {cfg.grad_accum} batches per update" if cfg.grad_accum > 1 else "") + (
        f", gradients sent as --compress {cfg.compress} with error feedback" +
        (" (summed by the all-reduce)" if cfg.compress.startswith("powersgd") else
         " (gathered and summed on the first context instead of all-reduced)")
        if getattr(cfg, "compress", "none") != "none" else "")


def format_record(r, epochs):
    """The epoch's line: losses, accuracies, time, and what the mode measured."""
    line = (f"epoch {r['epoch']}/{epochs}  loss {r['train_loss']:.4f}  train acc {r['train_acc']:.3f}  "
            f"test acc {r['test_acc']:.3f}  {r['epoch_sec']:.1f} s  {r['images_per_sec']:.0f} img/s")
    if "staleness_mean" in r:
        line += f"  staleness {r['staleness_mean']:.2f} (max {r['staleness_max']})"
    if "bubble_fraction" in r:
        line += f"  bubble {r['bubble_fraction']:.2f}"
    if "compress_bytes_per_step" in r:
        line += f"  {r['compress_bytes_per_step']:,} B/step sent ({r['compress']})"
    return line


def fail(message, code):
    """Print the one line of an error; returns the exit status."""
    print(f"manual_dp.train: error: {message}", file=sys.stderr)
    return code
