"""One training run from a RunConfig: devices, data, strategy, resume, then an epoch at a time with
a checkpoint, a log record and one printed line after each. Rank 0 alone prints and writes."""
import contextlib
import functools
import os
import sys
import tempfile
from pathlib import Path

import mxnet as mx
import numpy as np

from .. import checkpoint, checks, config, memory
from ..data import load_fashion_mnist, locate_data
from ..digests import DigestFile, header as digest_header
from ..errors import (CheckpointError, DataError, DistributedError, DivergedError, OutputError,
                      ReplicaMismatchError, Terminated, UsageError)
from ..fast import autotune
from ..fast.collectives import ALLREDUCE_ALGORITHMS, make_allreduce
from ..fast.compress import make_reducer
from ..fast.trace import TRACE_UPDATES
from ..loop import fit
from ..mesh import Mesh
from ..models import build as build_network
from ..models.precise import Precise
from ..precision import Policy
from ..multiprocess.agree import agree
from ..multiprocess.connect import connect
from ..schedule import make_lr, updates_per_epoch
from ..strategies.accum import GradAccum
from ..strategies.async_dp import AsyncDataParallel
from ..strategies.data_parallel import DataParallel
from ..strategies.deterministic import DeterministicDataParallel
from ..strategies import schedules
from ..strategies.pipeline import PipelineParallel
from ..strategies.compressed import Compressed
from ..strategies.context import ContextParallel
from ..strategies.digested import Digested
from ..strategies.local_sgd import LocalSGD
from ..strategies.mesh_parallel import MeshParallel
from ..strategies.loss_scaled import LossScaled
from ..strategies.tensor import TensorParallel
from ..strategies.tensor_deterministic import TensorDeterministic
from ..strategies.zero import ZeroRedundancy
from ..strategies.zero_deterministic import DeterministicZero
from . import memcheck
from .output import Progress, describe, fail, format_record, interrupted, write_log


def contexts(cfg, world):
    """This process's contexts: --cpus N as given; --gpus N this process's group of N GPUs of its
    machine (by default every GPU, or one per process in a multi-process job)."""
    kind, n = config.device_request(cfg)
    if kind == "cpu":
        return [mx.cpu(i) for i in range(n)]
    n = 1 if world.size > 1 and cfg.gpus is None else n
    found, first = mx.context.num_gpus(), world.local_rank * n
    if first + n > found:
        where = f"process {world.local_rank} of this machine needs gpu({first})..gpu({first + n - 1})" \
            if world.size > 1 else f"asked for {n} GPU(s)"
        raise UsageError(f"{where} but found {found}; use --cpus N to train on CPU contexts instead")
    return [mx.gpu(first + i) for i in range(n)]


def conv_pad(cfg):
    """The graph's channel padding: measured on this machine, unless --no-autotune or the
    environment says (manual_dp.fast.autotune)."""
    try:
        return autotune.conv_pad(enabled=not cfg.no_autotune)
    except ValueError as e:
        raise UsageError(str(e)) from None


@functools.lru_cache(maxsize=4)
def network_of(model, width, layers, d_model, heads, patch, seed):
    try:
        return build_network(model, width, layers, d_model, heads, patch, seed)
    except ValueError as e:
        raise UsageError(f"--model {model}: {e}") from None


def network(cfg):
    """The models.Model that cfg names, built once per process (a user's block is loaded once)."""
    return network_of(cfg.model, cfg.width, cfg.layers, cfg.d_model, cfg.heads, cfg.patch, cfg.seed)


def policy_of(cfg):
    """The run's precision.Policy (a fresh loss scale)."""
    return Policy(cfg.precision, loss_scale=cfg.loss_scale or config.LOSS_SCALE["loss_scale"],
                  window=cfg.scale_window or config.LOSS_SCALE["scale_window"])


def precise(net, policy):
    """`net` computing in the policy's precision (itself under fp32)."""
    if policy.precision == "fp32":
        return net
    try:
        return Precise(net, policy)
    except ValueError as e:
        raise UsageError(str(e)) from None


def build_model(cfg, params, ctx, world, policy=None):
    """The strategy of cfg.mode on `ctx` for cfg's model in the precision of `policy` (default
    policy_of(cfg)), composed with the world (the cross-process sum and this process's rows), with
    gradient accumulation and fp16's loss scale."""
    policy = policy or policy_of(cfg)
    net = precise(network(cfg), policy)
    refusal = net.tensor_refusal(cfg.tensor_parallel or len(ctx)) if cfg.mode == "tensor" else None
    if refusal:
        raise UsageError(f"--tensor-parallel {refusal}")
    T = mesh_tp(cfg) if cfg.mode == "mesh" else cfg.tensor_parallel or len(ctx)
    refusal = net.sequence_refusal(T, "ring") if cfg.sequence_parallel else None
    if refusal:
        raise UsageError(f"--sequence-parallel: {refusal}")
    refusal = net.sequence_refusal(cfg.context_parallel or len(ctx), cfg.attention) if cfg.mode == "context" else None
    if refusal:
        raise UsageError(f"--mode context: {refusal}")
    if (cfg.stages or 1) * virtual_stages(cfg) > len(net.layers):
        chunks = f" x --virtual-stages {virtual_stages(cfg)}" if virtual_stages(cfg) > 1 else ""
        raise UsageError(f"--stages {cfg.stages}{chunks}: --model {cfg.model} has {len(net.layers)} layers to cut "
                         f"between ({', '.join(layer.name for layer in net.layers)})")
    if cfg.zero_stage and cfg.mode != "zero" and world.size > 1:
        raise UsageError(f"--zero-stage with --mode {cfg.mode} shards over this process's contexts only: not yet "
                         f"across {world.size} processes")
    name = cfg.allreduce or config.FAST_STEP["allreduce"]  # model, pipeline: one replica, nothing to sum here
    if name not in ALLREDUCE_ALGORITHMS:
        raise UsageError(f"--allreduce {name}: choose from {', '.join(ALLREDUCE_ALGORITHMS)}")
    reduce = world.reducer(make_allreduce(name))
    grad_reduce = world.reducer(policy.reducer(make_allreduce(name), name))   # gradients: in the precision
    grad_reduce = policy.rounding(grad_reduce) if world.size > 1 else grad_reduce
    if cfg.mode == "sync":
        pad = world.share(lambda: conv_pad(cfg)) if cfg.graph and cfg.model == "lenet" else 1   # rank 0's
        if cfg.graph and cfg.model == "lenet":
            print(f"cached graph: convolution channels padded to multiples of {pad}" if pad > 1 else
                  "cached graph: convolutions unpadded" + (" (--no-autotune)" if cfg.no_autotune else ""))
        bucket_mb = float("inf") if cfg.trace and cfg.bucket_mb is None else cfg.bucket_mb  # inf: one buffer
        compressed = make_reducer(cfg.compress, reduce, [p.shape for p in params], world)
        model = DeterministicDataParallel(
            params, ctx, cfg.optimizer, graph=cfg.graph, conv_pad=pad, rank=world.rank, size=world.size,
            exchange=lambda table: world.allreduce(table, "tree" + "x".join(map(str, table.shape))), model=net) \
            if cfg.deterministic else \
            DataParallel(params, ctx, cfg.optimizer, compressed or grad_reduce, cfg.fuse_grads, cfg.graph,
                         conv_pad=pad, bucket_mb=bucket_mb, model=net, sync_batchnorm=cfg.sync_batchnorm)
        if cfg.trace:
            model.trace(cfg.trace, algorithm=name)
        model = Compressed(model, compressed, cfg.compress, world) if compressed else model
    elif cfg.mode == "async":
        model = AsyncDataParallel(params, ctx, cfg.optimizer, cfg.staleness, model=net)
    elif cfg.mode == "zero" and cfg.deterministic:   # across processes: a zero-slot table per shard
        model = DeterministicZero(
            params, ctx, cfg.optimizer, cfg.zero_stage,
            conv_pad=world.share(lambda: conv_pad(cfg)) if cfg.model == "lenet" else 1,
            rank=world.rank, size=world.size, exchange=lambda table, i: world.allreduce(
                table, f"zero-tree{i}-" + "x".join(map(str, table.shape))), model=net)
    elif cfg.mode == "zero":    # across processes: the owned gradient shards summed by the engine
        model = ZeroRedundancy(params, ctx, cfg.optimizer, cfg.zero_stage,
                               cross_sum=world.allreduce if world.size > 1 else None, model=net)
    elif cfg.mode == "local":
        model = LocalSGD(params, ctx, cfg.optimizer, cfg.sync_every, cfg.outer_optimizer, cfg.outer_lr,
                         cfg.outer_momentum, reduce, model=net)
    elif cfg.mode == "tensor" and cfg.deterministic:   # every sum in a fixed tree; processes swap subtrees
        model = TensorDeterministic(
            params, ctx, cfg.optimizer, cfg.tensor_parallel, rank=world.rank, size=world.size,
            exchange=lambda table: world.allreduce(table, "tensortree" + "x".join(map(str, table.shape))))
    elif cfg.mode == "tensor":   # f and g inside a group stay in this process; `reduce` sums over groups
        model = TensorParallel(params, ctx, cfg.optimizer, cfg.tensor_parallel, reduce, make_allreduce(name), model=net,
                               sequence_parallel=cfg.sequence_parallel, zero_stage=cfg.zero_stage or 0)
    elif cfg.mode == "mesh":     # tensor groups inside pipelines inside data parallelism
        try:
            model = MeshParallel(params, ctx, cfg.optimizer, cfg.stages or config.STAGES, mesh_tp(cfg),
                                 cfg.micro_batches or 1, cfg.schedule or "gpipe", virtual_stages(cfg), grad_reduce,
                                 make_allreduce(name), model=net, sequence_parallel=cfg.sequence_parallel,
                                 context_parallel=cfg.context_parallel or 1, attention=cfg.attention or "ring",
                                 zero_stage=cfg.zero_stage or 0)
        except ValueError as e:
            raise UsageError(f"--mode mesh: {e}") from None
    elif cfg.mode == "context":  # attention's collectives inside a group; `grad_reduce` sums over all
        model = ContextParallel(params, ctx, cfg.optimizer, cfg.context_parallel, cfg.attention, grad_reduce,
                                make_allreduce(name), model=net, zero_stage=cfg.zero_stage or 0)
    else:
        try:
            model = PipelineParallel(params, ctx, cfg.optimizer, cfg.micro_batches or 1, grad_reduce,
                                     cfg.stages or config.STAGES, cfg.schedule or "gpipe", cfg.recompute, model=net,
                                     virtual_stages=virtual_stages(cfg))
        except ValueError as e:
            raise UsageError(f"--schedule {cfg.schedule}: {e}") from None
    model = world.wrap(model)
    model = GradAccum(model, cfg.grad_accum) if cfg.grad_accum > 1 else model
    model = LossScaled(model, policy.scaler) if policy.scaler else model
    return model.clip(cfg.clip_norm)          # None: the global gradient norm is only logged


def virtual_stages(cfg):
    """Chunks of layers per pipeline context: --virtual-stages, 2 under interleaved by default."""
    return cfg.virtual_stages or (2 if cfg.schedule == "interleaved" else 1)


def dry_run(cfg, ctx, world):
    """--dry-run: the layout and, for a pipeline, its schedule, checked; nothing trained."""
    net = network(cfg)
    build_model(cfg, net.init_params(cfg.seed, cfg.init_scale), ctx, world)     # refuses what cannot run
    print(f"model {net.name}: {net.n_params():,} parameters in {len(net.layers)} layers")
    print(f"mode {describe(cfg)}")
    print("\n".join(Mesh.for_mode(cfg.mode, len(ctx), degree(cfg)).describe(ctx, world.size)))
    if cfg.mode in ("model", "pipeline", "hybrid", "mesh"):
        S = cfg.stages or config.STAGES
        replicas = len(ctx) // (S * (mesh_tp(cfg) * (cfg.context_parallel or 1) if cfg.mode == "mesh" else 1))
        M = min(cfg.micro_batches or 1, cfg.batch_size // (replicas * world.size))
        print(schedules.dry_run(cfg.schedule or "gpipe", S, M, virtual_stages(cfg)))
    print("dry run: nothing trained")
    return []


def degree(cfg):
    """The mode's own dimension: tensor's T, hybrid's S, context's C (None: every context)."""
    return {"tensor": cfg.tensor_parallel, "hybrid": cfg.stages or config.STAGES, "context": cfg.context_parallel,
            "mesh": (cfg.stages or config.STAGES, mesh_tp(cfg), cfg.context_parallel or 1)}.get(cfg.mode)


def mesh_tp(cfg):
    """--mode mesh's tensor degree: --tensor-parallel, else 1 beside --context-parallel, else MESH_TP."""
    return cfg.tensor_parallel or (1 if (cfg.context_parallel or 1) > 1 else config.MESH_TP)


def writable(directory, flag):
    """UsageError unless a file can be created (and removed) in `directory`."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise UsageError(f"{flag}: cannot write in {directory} ({e.strerror})") from None


def check_outputs(cfg):
    """Refuse, before any training, output paths that cannot be written or would clobber each
    other; create the checkpoint directory. A path the system refuses to look at (too long, a
    name it cannot hold) is bad input too."""
    try:
        check_output_paths(cfg)
    except OSError as e:
        raise UsageError(f"an output path cannot be used: {e.strerror} ({str(e.filename)[:60]}...)") from None


def check_output_paths(cfg):
    if cfg.checkpoint_dir:
        d = Path(cfg.checkpoint_dir)
        if d.exists() and not d.is_dir():
            raise UsageError(f"--checkpoint-dir {d} is a file, not a directory")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--checkpoint-dir {d}: cannot create it ({e.strerror})") from None
        writable(d, "--checkpoint-dir")
    files = {flag: Path(path) for flag, path in (("--log-json", cfg.log_json), ("--trace", cfg.trace),
                                                 ("--digests", cfg.digests)) if path}
    seen = {}
    for flag, path in files.items():
        if path.is_dir():
            raise UsageError(f"{flag} {path} is a directory, not a file")
        if not path.parent.is_dir():
            raise UsageError(f"{flag} {path}: the directory {path.parent} does not exist")
        if cfg.checkpoint_dir and path.resolve().parent == Path(cfg.checkpoint_dir).resolve() and (
                path.name in (checkpoint.NAME, checkpoint.LOCK) or path.name.startswith(checkpoint.TMP_PREFIX)):
            raise UsageError(f"{flag} {path} would overwrite the checkpoint's own files")
        if path.resolve() in seen:
            raise UsageError(f"{flag} {path} is also {seen[path.resolve()]}'s file: give each output its own path")
        seen[path.resolve()] = flag
        writable(path.parent, flag)


def save_log(cfg, history):
    """The JSON log, rewritten; OutputError if it cannot be."""
    try:
        write_log(cfg.log_json, history)
    except OSError as e:
        raise OutputError(f"--log-json {cfg.log_json}: could not write it ({e.strerror})") from None


def learning_rate(cfg, n_train):
    """--lr scaled by --scale-lr and ramped by --warmup-epochs: a float or a schedule of the update."""
    return make_lr(cfg.lr, cfg.batch_size * cfg.grad_accum, cfg.scale_lr, cfg.warmup_epochs,
                   updates_per_epoch(n_train, cfg.batch_size, cfg.grad_accum))


def resume_from(cfg, world, model, run_config):
    """(epoch, history, rng state) to continue from: the checkpoint's, loaded into `model`, or a
    fresh start. Rank 0 reads the checkpoint; every rank gets it."""
    saved = world.share(lambda: checkpoint.load(cfg.checkpoint_dir) if cfg.resume and
                        (Path(cfg.checkpoint_dir) / checkpoint.NAME).is_file() else None)
    if not saved:
        if cfg.resume:
            print(f"no checkpoint in {cfg.checkpoint_dir} yet: starting from epoch 1")
        return 0, [], None
    state, meta = saved
    saved_config = dict(config.DEFAULTS_OF_NEWER_KEYS, **meta["config"])    # older checkpoints lack newer keys
    differ = {k: (saved_config.get(k), v) for k, v in run_config.items() if saved_config.get(k) != v}
    if differ:
        raise CheckpointError(f"{cfg.checkpoint_dir} holds a run with other settings: " + ", ".join(
            f"{k} {old!r} there, {new!r} here" for k, (old, new) in differ.items()))
    try:
        model.load_state_dict(state)
    except ValueError as e:
        raise CheckpointError(f"{cfg.checkpoint_dir}: does not fit this run ({e})") from None
    print(f"resumed from {cfg.checkpoint_dir} after epoch {meta['epoch']}")
    return meta["epoch"], meta["history"], meta["rng_state"]


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
        return train_in(cfg, world, ctx)


def train_in(cfg, world, ctx):
    """run_in's training, its outputs checked and its checkpoint directory ours."""
    net = network(cfg)
    params = net.init_params(cfg.seed, cfg.init_scale)
    mem = memcheck.run_report(cfg, params, ctx, build_model, world.size)   # before anything else runs
    data_dir, data_label = locate_data(cfg.data_dir)
    train_data, test_data = load_fashion_mnist(data_dir, cfg.train_size, cfg.test_size)
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
    run_config = {k: getattr(cfg, k) for k in config.RUN_KEYS}
    start_epoch, history, rng_state = resume_from(cfg, world, model, run_config)
    if cfg.digests:                      # after the resume: the file keeps the checkpoint's updates
        digests = DigestFile(cfg.digests, digest_header(cfg, world.size)).resume(model.t) if world.is_root else None
        model = Digested(model, digests)
    if history and cfg.log_json and world.is_root:
        save_log(cfg, history)           # the log matches the checkpoint again, however the last run ended
    rng = np.random.default_rng(cfg.seed)
    if rng_state is not None:
        rng.bit_generator.state = rng_state
    print(f"training on {', '.join(map(str, ctx))}: {len(train_data[0])} train / "
          f"{len(test_data[0])} test images from {data_label}, batch {cfg.batch_size}, "
          f"{cfg.optimizer} lr {cfg.lr}")
    print(f"model {net.name} ({', '.join(f'{k} {v}' for k, v in net.config.items())}): "
          f"{net.n_params():,} parameters in {len(net.layers)} layers")
    print(f"mode {describe(cfg)}; lr {lr}")
    print("\n".join(Mesh.for_mode(cfg.mode, len(ctx), degree(cfg)).describe(ctx, world.size)))
    print(f"memory per context: {memory.format_report(mem)}")
    if policy.precision != "fp32":
        print(f"precision {policy.describe()}")
    show = sys.stderr.isatty() and not cfg.no_progress and world.is_root
    for epoch in range(start_epoch + 1, cfg.epochs + 1):
        bar = Progress(epoch, cfg.epochs, show)
        record, = fit(model, train_data, test_data, epoch, cfg.batch_size, lr, rng,
                      start_epoch=epoch - 1, on_batch=bar, check_replicas=cfg.check_replicas or 0)
        bar.close()
        history.append(dict(record, mode=cfg.mode, memory=mem, model=net.describe()))
        state = model.state_dict() if cfg.checkpoint_dir else None   # every rank: it may gather
        if cfg.checkpoint_dir and world.is_root:
            checkpoint.save(cfg.checkpoint_dir, state,
                            {"epoch": epoch, "history": history, "config": run_config,
                             "rng_state": rng.bit_generator.state, "model": net.describe()})
        if cfg.log_json and world.is_root:
            save_log(cfg, history)
        print(format_record(record, cfg.epochs), flush=True)
    if history:
        total = sum(r["epoch_sec"] for r in history)
        print(f"done: test acc {history[-1]['test_acc']:.4f} after {len(history)} epochs, "
              f"{total:.0f} s training, {np.mean([r['images_per_sec'] for r in history]):.0f} img/s; peak memory "
              + ", ".join(f"{c} {memory.format_bytes(r['peak_bytes'])}" for c, r in mem.items()))
    return history


def give_up(message):
    """The watchdog's verdict: one line, then the process ends at once. Its main thread may be
    waiting inside MXNet's engine for a peer that is gone, where no exception can reach it."""
    sys.stderr.write(f"manual_dp.train: error: {message}\n")
    sys.stderr.flush()
    os._exit(1)


def run(cfg):
    """Train as `cfg` says, printing one line per epoch; returns the history. Errors are raised."""
    with connect(cfg.backend, cfg.timeout, give_up, cfg.flight_record) as world:
        return run_in(cfg, world)


def run_or_exit(cfg):
    """run(cfg); bad input ends with one line and exit status 2, missing or broken data,
    checkpoints, outputs or peers with 1, divergence with 3."""
    try:
        return run(cfg)
    except UsageError as e:
        sys.exit(fail(e, 2))
    except (DataError, CheckpointError, DistributedError, OutputError, ReplicaMismatchError) as e:
        sys.exit(fail(e, 1))
    except DivergedError as e:
        saved = cfg.checkpoint_dir and (Path(cfg.checkpoint_dir) / checkpoint.NAME).is_file()
        kept = " (the checkpoint of the last good epoch is kept)" if saved else ""
        lower = f"a lower --lr than {cfg.lr:g}" + (f" or --outer-lr than {cfg.outer_lr:g}" if cfg.mode == "local" else "")
        sys.exit(fail(f"training diverged at {e}{kept}; try {lower}", 3))
    except KeyboardInterrupt:
        interrupted()
    except Terminated as e:
        interrupted(e.signum)
