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

MODES = ("sync", "async", "model", "pipeline", "hybrid")
OPTIMIZERS = ("sgd", "momentum", "adam")
BACKENDS = ("local", "horovod", "dist_sync", "dist_async")
STAGES = 2                    # LeNet cut in two: convolutions | dense layers
DEFAULT_CPU_CONTEXTS = 2      # contexts when there is no GPU and none are named
FAST_STEP = dict(allreduce="reduce_bcast", fuse_grads=True, graph=True)
LESSON_STEP = dict(allreduce="lesson", fuse_grads=False, graph=False)


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
                             "pipelines", "parallelism", choices=MODES)
    staleness: Optional[int] = flag(None, "async only: replicas refreshed every S+1 updates "
                                          "(default 0)", "parallelism")
    micro_batches: Optional[int] = flag(None, "pipeline and hybrid only: micro-batches per batch and "
                                              "pipeline (default 4)", "parallelism")
    grad_accum: int = flag(1, "batches per update", "parallelism")
    scale_lr: str = flag("none", "linear: lr x batch-size x grad-accum / 256 (Goyal et al.)",
                         "parallelism", choices=("none", "linear"))
    warmup_epochs: float = flag(0.0, "ramp the lr up linearly over this many epochs, per update",
                                "parallelism")
    allreduce: Optional[str] = flag(None, "sync and hybrid: how gradients are summed over the "
                                          "contexts (manual_dp.fast.collectives; default "
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
    compress: str = flag("none", "sync only: what each replica sends instead of its float32 gradient, "
                                 "with error feedback: none, fp16, 2bit[:T] (MXNet's, T=0.5), 1bit, "
                                 "topk:K, powersgd:R (manual_dp/fast/compress.py)", "speed")


# Mode defaults, and the modes each mode-specific flag applies to (given elsewhere: refused).
MODE_DEFAULTS = {"staleness": 0, "micro_batches": 4}
APPLIES = {
    "staleness": ("async",),
    "micro_batches": ("pipeline", "hybrid"),
    "allreduce": ("sync", "hybrid"),
    "fuse_grads": ("sync",),
    "graph": ("sync",),
    "no_autotune": ("sync",),
    "check_replicas": ("sync", "model", "pipeline", "hybrid"),
    "compress": ("sync",),
}
# Settings that must match for --resume to continue the same run.
RUN_KEYS = ("batch_size", "lr", "optimizer", "init_scale", "seed", "train_size", "test_size",
            "mode", "staleness", "micro_batches", "grad_accum", "scale_lr", "warmup_epochs")


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
    for name in ("batch_size", "gpus", "cpus", "train_size", "test_size", "micro_batches", "grad_accum",
                 "check_replicas"):
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
    if not 0 <= cfg.seed < 2 ** 32:
        raise UsageError(f"--seed must be in 0..2**32-1, got {cfg.seed}")
    if cfg.resume and not cfg.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir")
    if cfg.backend in ("horovod", "dist_sync") and cfg.mode == "async":
        raise UsageError(f"--backend {cfg.backend} runs every mode but async (for asynchronous "
                         f"training across processes use --backend dist_async)")
    if cfg.backend == "dist_async" and (cfg.mode != "sync" or cfg.grad_accum > 1):
        raise UsageError("--backend dist_async runs its own asynchronous SGD: --mode sync without "
                         "--grad-accum only")
    check_compress(cfg)


def check_layout(cfg, n_contexts, n_processes=1):
    """Raise UsageError if the mode cannot be laid out on n_contexts contexts per process."""
    n = n_contexts
    if cfg.mode in ("model", "pipeline") and n != STAGES:
        raise UsageError(f"--mode {cfg.mode} needs exactly {STAGES} contexts (convs on the first, dense "
                         f"layers on the second), got {n}: use --cpus {STAGES} or --mode hybrid")
    if cfg.mode == "hybrid" and n % STAGES:
        raise UsageError(f"--mode hybrid needs a multiple of {STAGES} contexts (replicas x {STAGES} "
                         f"stages), got {n}")
    replicas = (n // STAGES if cfg.mode in ("model", "pipeline", "hybrid") else n) * n_processes
    if cfg.batch_size < replicas:
        raise UsageError(f"--batch-size {cfg.batch_size} is smaller than the {replicas} devices it is "
                         f"split over")
    micro = cfg.micro_batches or 1
    if micro > cfg.batch_size // replicas:
        raise UsageError(f"--micro-batches {micro} is larger than the per-device batch of "
                         f"{cfg.batch_size // replicas} (--batch-size {cfg.batch_size} over "
                         f"{replicas} pipeline(s))")


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
