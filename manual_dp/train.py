"""The epoch loop, evaluation on every device, and the command line (`python -m manual_dp.train`)."""
import collections
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # the CLI: thread settings must be in the environment before mxnet loads
    from manual_dp.runtime import configure
    configure(sys.argv[1:])

import numpy as np
from mxnet import nd

from .data import batches
from .prefetch import prefetch
from .schedule import lr_at
from .step import DataParallel


def evaluate(model, X, y, batch_size):
    """Accuracy of `model` on (X, y), every batch sharded over all its contexts."""
    total = sum(model.correct(nd.array(Xb), nd.array(yb))
                for Xb, yb in batches(X, y, batch_size))
    return float(total.asscalar()) / len(X)


def run_epoch(model, X, y, batch_size, lr, rng, on_batch=None, lookahead=2):
    """One pass over (X, y) in `rng`'s order; returns (mean loss, accuracy).

    Metrics stay on the devices until the end of the epoch; the host waits only on the batch
    `lookahead` steps back, so that MXNet's queue stays full but bounded.
    """
    min_batch = getattr(model, "min_batch", len(model.ctx))  # multi-process: all contexts
    totals, seen, pending = None, 0, collections.deque()
    n_batches = -(-len(X) // batch_size)
    for i, (Xb, yb) in enumerate(prefetch(batches(X, y, batch_size, rng))):
        if len(Xb) < min_batch:
            break  # a tail smaller than the device count is dropped, never crashes
        metrics = model.step(Xb, yb, lr_at(lr, model.t))
        totals = accumulate(totals, metrics)
        seen += len(Xb)
        pending.append(totals[0][0])
        if len(pending) > lookahead:
            pending.popleft().wait_to_read()
        if on_batch:
            on_batch(i + 1, n_batches)
    if not seen:
        return float("nan"), float("nan")
    return (sum(float(l.asscalar()) for l, _ in totals) / seen,
            sum(float(c.asscalar()) for _, c in totals) / seen)


def accumulate(totals, metrics):
    """Running per-context (loss sum, correct), each added on its own device: no copies per batch."""
    if totals is not None and len(totals) != len(metrics):  # a strategy whose context count varies
        home = totals[0][0].context
        totals, metrics = fold(totals, home), fold(metrics, home)
    return list(metrics) if totals is None else [(L + l, C + c) for (L, C), (l, c) in zip(totals, metrics)]


def fold(pairs, home):
    """[(sum of losses, sum of corrects)] of per-context pairs, on `home`."""
    return [tuple(nd.add_n(*[pair[j].copyto(home) for pair in pairs]) for j in (0, 1))]


def train(model, train_data, test_data, epochs, batch_size, lr, rng,
          start_epoch=0, on_batch=None):
    """Train for epochs start_epoch+1..epochs, yielding one record per epoch (no printing)."""
    (Xtr, ytr), (Xte, yte) = train_data, test_data
    for epoch in range(start_epoch + 1, epochs + 1):
        start = time.perf_counter()
        train_loss, train_acc = run_epoch(model, Xtr, ytr, batch_size, lr, rng, on_batch)
        # Optional hook: apply a pending accumulation window, return what the mode measured.
        extras = model.end_epoch(lr_at(lr, model.t)) if hasattr(model, "end_epoch") else {}
        epoch_sec = time.perf_counter() - start
        test_acc = evaluate(model, Xte, yte, batch_size)
        yield {"epoch": epoch, "train_loss": train_loss, "train_acc": train_acc,
               "test_acc": test_acc, "epoch_sec": epoch_sec,
               "images_per_sec": len(Xtr) / epoch_sec, "devices": [str(c) for c in model.ctx],
               **extras}


def run(args):
    """Train as the parsed command line says, printing one line per epoch; returns the history.

    With --backend other than local this is one process of a job: rank 0 prints, logs and saves.
    """
    from .world import connect
    with connect(args) as world:
        return run_in(args, world)


def run_in(args, world):
    """run() as one process of `world` (manual_dp.distributed)."""
    from . import checkpoint, cli, memory, modes
    from .data import load_fashion_mnist
    from .model import init_lenet_params

    ctx = world.contexts(args)
    if args.batch_size < len(ctx) * world.size:
        raise cli.UsageError(f"--batch-size {args.batch_size} is smaller than the "
                             f"{len(ctx) * world.size} devices it is split over")
    modes.check(args, ctx)
    train_data, test_data = load_fashion_mnist(args.data_dir, args.train_size, args.test_size)
    model = world.wrap(modes.build(args, init_lenet_params(args.seed, args.init_scale), ctx))
    lr = modes.learning_rate(args, len(train_data[0]))
    mem = memory.per_context(model, args.batch_size)
    config = {k: getattr(args, k) for k in cli.RUN_KEYS}
    start_epoch, history, rng_state = 0, [], None
    saved = world.share(lambda: checkpoint.load(args.checkpoint_dir) if args.resume and
                        (Path(args.checkpoint_dir) / checkpoint.NAME).is_file() else None)
    if saved:  # rank 0 reads the checkpoint, every rank gets it
        state, meta = saved
        if meta["config"] != config:
            raise checkpoint.CheckpointError(f"{args.checkpoint_dir} holds a run with {meta['config']}, "
                                             f"not {config}")
        model.load_state_dict(state)
        start_epoch, history, rng_state = meta["epoch"], meta["history"], meta["rng_state"]
        print(f"resumed from {args.checkpoint_dir} after epoch {start_epoch}")
    elif args.resume:
        print(f"no checkpoint in {args.checkpoint_dir} yet: starting from epoch 1")
    rng = cli.rng_from(args.seed, rng_state)
    print(f"training on {', '.join(map(str, ctx))}: {len(train_data[0])} train / "
          f"{len(test_data[0])} test images, batch {args.batch_size}, {args.optimizer} lr {args.lr}")
    print(f"mode {modes.describe(args)}; lr {lr}\nmemory per context: {memory.format_report(mem)}")
    show = sys.stderr.isatty() and not args.no_progress and world.is_root
    for epoch in range(start_epoch + 1, args.epochs + 1):
        bar = cli.Progress(epoch, args.epochs, show)
        record, = train(model, train_data, test_data, epoch, args.batch_size, lr, rng,
                        start_epoch=epoch - 1, on_batch=bar)
        bar.close()
        history.append(dict(record, mode=args.mode, memory=mem))
        if args.checkpoint_dir and world.is_root:
            checkpoint.save(args.checkpoint_dir, model.state_dict(),
                            {"epoch": epoch, "history": history, "config": config,
                             "rng_state": rng.bit_generator.state})
        if args.log_json and world.is_root:
            cli.write_log(args.log_json, history)
        print(cli.format_record(record, args.epochs) + modes.format_extras(record), flush=True)
    if history:
        total = sum(r["epoch_sec"] for r in history)
        print(f"done: test acc {history[-1]['test_acc']:.4f} after {len(history)} epochs, "
              f"{total:.0f} s training, {np.mean([r['images_per_sec'] for r in history]):.0f} img/s")
    return history


def main(argv=None):
    """`python -m manual_dp.train [flags]`: exits 0, or 2 with one line for bad input."""
    from . import cli
    from .checkpoint import CheckpointError
    from .data import DataError
    from .world import DistributedError
    try:
        args = cli.build_parser().parse_args(argv)
        cli.check_args(args)
        run(args)
    except cli.UsageError as e:
        sys.exit(cli.fail(e, 2))
    except (DataError, CheckpointError, DistributedError) as e:
        sys.exit(cli.fail(e, 1))
    except KeyboardInterrupt:
        sys.exit(cli.fail("interrupted", 130))


if __name__ == "__main__":
    main()
