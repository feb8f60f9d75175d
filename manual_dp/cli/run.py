"""One training run from a RunConfig: devices, data, strategy, resume, then an epoch at a time with
a checkpoint, a log record and one printed line after each. Rank 0 alone prints and writes."""
import contextlib
import faulthandler
import hashlib
import os
import sys
from pathlib import Path

import mxnet as mx
import numpy as np

from .. import checkpoint, checks, config, datasets, memory, modes, perturb
from ..digests import DigestError, DigestFile, header as digest_header
from ..errors import (PEER_LOST, CheckpointError, DataError, DistributedError, DivergedError, OutputError,
                      ReplicaMismatchError, Terminated, UsageError)
from ..fast.trace import TRACE_UPDATES
from ..loop import Cursor, fit
from ..multiprocess.agree import agree
from ..multiprocess.connect import connect
from ..schedule import updates_per_epoch
from ..strategies.wrappers.digested import Digested
from ..strategies.wrappers.ledgered import Ledgered, header as ledger_header
from ..ledger import LedgerFile
from . import config_file, memcheck, saving, text
from .build import build_model, contexts, dry_run, graph_pad, learning_rate, network, policy_of
from .output import Progress, describe, fail, format_record, interrupted, write_atomic, write_log
from .paths import check_outputs


def save_log(cfg, history):
    """The JSON log, rewritten; OutputError if it cannot be."""
    try:
        write_log(cfg.log_json, history)
    except OSError as e:
        raise OutputError(f"--log-json {cfg.log_json}: could not write it ({e.strerror})") from None


def save_config(cfg):
    """The resolved settings of `cfg` written (atomically) to each of config_file.paths(cfg), for
    --config to run again; OutputError if one cannot be."""
    for flag, path in config_file.paths(cfg):
        try:
            write_atomic(path, config_file.dumps(cfg))
        except (OSError, ValueError) as e:
            raise OutputError(f"{flag}: could not write the run's settings to {path} "
                              f"({getattr(e, 'strerror', None) or e})") from None


def resume_from(cfg, world, model, run_config, n_train, source):
    """(epoch, history, rng state) to continue from: the checkpoint's, loaded into `model`, or a
    fresh start. Rank 0 reads the checkpoint; every rank gets it. A checkpoint.npz that is not a
    regular file (a dangling symlink, a FIFO) is refused, not taken for none. `source`: model_file(cfg),
    which a warning compares with the checkpoint's."""
    saved = world.share(lambda: checkpoint.load(cfg.checkpoint_dir) if cfg.resume and
                        os.path.lexists(Path(cfg.checkpoint_dir) / checkpoint.NAME) else None)
    if not saved:
        if cfg.resume:
            print(f"no checkpoint in {cfg.checkpoint_dir} yet: starting from epoch 1")
        return 0, [], None, None
    state, meta = saved
    saved_config = dict(config.DEFAULTS_OF_NEWER_KEYS, **meta["config"])    # older checkpoints lack newer keys
    differ = {k: (saved_config.get(k), v) for k, v in run_config.items()
              if k not in config.ORDER_KEYS and differs(k, saved_config.get(k), v)}
    order = [f"--{k.replace('_', '-')} {saved_config[k]} there, {v} here" for k, v in run_config.items()
             if k in config.ORDER_KEYS and k in saved_config and saved_config[k] != v]
    if differ:
        raise CheckpointError(f"{cfg.checkpoint_dir} holds a run with other settings: " + ", ".join(
            f"{k} {repr(old)[:60]} there, {repr(new)[:60]} here" for k, (old, new) in list(differ.items())[:8]))
    problem = unfit(meta, n_train)
    if problem:
        raise CheckpointError(f"{cfg.checkpoint_dir}: {problem}")
    try:
        model.load_state_dict(state)
    except ValueError as e:
        raise CheckpointError(f"{cfg.checkpoint_dir}: does not fit this run ({e})") from None
    cursor = Cursor(**meta["cursor"]) if meta.get("cursor") else None
    print(f"resumed from {cfg.checkpoint_dir} after epoch {meta['epoch']}" + (
        f" and {cursor.batches} batch(es) of epoch {meta['epoch'] + 1} (update {meta['t']})" if cursor else ""))
    if order and cfg.deterministic:
        sys.stderr.write(f"manual_dp.train: warning: {', '.join(order)}: the run goes on, its sums in another "
                         f"order than the saved run's (so not its bits)\n")
    saved_file = meta.get("model_file")
    if saved_file and source and saved_file["sha256"] != source["sha256"]:
        sys.stderr.write(f"manual_dp.train: warning: {source['path']} changed since the checkpoint in "
                         f"{cfg.checkpoint_dir} was written (its parameters have the same shapes): the run goes "
                         f"on with the edited model\n")
    return meta["epoch"], meta["history"], meta["rng_state"], cursor


def differs(key, old, new):
    """Whether a saved setting keeps this run from going on with the saved one: the mode only where
    it computes another algorithm (a layout equal to one context continues any other such), the
    micro-batches only between two pipelines."""
    if key == "mode" and old in modes.TABLE:
        return modes.TABLE[old].algorithm != modes.TABLE[new].algorithm
    if key == "micro_batches":
        return None not in (old, new) and old != new
    return old != new


def unfit(meta, n_train):
    """What in a checkpoint's counts this run cannot continue from (its history lacks what the
    summary reads; more updates than examples seen), or None."""
    lacking = [k for k in ("test_acc", "epoch_sec", "images_per_sec") for r in meta["history"] if k not in r]
    if lacking:
        return f"damaged: its history lacks {lacking[0]}"
    begun = 1 if meta.get("cursor") else 0                 # a mid-epoch checkpoint's epoch under way
    if meta["t"] > (meta["epoch"] + begun) * n_train:
        return (f"damaged: it counts {meta['t']} updates after {meta['epoch']} epoch(s) of {n_train} examples "
                f"(an update takes at least one)")
    if begun and meta["cursor"]["seen"] > n_train:
        return f"damaged: its epoch under way has seen {meta['cursor']['seen']} of {n_train} examples"
    return None


def model_file(cfg):
    """{"path", "sha256"} of --model PATH.py:FUNCTION's file (None for a built-in model), kept in
    the checkpoint so that a resumed run can say that the file changed."""
    if cfg.model in config.MODELS:
        return None
    path = cfg.model.rpartition(":")[0]
    try:
        return {"path": path, "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}
    except OSError:
        return None


def resume_digests(cfg, world, t):
    """The --digests file, its updates 1..t kept; OutputError (the file kept as it is) if it holds
    lines that are not a digest file's (a damaged file, a log, binary data)."""
    try:
        return DigestFile(cfg.digests, digest_header(cfg, world.size)).resume(t)
    except DigestError as e:
        raise OutputError(f"--digests: cannot continue {str(e)[:200]}; the file is kept as it is: give "
                          f"another path, or remove it") from None


def run_in(cfg, world):
    """The run as one process of `world`; returns the history."""
    ctx = contexts(cfg, world)
    agree(cfg, world)                    # every process of a job: the same settings, or one line each
    checks.check_layout(cfg, len(ctx), world.size)
    if cfg.dry_run:
        return dry_run(cfg, ctx, world)
    if world.is_root:
        check_outputs(cfg)
    with contextlib.ExitStack() as stack:
        if world.is_root and cfg.checkpoint_dir:
            stack.enter_context(checkpoint.lock(cfg.checkpoint_dir))
        if world.is_root:
            save_config(cfg)
        return train_in(cfg, world, ctx)


def train_in(cfg, world, ctx):
    """run_in's training, its outputs checked and its checkpoint directory ours."""
    net = network(cfg)
    params = net.init_params(cfg.seed, cfg.init_scale)
    data = datasets.load(cfg).cut(cfg.train_size, cfg.test_size)
    params, train_data = perturb.nudge(cfg.perturb, params, data.train, tokens=data.spec.tokens)
    test_data = data.test
    pad = graph_pad(cfg, world) if world.size == 1 else None       # autotune's timing is no part of a step
    mem = memcheck.run_report(cfg, params, ctx, build_model, world.size, pad)   # before MXNet's own work
    policy = policy_of(cfg)
    model = build_model(cfg, params, ctx, world, policy)
    if len(train_data[0]) < model.min_batch:
        raise UsageError(f"{len(train_data[0])} training example(s) cannot be split over the "
                         f"{model.min_batch} devices of a batch: use a larger --train-size")
    lr = learning_rate(cfg, len(train_data[0]))
    updates = updates_per_epoch(len(train_data[0]), cfg.batch_size, cfg.grad_accum) * cfg.epochs
    if cfg.trace and updates < TRACE_UPDATES:
        raise UsageError(f"--trace records updates 3 to {TRACE_UPDATES}, but this run takes {updates}: "
                         f"use more --epochs or --train-size")
    run_config, source = {k: getattr(cfg, k) for k in config.RUN_KEYS + config.ORDER_KEYS}, model_file(cfg)
    start_epoch, history, rng_state, cursor = resume_from(cfg, world, model, run_config, len(train_data[0]), source)
    if cfg.digests:                      # after the resume: the file keeps the checkpoint's updates
        model = Digested(model, resume_digests(cfg, world, model.t) if world.is_root else None)
    if cfg.ledger:                       # an MoE GPT's routing per update (manual_dp/ledger.py)
        model = Ledgered(model, LedgerFile(cfg.ledger, ledger_header(net)))
    if history and cfg.log_json and world.is_root:
        save_log(cfg, history)           # the log matches the checkpoint again, however the last run ended
    rng = perturb.ordered(cfg.perturb, np.random.default_rng(cfg.seed), cfg.batch_size)
    if rng_state is not None:
        rng.bit_generator.state = rng_state
    print(f"training on {', '.join(map(str, ctx))}: {len(train_data[0])} train / "
          f"{len(test_data[0])} test {'images' if data.spec == datasets.IMAGES else 'examples'} from {data.label}, "
          f"batch {cfg.batch_size}, "
          f"{cfg.optimizer} lr {cfg.lr}")
    print(f"model {net.name} ({', '.join(f'{k} {v}' for k, v in net.config.items())}): {net.summary()}")
    print(f"mode {describe(cfg)}; lr {lr}")
    print("\n".join(modes.grid_of(cfg, len(ctx)).describe(ctx, world.size, cfg.deterministic)))
    print(f"memory per context: {memory.format_report(mem)}")
    if policy.precision != "fp32":
        print(f"precision {policy.describe()}")
    peak = text.gemm_peak() if text.is_language_model(net) else None     # MFU's denominator, measured once
    writer = saving.Writer(cfg.checkpoint_dir, cfg.async_checkpoint) if cfg.checkpoint_dir else None
    try:
        epochs(cfg, world, model, net, (train_data, test_data), lr, rng, history, mem, policy, peak, writer,
               start_epoch, cursor, {"config": run_config, "model": net.describe(), **({"model_file": source} if source else {})})
    finally:
        if writer:
            writer.wait()
    if history:
        total = sum(r["epoch_sec"] for r in history)
        print(f"done: test acc {history[-1]['test_acc']:.4f} after {len(history)} epochs, "
              f"{total:.0f} s training, {np.mean([r['images_per_sec'] for r in history]):.0f} img/s; peak memory "
              + ", ".join(f"{c} {memory.format_bytes(r['peak_bytes'])}" for c, r in mem.items()))
    if peak:
        sample = text.sample_text(net, model.state_dict()["params"], ctx[0])
        if sample is not None and world.is_root:
            print(f"sample ({text.SAMPLE['tokens']} tokens, temperature {text.SAMPLE['temperature']}, top-k "
                  f"{text.SAMPLE['top_k']}; python -m manual_dp.sample DIR for more):\n{sample.removeprefix(text.PROMPT)}")
    return history


def epochs(cfg, world, model, net, data, lr, rng, history, mem, policy, peak, writer, start_epoch, cursor, about):
    """train_in's epochs from start_epoch + 1 (the first going on from `cursor`), each with its
    checkpoint, log record and line; --checkpoint-every's and --max-steps's checkpoints in between
    (cli/saving.py). `about`: what every checkpoint says of the run besides its state."""
    def save(epoch, epoch_rng, **where):
        state = model.state_dict()                      # every rank: it may gather
        if world.is_root:
            writer.save(state, {"epoch": epoch, "history": list(history), "rng_state": epoch_rng, **about, **where})

    if cfg.max_steps and model.t >= cfg.max_steps:
        print(f"--max-steps {cfg.max_steps}: the checkpoint has taken {model.t} updates already; nothing to do")
        return
    epoch_rng = None
    after_update = saving.mid_epoch(cfg, model, lambda e, c, r: save(e, r, cursor=c), lambda: epoch_rng)
    show = sys.stderr.isatty() and not cfg.no_progress and world.is_root
    for epoch in range(start_epoch + 1, cfg.epochs + 1):
        epoch_rng, bar = rng.bit_generator.state, Progress(epoch, cfg.epochs, show)   # before it draws the order
        records = list(fit(model, *data, epoch, cfg.batch_size, lr, rng, start_epoch=epoch - 1, on_batch=bar,
                           check_replicas=cfg.check_replicas or 0, cursor=cursor, after_update=after_update))
        bar.close()
        cursor = None
        if not records:
            print(f"stopped after update {model.t} (--max-steps {cfg.max_steps}) in epoch {epoch}"
                  + (f"; --resume goes on from {cfg.checkpoint_dir}" if cfg.checkpoint_dir else ""), flush=True)
            return
        if epoch == cfg.epochs and policy.scaler and policy.scaler.untrained():   # before its checkpoint
            raise DivergedError(f"epoch {epoch}: {policy.scaler.untrained()}")
        record = text.with_mfu(records[0], net, peak) if peak else records[0]
        history.append(dict(record, mode=cfg.mode, memory=mem, model=net.describe()))
        if writer:
            save(epoch, rng.bit_generator.state)
        if cfg.log_json and world.is_root:
            save_log(cfg, history)
        print(format_record(record, cfg.epochs), flush=True)
        if cfg.max_steps and model.t >= cfg.max_steps:
            print(f"stopped after update {model.t} (--max-steps {cfg.max_steps}), at the end of epoch {epoch}", flush=True)
            return


def give_up(message):
    """The watchdog's verdict: one line, then the process ends at once with PEER_LOST. Its main
    thread may be waiting inside MXNet's engine for a peer that is gone, where no exception can reach it."""
    sys.stderr.write(f"manual_dp.train: error: {message}\n")
    sys.stderr.flush()
    os._exit(PEER_LOST)


def run(cfg):
    """Train as `cfg` says, printing one line per epoch; returns the history. Errors are raised."""
    with connect(cfg.backend, cfg.timeout, give_up, cfg.flight_record) as world:
        try:
            return run_in(cfg, world)
        finally:
            settle()


def settle():
    """Wait until MXNet has run every operation it holds. A custom operator still queued when Python
    exits (an emulated link's delay, fast/link.py, recorded into a tensor-parallel backward) leaves
    MXNet's shutdown waiting for it forever; drained here, the process ends as any other. A failed
    operation's error has been raised already, or is the run's to raise: not again here."""
    with contextlib.suppress(Exception):
        mx.nd.waitall()


def run_or_exit(cfg):
    """run(cfg); bad input ends with one line and exit status 2, missing or broken data,
    checkpoints or outputs with 1, divergence with 3, a lost peer with PEER_LOST (4). A crash in
    native code (SIGSEGV, SIGABRT...) first prints every thread's Python stack (faulthandler, after
    MXNet's own handler is in place, which it then calls), so that it says where it happened."""
    with contextlib.suppress(AttributeError, ValueError, OSError):      # no file descriptor 2: no dump
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    try:
        return run(cfg)
    except UsageError as e:
        sys.exit(fail(e, 2))
    except (DataError, CheckpointError, OutputError, ReplicaMismatchError) as e:
        sys.exit(fail(e, 1))
    except DistributedError as e:
        sys.exit(fail(e, PEER_LOST))
    except DivergedError as e:
        saved = cfg.checkpoint_dir and (Path(cfg.checkpoint_dir) / checkpoint.NAME).is_file()
        kept = " (the checkpoint of the last good epoch is kept)" if saved else ""
        lower = f"a lower --lr than {cfg.lr:g}" + (f" or --outer-lr than {cfg.outer_lr:g}" if cfg.mode == "local" else "")
        sys.exit(fail(f"training diverged at {e}{kept}; try {lower}", 3))
    except KeyboardInterrupt:
        interrupted()
    except Terminated as e:
        interrupted(e.signum)
