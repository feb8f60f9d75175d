"""Every default of a training run, in one place: RunConfig, from which the command line is built.

The notebooks, the benchmark and the tests read their defaults here too. Nothing here imports
MXNet: the command line reads its flags before MXNet loads (manual_dp.fast.runtime).
"""
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from .errors import UsageError
from .fast.runtime import visible_gpus

MODES = ("sync", "async", "model", "pipeline", "hybrid", "zero", "local", "tensor")
OPTIMIZERS = ("sgd", "momentum", "adam")
BACKENDS = ("local", "horovod", "dist_sync", "dist_async")
STAGES = 2                    # LeNet cut in two by default: convolutions | dense layers
MAX_STAGES = 4                # its layers: conv1 | conv2 | dense1 | dense2 (strategies/stages.py CUTS)
DEFAULT_CPU_CONTEXTS = 2      # contexts when there is no GPU and none are named
FAST_STEP = dict(allreduce="reduce_bcast", fuse_grads=True, graph=True)
LESSON_STEP = dict(allreduce="lesson", fuse_grads=False, graph=False)
PIECE_ROWS = 32               # --deterministic: rows per piece, the unit whose gradient is computed whole


def flag(default, help, group="training", **argparse):
    """A RunConfig field: its default, its --help text, its group in --help, argparse extras."""
    return field(default=default, metadata=dict(help=help, group=group, argparse=argparse))


@dataclass
class RunConfig:
    """One training run. A field `name` is the flag `--name`; None means "decided by the mode"."""
    gpus: Optional[int] = flag(None, "train on gpu(0..N-1) (default: every GPU, else 2 CPU contexts)",
                               "devices")
    cpus: Optional[int] = flag(None, "train on cpu(0..N-1)", "devices")
    epochs: int = flag(10, "passes over the training set")
    batch_size: int = flag(256, "global batch, split over the contexts")
    lr: float = flag(0.05, "learning rate")
    optimizer: str = flag("momentum", "update rule (momentum: SGD with momentum 0.9)",
                          choices=OPTIMIZERS)
    init_scale: Optional[float] = flag(None, "std of normal(0, s) weights; default He init; "
                                             "0.01 is the lesson's")
    seed: int = flag(0, "seeds the initial weights and the data order")
    width: int = flag(1, "multiply LeNet's channels and hidden units (20, 50, 128) by W: parameters, "
                         "gradients, optimiser state and activations grow (W=16: 32.6M parameters)")
    deterministic: bool = flag(False, "the same bits on any number of contexts and processes: every "
                                      f"batch cut into pieces of {PIECE_ROWS} rows whose gradients are "
                                      "added in one fixed tree; one thread per op "
                                      "(manual_dp/strategies/deterministic.py)")
    check_replicas: Optional[int] = flag(None, "every N updates, compare checksums of every copy of the "
                                               "parameters (contexts, stages, processes); stop at the first "
                                               "difference")
    data_dir: Optional[str] = flag(None, "directory with the four Fashion-MNIST IDX .gz files "
                                         "(default: $MANUAL_DP_DATA, then Debian's package, then "
                                         "MXNet's cache)", "data and outputs")
    train_size: Optional[int] = flag(None, "use only the first N training examples", "data and outputs")
    test_size: Optional[int] = flag(None, "use only the first N test examples", "data and outputs")
    log_json: Optional[str] = flag(None, "write one JSON object per epoch to this file", "data and outputs")
    checkpoint_dir: Optional[str] = flag(None, "save a checkpoint here at the end of every epoch",
                                         "data and outputs")
    resume: bool = flag(False, "continue from --checkpoint-dir", "data and outputs")
    no_progress: bool = flag(False, "no progress bar, even on a terminal", "data and outputs")
    mode: str = flag("sync", "sync: data parallel; async: parameter server with stale replicas; "
                             "model: convs on one context, dense layers on the next; pipeline: "
                             "model + GPipe micro-batches; hybrid: data parallel over 2-context "
                             "pipelines; zero: data parallel with ZeRO's sharding (--zero-stage); "
                             "local: local SGD / DiLoCo, replicas meet every --sync-every steps",
                "parallelism", choices=MODES)
    staleness: Optional[int] = flag(None, "async only: replicas refreshed every S+1 updates "
                                          "(default 0)", "parallelism")
    micro_batches: Optional[int] = flag(None, "pipeline and hybrid only: micro-batches per batch and "
                                              "pipeline (default 4)", "parallelism")
    zero_stage: Optional[int] = flag(None, "zero only: ZeRO shards over the contexts 1: the optimiser state, "
                                           "2: also the gradients, 3: also the parameters (default 1)",
                                     "parallelism", choices=(1, 2, 3))
    grad_accum: int = flag(1, "batches per update", "parallelism")
    scale_lr: str = flag("none", "linear: lr x batch-size x grad-accum / 256 (Goyal et al.)",
                         "parallelism", choices=("none", "linear"))
    warmup_epochs: float = flag(0.0, "ramp the lr up linearly over this many epochs, per update",
                                "parallelism")
    allreduce: Optional[str] = flag(None, "sync, hybrid and local: how gradients (local: parameters) are "
                                          "summed over the contexts (manual_dp.fast.collectives; default "
                                          f"{FAST_STEP['allreduce']})", "speed")
    fuse_grads: Optional[bool] = flag(None, "sync only: one flat gradient buffer per device, one "
                                            "all-reduce and one optimiser update a step (default on)",
                                      "speed")
    graph: Optional[bool] = flag(None, "sync only: LeNet as a cached symbolic graph instead of layer "
                                       "by layer (default on)", "speed")
    no_autotune: bool = flag(False, "sync only: do not measure which padding of the convolutions' "
                                    "channels is fastest on this CPU (manual_dp/fast/autotune.py); use "
                                    "none ($MANUAL_DP_CONV_PAD names one)", "speed")
    backend: str = flag("local", "local: this process alone; horovod: under horovodrun; dist_sync, "
                                 "dist_async: MXNet's parameter-server KVStore under python -m "
                                 "manual_dp.launch", "more than one process (see docs/multi-machine.md)",
                        choices=BACKENDS)
    timeout: float = flag(120.0, "seconds without progress after which a process of a multi-process "
                                 "job gives up", "more than one process (see docs/multi-machine.md)")
    memory_per_device: Optional[str] = flag(None, "emulate devices of this many bytes (suffix K, M, G, T: "
                                                  "powers of 1024): refuse, before training, a layout whose "
                                                  "measured peak on a context exceeds it, and name the modes "
                                                  "that fit (manual_dp/memory.py)", "parallelism")
    sync_every: Optional[int] = flag(None, "local only: inner optimiser steps each replica takes on its own "
                                           "shards between syncs (H; default 4)", "parallelism")
    outer_optimizer: Optional[str] = flag(None, "local only: what applies the averaged change at a sync "
                                                "(default sgd; nesterov as in DiLoCo)", "parallelism",
                                          choices=("sgd", "nesterov"))
    outer_lr: Optional[float] = flag(None, "local only: the outer optimiser's learning rate (default 1: "
                                           "sgd then averages the replicas)", "parallelism")
    outer_momentum: Optional[float] = flag(None, "local with --outer-optimizer nesterov only: its momentum "
                                                 "(default 0.9)", "parallelism")
    stages: Optional[int] = flag(None, "model, pipeline and hybrid: LeNet cut into S stages, one context "
                                       "each: 2 convs | dense, 3 conv1 | conv2 | dense, 4 conv1 | conv2 | "
                                       "dense1 | dense2 (default 2)", "parallelism")
    schedule: Optional[str] = flag(None, "pipeline and hybrid: gpipe (every forward, then every backward) "
                                         "or 1f1b (one forward, one backward: stage s holds at most S - s "
                                         "micro-batches) (default gpipe)", "parallelism",
                                   choices=("gpipe", "1f1b"))
    recompute: bool = flag(False, "model, pipeline and hybrid: keep only each stage's input per "
                                  "micro-batch, recompute its activations in the backward (less memory, "
                                  "more time)", "parallelism")
    bucket_mb: Optional[float] = flag(None, "sync only: gradients in buckets of this many MB, last layer "
                                            "first, each all-reduced as soon as backward has written it "
                                            "(0: one per parameter; default: one fused buffer)", "speed")
    trace: Optional[str] = flag(None, "sync only: record a few steps (MXNet's profiler and the "
                                      "trainer's spans) as a Chrome trace to this file; draw it with "
                                      "python -m manual_dp.timeline", "data and outputs")
    tensor_parallel: Optional[int] = flag(None, "tensor only: contexts per tensor group, each holding a "
                                                "1/T shard of every split layer; the groups are data "
                                                "parallel (default: every context, one group)",
                                          "parallelism")
    compress: str = flag("none", "sync only: what each replica sends instead of its float32 gradient, "
                                 "with error feedback: none, fp16, 2bit[:T] (MXNet's, T=0.5), 1bit, "
                                 "topk:K, powersgd:R (manual_dp/fast/compress.py)", "speed")


# Mode defaults, and the modes each mode-specific flag applies to (given elsewhere: refused).
MODE_DEFAULTS = {"staleness": 0, "micro_batches": 4, "stages": STAGES, "schedule": "gpipe", "zero_stage": 1,
                 "sync_every": 4, "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.9}
APPLIES = {
    "staleness": ("async",),
    "micro_batches": ("pipeline", "hybrid"),
    "allreduce": ("sync", "hybrid", "local", "tensor"),
    "fuse_grads": ("sync",),
    "graph": ("sync",),
    "no_autotune": ("sync",),
    "deterministic": ("sync",),
    "check_replicas": ("sync", "model", "pipeline", "hybrid", "zero", "local", "tensor"),
    "zero_stage": ("zero",),
    "sync_every": ("local",),
    "outer_optimizer": ("local",),
    "outer_lr": ("local",),
    "outer_momentum": ("local",),
    "stages": ("model", "pipeline", "hybrid"),
    "schedule": ("pipeline", "hybrid"),
    "recompute": ("model", "pipeline", "hybrid"),
    "bucket_mb": ("sync",),
    "trace": ("sync",),
    "tensor_parallel": ("tensor",),
    "compress": ("sync",),
}
# Settings that must match for --resume to continue the same run.
RUN_KEYS = ("batch_size", "lr", "optimizer", "init_scale", "seed", "width", "train_size", "test_size",
            "mode", "staleness", "micro_batches", "grad_accum", "scale_lr", "warmup_epochs",
            "sync_every", "outer_optimizer", "outer_lr", "outer_momentum", "compress")

# Keys added to RUN_KEYS after checkpoints were written without them: their value in those runs.
DEFAULTS_OF_NEWER_KEYS = {"width": 1, "sync_every": None, "outer_optimizer": None, "outer_lr": None,
                          "outer_momentum": None, "compress": "none"}


def resolve(cfg):
    """`cfg` with every None that the mode decides filled in; refuses flags the mode ignores."""
    values, defaults = {}, {f.name: f.default for f in fields()}
    for name, modes in APPLIES.items():
        given = getattr(cfg, name)
        if given != defaults[name] and cfg.mode not in modes:
            raise UsageError(f"--{name.replace('_', '-')} applies only to --mode "
                             f"{' or '.join(modes)}, not --mode {cfg.mode}")
        default = MODE_DEFAULTS.get(name, FAST_STEP.get(name, defaults[name]))
        values[name] = given if given is not None else (default if cfg.mode in modes else None)
    return dataclasses.replace(cfg, **values)


def check(cfg):
    """Raise UsageError for values no run can use (before any device, file or MXNet is touched)."""
    for name in ("batch_size", "gpus", "cpus", "width", "train_size", "test_size", "micro_batches",
                 "grad_accum", "check_replicas", "tensor_parallel"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("epochs", "staleness"):
        value = getattr(cfg, name)
        if value is not None and value < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    for name in ("lr", "init_scale", "timeout"):
        value = getattr(cfg, name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise UsageError(f"--{name.replace('_', '-')} must be positive and finite, got {value}")
    if not (cfg.warmup_epochs >= 0 and math.isfinite(cfg.warmup_epochs)):
        raise UsageError(f"--warmup-epochs must be >= 0 and finite, got {cfg.warmup_epochs}")
    if cfg.memory_per_device is not None:
        parse_bytes(cfg.memory_per_device)
    if cfg.stages is not None and not 1 <= cfg.stages <= MAX_STAGES:
        raise UsageError(f"--stages must be 1 to {MAX_STAGES} (LeNet has {MAX_STAGES} layers to cut "
                         f"between), got {cfg.stages}")
    if cfg.bucket_mb is not None and not (cfg.bucket_mb >= 0 and math.isfinite(cfg.bucket_mb)):
        raise UsageError(f"--bucket-mb must be >= 0 and finite, got {cfg.bucket_mb}")
    if (cfg.bucket_mb is not None or cfg.trace) and cfg.fuse_grads is False:
        raise UsageError("--bucket-mb and --trace cut the fused gradient buffer into buckets: not with "
                         "--no-fuse-grads")
    if cfg.trace and cfg.backend != "local":
        raise UsageError("--trace records the steps of one process: --backend local only")
    if not 0 <= cfg.seed < 2 ** 32:
        raise UsageError(f"--seed must be in 0..2**32-1, got {cfg.seed}")
    if cfg.resume and not cfg.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir")
    if cfg.backend in ("horovod", "dist_sync") and cfg.mode == "async":
        raise UsageError(f"--backend {cfg.backend} runs every mode but async (for asynchronous "
                         f"training across processes use --backend dist_async)")
    if cfg.deterministic and (cfg.allreduce is not None or cfg.fuse_grads is not None or
                              cfg.bucket_mb is not None or cfg.trace or cfg.compress != "none"):
        raise UsageError("--deterministic adds the gradients in its own fixed order: without "
                         "--allreduce, --fuse-grads, --bucket-mb, --trace and --compress")
    if cfg.deterministic and cfg.backend == "dist_async":
        raise UsageError("--deterministic needs synchronous updates: --backend local, horovod or dist_sync")
    if cfg.backend == "dist_async" and (cfg.mode != "sync" or cfg.grad_accum > 1):
        raise UsageError("--backend dist_async runs its own asynchronous SGD: --mode sync without "
                         "--grad-accum only")
    check_local(cfg)
    check_compress(cfg)


def check_local(cfg):
    """UsageError for local SGD's values no run can use (the flags' modes are resolve's concern)."""
    if cfg.sync_every is not None and cfg.sync_every < 1:
        raise UsageError(f"--sync-every must be >= 1, got {cfg.sync_every}")
    if cfg.outer_lr is not None and not (cfg.outer_lr > 0 and math.isfinite(cfg.outer_lr)):
        raise UsageError(f"--outer-lr must be positive and finite, got {cfg.outer_lr}")
    if cfg.outer_momentum is not None and not 0 <= cfg.outer_momentum < 1:
        raise UsageError(f"--outer-momentum must be in [0, 1), got {cfg.outer_momentum}")
    if cfg.mode == "local" and cfg.outer_momentum is not None and cfg.outer_optimizer != "nesterov":
        raise UsageError("--outer-momentum applies only to --outer-optimizer nesterov")


def check_layout(cfg, n_contexts, n_processes=1):
    """Raise UsageError if the mode cannot be laid out on n_contexts contexts per process."""
    n, S = n_contexts, cfg.stages or STAGES
    if cfg.mode in ("model", "pipeline") and n != S:
        raise UsageError(f"--mode {cfg.mode} needs exactly {S} contexts (one per stage of --stages {S}), "
                         f"got {n}: use --cpus {S} or --mode hybrid")
    if cfg.mode == "hybrid" and n % S:
        raise UsageError(f"--mode hybrid needs a multiple of {S} contexts (replicas x {S} "
                         f"stages), got {n}")
    replicas = (n // S if cfg.mode in ("model", "pipeline", "hybrid") else n) * n_processes
    if cfg.batch_size < replicas:
        raise UsageError(f"--batch-size {cfg.batch_size} is smaller than the {replicas} devices it is "
                         f"split over")
    micro = cfg.micro_batches or 1
    if micro > cfg.batch_size // replicas:
        raise UsageError(f"--micro-batches {micro} is larger than the per-device batch of "
                         f"{cfg.batch_size // replicas} (--batch-size {cfg.batch_size} over "
                         f"{replicas} pipeline(s))")
    if cfg.mode == "tensor":
        check_tensor_layout(cfg.tensor_parallel or n, n, cfg.width)


def tensor_split_sizes(width):
    """{what --mode tensor splits: its size} for LeNet of `width` (lesson.lenet_shapes; conv2's
    input channels are conv1's outputs, the second dense layer's inputs the first's units)."""
    return {"conv1's output channels": 20 * width, "the first dense layer's units": 128 * width}


def check_tensor_layout(T, n, width):
    """Raise UsageError unless T contexts per tensor group divide the n contexts and every split size."""
    if n % T:
        raise UsageError(f"--tensor-parallel {T} does not divide the {n} contexts into tensor groups")
    sizes = tensor_split_sizes(width)
    for what, size in sizes.items():
        if size % T:
            fits = [t for t in range(1, n + 1) if n % t == 0 and all(s % t == 0 for s in sizes.values())]
            raise UsageError(f"--tensor-parallel {T} does not divide {what} ({size} at --width {width}): "
                             f"use --tensor-parallel {' or '.join(map(str, fits))} on {n} contexts")


def fields():
    """RunConfig's fields, in the order --help lists them."""
    return dataclasses.fields(RunConfig)


def device_request(cfg):
    """("gpu", n) or ("cpu", n): the devices --gpus/--cpus name; by default every GPU that MXNet
    will see, else DEFAULT_CPU_CONTEXTS CPU contexts. Decided without loading MXNet."""
    if cfg.gpus is not None:
        return "gpu", cfg.gpus
    if cfg.cpus is not None:
        return "cpu", cfg.cpus
    n = visible_gpus()
    return ("gpu", n) if n else ("cpu", DEFAULT_CPU_CONTEXTS)


BYTE_SUFFIXES = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def parse_bytes(text):
    """A positive byte count from "1000", "64M", "2G", "1.5GiB" (K, M, G, T: powers of 1024);
    UsageError otherwise."""
    s = str(text).strip().upper().removesuffix("B").removesuffix("I")
    number, suffix = (s[:-1], s[-1]) if s[-1:] in BYTE_SUFFIXES and s[-1:] else (s, "")
    try:
        value = float(number) * BYTE_SUFFIXES[suffix]
    except ValueError:
        value = None
    if value is None or not (value >= 1 and math.isfinite(value)):
        raise UsageError(f"--memory-per-device must be a byte count such as 64M or 2G, got {text!r}")
    return int(value)
# --compress: name -> (what its argument is, its default; None: no argument, required: must be given)
COMPRESSORS = {"none": None, "fp16": None, "2bit": (float, 0.5), "1bit": None,
               "topk": (int, "required"), "powersgd": (int, "required")}
GATHERED = ("fp16", "2bit", "1bit", "topk")     # cannot be summed compressed: gathered instead


def parse_compress(spec):
    """(name, argument or None) of a --compress value; UsageError if it names nothing we have."""
    name, _, arg = spec.partition(":")
    if name not in COMPRESSORS:
        raise UsageError(f"--compress {spec}: choose from none, fp16, 2bit[:T], 1bit, topk:K, powersgd:R")
    kind = COMPRESSORS[name]
    if kind is None:
        if arg:
            raise UsageError(f"--compress {name} takes no argument, got {spec}")
        return name, None
    if not arg and kind[1] == "required":
        raise UsageError(f"--compress {name} needs its argument: {name}:{'K' if name == 'topk' else 'R'}")
    try:
        value = kind[0](arg) if arg else kind[1]
    except ValueError:
        raise UsageError(f"--compress {spec}: {arg!r} is not a{'n integer' if kind[0] is int else ' number'}") from None
    if not (value > 0 and math.isfinite(value)):
        raise UsageError(f"--compress {spec}: the argument must be positive, got {arg}")
    return name, value


def check_compress(cfg):
    """UsageError for a --compress value or combination no run can use."""
    name, _ = parse_compress(cfg.compress)
    if name == "none":
        return
    if cfg.fuse_grads is False:
        raise UsageError(f"--compress {cfg.compress} compresses the fused gradient buffer: drop --no-fuse-grads")
    if cfg.backend == "dist_async":
        raise UsageError(f"--compress applies to summed gradients, not to --backend dist_async's "
                         f"parameter changes")
    if name in GATHERED and cfg.allreduce is not None:
        raise UsageError(f"--compress {name} gathers the compressed gradients instead of all-reducing "
                         f"them: --allreduce does not apply (it does with powersgd:R)")
