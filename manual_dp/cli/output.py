"""What the command line shows and writes: progress bar, one line per epoch, the JSON log."""
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
from pathlib import Path


from .. import modes
from ..errors import Terminated, UsageError
from ..links import LINK_PRESETS, parse_link
from ..fast.runtime import environment_problem

# What --zero-stage shards over a mesh's data dimension (strategies/zero/dp_zero.py); stage 3's parameters are
# all-gathered whole for a step's forward and backward, an evaluation or a checkpoint, and dropped after.
DP_SHARDED = modes.SHARDED


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
    line = modes.of(cfg).describe(cfg)
    line += (f", the sequence in {cfg.sequence_pieces} fixed pieces (--sequence-pieces: the bits of --mode context "
             f"with any --context-parallel dividing it)" if (cfg.sequence_pieces or 1) > 1
             and not modes.of(cfg).splits else "")
    line += (f", every split layer in {cfg.tensor_pieces} fixed pieces (--tensor-pieces: the bits of --mode "
             + ("context" if (cfg.sequence_pieces or 1) > 1 else "tensor") + " with any --tensor-parallel dividing it)"
             if (cfg.tensor_pieces or 1) > 1 and not modes.of(cfg).splits else "")
    line += ", the sequence cut between the split layers (sequence parallel)" if cfg.sequence_parallel \
        and not cfg.deterministic else ""
    line += (f", {DP_SHARDED.get(cfg.zero_stage)} sharded over the data dimension (ZeRO-{cfg.zero_stage})"
             if cfg.zero_stage and cfg.mode != "zero" else "")
    line += ", BatchNorm statistics over every context" if cfg.sync_batchnorm else ""
    line += f", gradients clipped to a global norm of {cfg.clip_norm:g}" if cfg.clip_norm else ""
    return line + (f", {cfg.grad_accum} batches per update" if cfg.grad_accum > 1 else "") + (
        f", {'LeNet' if cfg.model == 'lenet' else cfg.model} x{cfg.width} wide" if cfg.width > 1 else "") + pipeline_settings(cfg) \
        + compression(cfg) + emulated(cfg)


def emulated(cfg):
    """What --link and --straggler emulate, if given (checks.check_links has parsed them)."""
    link = parse_link(cfg.link) if cfg.link else None
    context, factor = cfg.straggler.split(":") if cfg.straggler else (None, None)
    return ((f", every transfer over an emulated {link.bandwidth / 1e9:g} GB/s, {link.latency * 1e6:g} us link"
             f"{f' ({link.name})' if link.name in LINK_PRESETS else ''}" if link else "")
            + (f", context {context} {float(factor):g}x as slow (--straggler)" if cfg.straggler else ""))


def pipeline_settings(cfg):
    """What --stages, --schedule and --recompute change, if given."""
    return ((f", {cfg.stages} stages" if (cfg.stages or 2) != 2 and cfg.mode != "hybrid" else "")
            + (f", {modes.SCHEDULE_NAMES[cfg.schedule]} schedule" if cfg.schedule in modes.SCHEDULE_NAMES and cfg.mode == "hybrid" else "")
            + (f", {cfg.virtual_stages} chunks a context" if (cfg.virtual_stages or 1) > 1 else "")
            + (", activations recomputed in the backward" if cfg.recompute else ""))


def compression(cfg):
    """What --compress changes, if given."""
    if cfg.compress == "none":
        return ""
    return (f", gradients sent as --compress {cfg.compress} with error feedback" +
            (" (summed by the all-reduce)" if cfg.compress.startswith("powersgd") else
             " (gathered and summed on the first context instead of all-reduced)"))


def format_record(r, epochs):
    """The epoch's line: losses, accuracies, time, and what the mode measured."""
    line = (f"epoch {r['epoch']}/{epochs}  loss {r['train_loss']:.4f}  train acc {r['train_acc']:.3f}  "
            f"test acc {r['test_acc']:.3f}  {r['epoch_sec']:.1f} s  {r['images_per_sec']:.0f} img/s")
    if "val_loss" in r:                          # a language model's (--model gpt)
        line += f"  val loss {r['val_loss']:.4f} ({r['val_loss'] / math.log(2):.3f} bits/token)  " \
                f"{r['tokens_per_sec']:,.0f} tokens/s" + (f"  MFU {r['mfu']:.1%}" if "mfu" in r else "")
    if "grad_norm_mean" in r:
        line += f"  grad norm {r['grad_norm_mean']:.3g} (max {r['grad_norm_max']:.3g})"
    if "loss_scale" in r:
        line += f"  loss scale {r['loss_scale']:g} ({r['skipped_steps']} skipped)"
    if "staleness_mean" in r:
        line += f"  staleness {r['staleness_mean']:.2f} (max {r['staleness_max']})"
    if "bubble_fraction" in r:
        line += f"  bubble {r['bubble_fraction']:.2f}"
    if "comm_rounds" in r:
        line += f"  {r['comm_rounds']} comm rounds"
    if "compress_bytes_per_step" in r:
        line += f"  {r['compress_bytes_per_step']:,} B/step sent ({r['compress']})"
    return line


def interrupted(signum=None, prog="manual_dp.train"):
    """Ctrl-C (or signal `signum`: SIGTERM, SIGHUP): one line, then exit 130 (128 + signum) at once.
    By now every `with` block has closed (the checkpoint lock released, no file half-written);
    exiting through the interpreter's shutdown instead let MXNet's engine end the process by SIGINT
    about one time in three."""
    what = "interrupted" if signum is None else f"stopped by {signal.Signals(signum).name}"
    print(f"{prog}: error: {what}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130 if signum is None else 128 + signum)


def terminate(signum, frame):
    """SIGTERM, SIGHUP: raise Terminated in the main thread."""
    raise Terminated(signum)


@contextlib.contextmanager
def ends_on_signals(prog):
    """Inside, SIGTERM and SIGHUP raise Terminated; Ctrl-C, SIGTERM or SIGHUP end the command with
    one line and exit 130 or 128 + signal, once every `with` block inside has closed (a child
    process killed, no file half-written). Afterwards the previous handlers are back."""
    previous = {s: signal.signal(s, terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    except KeyboardInterrupt:
        interrupted(prog=prog)
    except Terminated as e:
        interrupted(e.signum, prog=prog)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def fail(message, code, prog="manual_dp.train"):
    """Print the one line of an error; returns the exit status."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


def parsed_or_exit(parse, argv, prog):
    """parse(argv): a command's checked arguments, or, for bad input (or thread variables MXNet
    would abort on), its one line and exit 2."""
    try:
        problem = environment_problem()
        if problem:
            raise UsageError(problem)
        return parse(argv)
    except UsageError as e:
        sys.exit(fail(e, 2, prog))
