"""One training run from a RunConfig: devices, data, strategy, resume, then an epoch at a time with
a checkpoint, a log record and one printed line after each. Rank 0 alone prints and writes."""
import contextlib
import faulthandler
import hashlib
import os
import sys
from pathlib import Path

import numpy as np

from .. import checkpoint, checks, config, datasets, memory, modes
from ..digests import DigestError, DigestFile, header as digest_header
from ..errors import (PEER_LOST, CheckpointError, DataError, DistributedError, DivergedError, OutputError,
                      ReplicaMismatchError, Terminated, UsageError)
from ..fast.trace import TRACE_UPDATES
from ..loop import fit
from ..multiprocess.agree import agree
from ..multiprocess.connect import connect
from ..schedule import updates_per_epoch
from ..strategies.wrappers.digested import Digested
from ..strategies.wrappers.ledgered import Ledgered, header as ledger_header
from ..ledger import LedgerFile
from . import config_file, memcheck, text
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
        return 0, [], None
    state, meta = saved
    saved_config = dict(config.DEFAULTS_OF_NEWER_KEYS, **meta["config"])    # older checkpoints lack newer keys
    differ = {k: (saved_config.get(k), v) for k, v in run_config.items() if saved_config.get(k) != v}
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
    print(f"resumed from {cfg.checkpoint_dir} after epoch {meta['epoch']}")
    saved_file = meta.get("model_file")
    if saved_file and source and saved_file["sha256"] != source["sha256"]:
        sys.stderr.write(f"manual_dp.train: warning: {source['path']} changed since the checkpoint in "
                         f"{cfg.checkpoint_dir} was written (its parameters have the same shapes): the run goes "
                         f"on with the edited model\n")
    return meta["epoch"], meta["history"], meta["rng_state"]


def unfit(meta, n_train):
    """What in a checkpoint's counts this run cannot continue from (its history lacks what the
    summary reads; more updates than examples seen), or None."""
    lacking = [k for k in ("test_acc", "epoch_sec", "images_per_sec") for r in meta["history"] if k not in r]
    if lacking:
        return f"damaged: its history lacks {lacking[0]}"
    if meta["t"] > meta["epoch"] * n_train:
        return (f"damaged: it counts {meta['t']} updates after {meta['epoch']} epoch(s) of {n_train} examples "
                f"(an update takes at least one)")
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
    train_data, test_data = data.train, data.test
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
    run_config, source = {k: getattr(cfg, k) for k in config.RUN_KEYS}, model_file(cfg)
    start_epoch, history, rng_state = resume_from(cfg, world, model, run_config, len(train_data[0]), source)
    if cfg.digests:                      # after the resume: the file keeps the checkpoint's updates
        model = Digested(model, resume_digests(cfg, world, model.t) if world.is_root else None)
    if cfg.ledger:                       # an MoE GPT's routing per update (manual_dp/ledger.py)
        model = Ledgered(model, LedgerFile(cfg.ledger, ledger_header(net)))
    if history and cfg.log_json and world.is_root:
        save_log(cfg, history)           # the log matches the checkpoint again, however the last run ended
    rng = np.random.default_rng(cfg.seed)
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
    show = sys.stderr.isatty() and not cfg.no_progress and world.is_root
    for epoch in range(start_epoch + 1, cfg.epochs + 1):
        bar = Progress(epoch, cfg.epochs, show)
        record, = fit(model, train_data, test_data, epoch, cfg.batch_size, lr, rng,
                      start_epoch=epoch - 1, on_batch=bar, check_replicas=cfg.check_replicas or 0)
        bar.close()
        if epoch == cfg.epochs and policy.scaler and policy.scaler.untrained():   # before its checkpoint
            raise DivergedError(f"epoch {epoch}: {policy.scaler.untrained()}")
        record = text.with_mfu(record, net, peak) if peak else record
        history.append(dict(record, mode=cfg.mode, memory=mem, model=net.describe()))
        state = model.state_dict() if cfg.checkpoint_dir else None   # every rank: it may gather
        if cfg.checkpoint_dir and world.is_root:
            checkpoint.save(cfg.checkpoint_dir, state,
                            {"epoch": epoch, "history": history, "config": run_config,
                             "rng_state": rng.bit_generator.state, "model": net.describe(),
                             **({"model_file": source} if source else {})})
        if cfg.log_json and world.is_root:
            save_log(cfg, history)
        print(format_record(record, cfg.epochs), flush=True)
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


def give_up(message):
    """The watchdog's verdict: one line, then the process ends at once with PEER_LOST. Its main
    thread may be waiting inside MXNet's engine for a peer that is gone, where no exception can reach it."""
    sys.stderr.write(f"manual_dp.train: error: {message}\n")
    sys.stderr.flush()
    os._exit(PEER_LOST)


def run(cfg):
    """Train as `cfg` says, printing one line per epoch; returns the history. Errors are raised."""
    with connect(cfg.backend, cfg.timeout, give_up, cfg.flight_record) as world:
        return run_in(cfg, world)


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
