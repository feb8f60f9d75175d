"""Command-line plumbing: flags, contexts, progress bar, JSON log and checkpoints around train()."""
import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np


class UsageError(Exception):
    """Bad input from the user: reported as one line and exit status 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default only where it has one worth showing."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def build_parser():
    p = OneLineParser(prog="python -m manual_dp.train",
                      description="Train LeNet on Fashion-MNIST with hand-written data parallelism.",
                      formatter_class=HelpFormatter)
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--gpus", type=int, help="train on gpu(0..N-1) (default: all GPUs, else 2 CPU contexts)")
    dev.add_argument("--cpus", type=int, help="train on cpu(0..N-1)")
    p.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=256, help="global batch, split over the contexts")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate")
    p.add_argument("--optimizer", choices=["sgd", "momentum", "adam"], default="momentum",
                   help="update rule (momentum: SGD with momentum 0.9)")
    p.add_argument("--init-scale", type=float, default=None,
                   help="std of normal(0, s) weights; default He init; 0.01 is the lesson's")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the data order")
    p.add_argument("--data-dir", help="directory with the four Fashion-MNIST IDX .gz files "
                   "(default: $MANUAL_DP_DATA, then Debian's package, then MXNet's cache)")
    p.add_argument("--train-size", type=int, help="use only the first N training examples")
    p.add_argument("--test-size", type=int, help="use only the first N test examples")
    p.add_argument("--log-json", help="write one JSON object per epoch to this file")
    p.add_argument("--checkpoint-dir", help="save a checkpoint here at the end of every epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar, even on a terminal")
    add_mode_arguments(p)
    add_backend_arguments(p)
    add_speed_arguments(p)
    return p


def add_mode_arguments(p):
    """Flags of the parallelism modes (checked against the contexts by manual_dp.modes.check)."""
    g = p.add_argument_group("parallelism modes")
    g.add_argument("--mode", choices=["sync", "async", "model", "pipeline", "hybrid"], default="sync",
                   help="sync: data parallel; async: parameter server with stale replicas; model: convs "
                        "on one context, dense layers on the next; pipeline: model + GPipe micro-batches; "
                        "hybrid: data parallel over 2-context pipelines")
    g.add_argument("--staleness", type=int, default=0, help="async only: replicas refreshed every S+1 updates")
    g.add_argument("--micro-batches", type=int,
                   help="pipeline and hybrid only: micro-batches per batch and pipeline; unset means 4")
    g.add_argument("--grad-accum", type=int, default=1, help="batches per update")
    g.add_argument("--scale-lr", choices=["none", "linear"], default="none",
                   help="linear: lr x batch-size x grad-accum / 256 (Goyal et al.)")
    g.add_argument("--warmup-epochs", type=float, default=0.0,
                   help="ramp the lr up linearly over this many epochs, per update")


def add_backend_arguments(p):
    """Flags of the multi-process backends (manual_dp.distributed)."""
    g = p.add_argument_group("more than one process (see the README)")
    g.add_argument("--backend", choices=["local", "horovod", "dist_sync", "dist_async"], default="local",
                   help="local: this process alone; horovod: under horovodrun; dist_sync, dist_async: "
                        "MXNet's parameter-server KVStore under python -m manual_dp.launch")
    g.add_argument("--timeout", type=float, default=120.0,
                   help="seconds without progress after which a process of a multi-process job gives up")


# The names of manual_dp.collectives.ALLREDUCE_ALGORITHMS (listed here so --help needs no mxnet).
ALLREDUCE_NAMES = ("lesson", "reduce_bcast", "ring", "tree", "scatter_gather", "kvstore")


def add_speed_arguments(p):
    """Flags of the fast synchronous step (see the README's Performance section)."""
    g = p.add_argument_group("speed (--mode sync)")
    g.add_argument("--allreduce", choices=ALLREDUCE_NAMES, default="reduce_bcast",
                   help="how gradients are summed over the contexts (manual_dp.collectives)")
    g.add_argument("--fuse-grads", action=argparse.BooleanOptionalAction,
                   help="one flat gradient buffer per device: one allreduce and one optimiser update "
                        "a step (default: on for --mode sync without --grad-accum)")
    g.add_argument("--graph", action=argparse.BooleanOptionalAction,
                   help="run LeNet as a cached symbolic graph instead of layer by layer "
                        "(default: as --fuse-grads)")


def resolve_speed_flags(args):
    """--fuse-grads/--graph left unset are on where they apply (plain sync), off elsewhere."""
    plain_sync = getattr(args, "mode", "sync") == "sync" and getattr(args, "grad_accum", 1) == 1
    for name in ("fuse_grads", "graph"):
        value = getattr(args, name, None)
        if value and not plain_sync:
            raise UsageError("--fuse-grads and --graph apply only to --mode sync without --grad-accum")
        setattr(args, name, plain_sync if value is None else value)


def check_args(args):
    """Raise UsageError for values no run can use."""
    resolve_speed_flags(args)
    for name in ("epochs", "batch_size", "gpus", "cpus", "train_size", "test_size"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "epochs" else 1):
            raise UsageError(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'epochs' else 'positive'}, got {value}")
    if not args.lr > 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")
    if args.init_scale is not None and not args.init_scale > 0:
        raise UsageError(f"--init-scale must be positive, got {args.init_scale}")
    if args.resume and not args.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout}")


def contexts(args):
    """The contexts named by --gpus/--cpus; by default every GPU, else two CPU contexts."""
    import mxnet as mx
    from .parallel import cpus, try_gpus
    try:
        if args.gpus is not None:
            return try_gpus(args.gpus)
        if args.cpus is not None:
            return cpus(args.cpus)
        n = mx.context.num_gpus()
        return try_gpus(n) if n else cpus(2)
    except ValueError as e:
        raise UsageError(str(e)) from None


# Settings that must match for --resume to continue the same run.
RUN_KEYS = ("batch_size", "lr", "optimizer", "init_scale", "seed", "train_size", "test_size",
            "mode", "staleness", "micro_batches", "grad_accum", "scale_lr", "warmup_epochs")


def write_atomic(path, text):
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_log(path, history):
    """The whole history as JSON lines, replaced atomically so it always matches a checkpoint."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in history))


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


def format_record(r, epochs):
    return (f"epoch {r['epoch']}/{epochs}  loss {r['train_loss']:.4f}  train acc {r['train_acc']:.3f}  "
            f"test acc {r['test_acc']:.3f}  {r['epoch_sec']:.1f} s  {r['images_per_sec']:.0f} img/s")


def fail(message, code):
    print(f"manual_dp.train: error: {message}", file=sys.stderr)
    return code


def rng_from(seed, state=None):
    rng = np.random.default_rng(seed)
    if state is not None:
        rng.bit_generator.state = state
    return rng
