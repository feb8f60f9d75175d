"""The checks of a run's settings that need no device, file or MXNet: values no run can use,
combinations that do not apply, layouts that do not fit the contexts. Each raises UsageError with
one line; the defaults and tables they read are manual_dp.config's."""
import math
import re

from . import datasets, modes, perturb
from .checkpoint_fields import MAX_T as MAX_UPDATES
from .config import COMPRESSORS, GATHERED, MAX_LAYERS, MAX_STAGES, MODELS, SEQUENCE_MODELS, device_request
from .errors import UsageError
from .links import parse_link, parse_straggler


def check(cfg):
    """Raise UsageError for values no run can use (before any device, file or MXNet is touched)."""
    for name in ("batch_size", "gpus", "cpus", "width", "train_size", "test_size", "micro_batches",
                 "grad_accum", "check_replicas", "tensor_parallel", "context_parallel", "virtual_stages",
                 "layers", "d_model", "heads", "tensor_pieces", "sequence_pieces", "seq_len"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("epochs", "staleness"):
        value = getattr(cfg, name)
        if value is not None and value < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    if cfg.precision == "fp16" and "loss_scale" not in modes.of(cfg).flags:
        raise UsageError(f"--precision fp16 needs one reduced gradient per update to unscale and check for "
                         f"overflow: not --mode {cfg.mode} (use bf16, which needs no loss scale)")
    if cfg.precision != "fp32" and cfg.compress != "none":
        raise UsageError(f"--compress sends gradients in fewer bits its own way: not with --precision {cfg.precision}")
    if cfg.scale_window is not None and cfg.scale_window < 1:
        raise UsageError(f"--scale-window must be >= 1, got {cfg.scale_window}")
    if cfg.loss_scale is not None and not (cfg.loss_scale > 0 and math.isfinite(cfg.loss_scale)):
        raise UsageError(f"--loss-scale must be positive and finite, got {cfg.loss_scale}")
    for name in ("lr", "init_scale", "timeout", "clip_norm"):
        value = getattr(cfg, name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise UsageError(f"--{name.replace('_', '-')} must be positive and finite, got {value}")
    if not (cfg.warmup_epochs >= 0 and math.isfinite(cfg.warmup_epochs)):
        raise UsageError(f"--warmup-epochs must be >= 0 and finite, got {cfg.warmup_epochs}")
    if cfg.memory_per_device is not None:
        parse_bytes(cfg.memory_per_device)
    check_model(cfg)
    if cfg.stages is not None and cfg.model == "lenet" and not 1 <= cfg.stages <= MAX_STAGES:
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
    if cfg.perturb is not None:
        perturb.parse(cfg.perturb)
    if cfg.resume and not cfg.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir")
    for name in ("checkpoint_every", "max_steps"):
        if not 0 <= getattr(cfg, name) <= MAX_UPDATES:
            raise UsageError(f"--{name.replace('_', '-')} must be 0 to 2**53 updates, got {getattr(cfg, name)}")
    if (cfg.checkpoint_every or cfg.async_checkpoint) and not cfg.checkpoint_dir:
        raise UsageError("--checkpoint-every and --async-checkpoint need --checkpoint-dir")
    if cfg.deterministic and (cfg.allreduce is not None or cfg.fuse_grads is not None or
                              cfg.bucket_mb is not None or cfg.trace or cfg.compress != "none"):
        raise UsageError("--deterministic adds the gradients in its own fixed order: without "
                         "--allreduce, --fuse-grads, --bucket-mb, --trace and --compress")
    if cfg.tensor_pieces is not None and not cfg.deterministic:
        raise UsageError("--tensor-pieces fixes the order of --deterministic's sums: give --deterministic too")
    if cfg.sequence_pieces is not None and not cfg.deterministic:
        raise UsageError("--sequence-pieces fixes the order of --deterministic's sums: give --deterministic too")
    if cfg.deterministic and cfg.backend == "dist_async":
        raise UsageError("--deterministic needs synchronous updates: --backend local, horovod or dist_sync")
    if cfg.no_autotune and cfg.deterministic:
        raise UsageError("--no-autotune: --deterministic runs the convolutions unpadded already (the kernels "
                         "every layout runs), so there is no padding to turn off")
    if cfg.backend == "dist_async" and (cfg.mode != "sync" or cfg.grad_accum > 1):
        raise UsageError("--backend dist_async runs its own asynchronous SGD: --mode sync without "
                         "--grad-accum only")
    check_local(cfg)
    check_compress(cfg)
    check_links(cfg)
    datasets.check_flags(cfg)


STRAGGLED = ("sync", "async", "local")     # the modes whose strategies give grad_buffers(i)


def check_links(cfg):
    """UsageError for a --link or --straggler no run can use (manual_dp.links), or where it does not apply."""
    kind, n = device_request(cfg)
    if cfg.link is not None:
        parse_link(cfg.link)
        if kind != "cpu":
            raise UsageError(f"--link {cfg.link} emulates links between CPU contexts: GPUs have real ones")
        if ("allreduce" not in modes.of(cfg).flags and cfg.mode != "zero") or cfg.deterministic:
            raise UsageError(f"--link {cfg.link} delays the all-reduces of --allreduce and ZeRO's: not "
                             f"{'--deterministic' if cfg.deterministic else '--mode ' + cfg.mode}")
        if cfg.allreduce == "kvstore":
            raise UsageError("--link: --allreduce kvstore moves its data inside MXNet, where no link can be emulated")
        if cfg.compress.partition(":")[0] in GATHERED:
            raise UsageError(f"--link: --compress {cfg.compress} gathers its payloads by its own copies, which "
                             f"no link delays yet (powersgd's all-reduces are delayed)")
    if cfg.straggler is not None:
        parse_straggler(cfg.straggler, n)
        if cfg.mode not in STRAGGLED or kind != "cpu" or cfg.deterministic:
            raise UsageError(f"--straggler {cfg.straggler} slows one replica of --mode {', '.join(STRAGGLED)} "
                             f"on CPU contexts, without --deterministic")


def check_model(cfg):
    """UsageError for a --model no run can build, or modes that do not apply to it yet."""
    if cfg.model not in MODELS and not re.fullmatch(r".+\.py:[A-Za-z_]\w*", cfg.model):
        raise UsageError(f"--model {cfg.model}: choose {', '.join(MODELS)} or PATH.py:FUNCTION")
    if cfg.layers is not None and cfg.layers > MAX_LAYERS:
        raise UsageError(f"--layers {cfg.layers}: at most {MAX_LAYERS}")
    if cfg.stages is not None and cfg.stages < 1 and cfg.model != "lenet":
        raise UsageError(f"--stages must be >= 1, got {cfg.stages}")
    if cfg.patch is not None and (cfg.patch < 0 or (cfg.patch and 28 % cfg.patch)):
        raise UsageError(f"--patch must be 0 (rows) or divide 28, got {cfg.patch}")
    if cfg.heads and cfg.d_model and cfg.d_model % cfg.heads:
        raise UsageError(f"--heads {cfg.heads} does not divide --d-model {cfg.d_model}")
    check_experts(cfg)
    refusal = modes.of(cfg).refuses(cfg)             # what the mode itself cannot take
    if refusal:
        raise UsageError(refusal)
    if cfg.model == "resnet":
        check_running(cfg, True)
    elif cfg.model in MODELS:                          # a user's block is checked once it is built
        check_running(cfg, False)
    if (cfg.virtual_stages or 1) > 1 and cfg.schedule != "interleaved" and "virtual_stages" in modes.of(cfg).flags:
        raise UsageError(f"--virtual-stages {cfg.virtual_stages} needs --schedule interleaved")
    check_sequence_pieces(cfg)
    if modes.of(cfg).sequence and cfg.model not in SEQUENCE_MODELS:
        raise UsageError(f"--mode mesh (tp x pp) needs layers that split on their own: --model transformer or gpt, "
                         f"not --model {cfg.model}" if modes.of(cfg).stages else
                         f"--mode {cfg.mode} cuts a sequence of tokens over the contexts: --model transformer has "
                         f"one, --model {cfg.model} does not")
    if cfg.deterministic and modes.of(cfg).deterministic:
        raise UsageError(f"--deterministic --mode {cfg.mode}: {modes.of(cfg).deterministic}")


def capacity_factor(text):
    """--capacity-factor as a float > 0, or None for "none" (dropless); UsageError otherwise."""
    if str(text).lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and math.isfinite(value)):
        raise UsageError(f"--capacity-factor must be a positive number or none, got {text}")
    return value


def check_experts(cfg):
    """UsageError for MoE flags (models/moe.py) no run can take, or layouts that would cut a routing
    group or split the experts' weights (--mode expert shards whole experts: modes/refusals.py)."""
    capacity_factor(cfg.capacity_factor)
    if cfg.experts < 0 or (cfg.experts and cfg.top_k > cfg.experts):
        raise UsageError(f"--experts must be >= 0 and at least --top-k {cfg.top_k}, got {cfg.experts}")
    if not (cfg.aux_loss_coef >= 0 and math.isfinite(cfg.aux_loss_coef)):
        raise UsageError(f"--aux-loss-coef must be >= 0 and finite, got {cfg.aux_loss_coef}")
    if cfg.ledger and not cfg.experts:
        raise UsageError("--ledger records an MoE's routing: give --experts too")
    apart = [f for f, on in (("--dropout", cfg.dropout), (f"--backend {cfg.backend}", cfg.backend != "local"),
                             (f"--precision {cfg.precision}", cfg.precision != "fp32"), ("--resume", cfg.resume)) if on]
    if cfg.ledger and apart:
        raise UsageError(f"--ledger recomputes the routing in float32 in this one process, without dropout, from "
                         f"the run's start: not with {apart[0]}")
    if not cfg.experts:
        return
    if cfg.model != "gpt":
        raise UsageError(f"--experts: --model gpt only, not --model {cfg.model}")
    split = [name for name, on in (("--mode tensor", cfg.mode == "tensor"), ("--mode context", cfg.mode == "context"),
                                   ("tp > 1", (cfg.tensor_parallel or 1) > 1), ("cp > 1", (cfg.context_parallel or 1) > 1),
                                   ("--sequence-parallel", cfg.sequence_parallel),
                                   ("--tensor-pieces", (cfg.tensor_pieces or 1) > 1)) if on]
    if split:
        raise UsageError(f"--experts with {split[0]}: an MoE block is routed per whole window and its experts are "
                         f"not split by tensor parallelism; data, ZeRO, pipeline and expert (--mode expert) layouts only")


def check_running(cfg, running):
    """UsageError where --model's running statistics (BatchNorm's; `running`: whether it keeps any)
    meet a mode or flag that does not carry them, or --sync-batchnorm a model without them or
    under --mode async."""
    carried = tuple(name for name, mode in modes.TABLE.items() if not mode.running)
    if running and cfg.deterministic and (cfg.sync_batchnorm or cfg.mode == "tensor" or (cfg.tensor_pieces or 1) > 1):
        raise UsageError(f"--deterministic with BatchNorm (--model {cfg.model}) normalises each piece with its own "
                         f"statistics, carried in its leaf; not " +
                         ("--sync-batchnorm (the batch's statistics would join every piece mid-forward)"
                          if cfg.sync_batchnorm else "--mode tensor or --tensor-pieces yet (a split layer's pieces "
                                                     "do not carry them): --mode sync, zero or a pipeline"))
    if running and cfg.backend == "dist_async" and cfg.sync_batchnorm:
        raise UsageError("--sync-batchnorm: not --backend dist_async, whose servers add each worker's changes and "
                         "sum no batch across workers")
    if running and cfg.mode not in carried:
        raise UsageError(f"--model {cfg.model} keeps BatchNorm's running statistics, which --mode "
                         f"{', '.join(carried[:-1])} and {carried[-1]} carry, not --mode {cfg.mode}: "
                         f"{modes.of(cfg).running}")
    if cfg.sync_batchnorm and not running:
        raise UsageError(f"--sync-batchnorm applies to models with BatchNorm (--model resnet, a Gluon block with "
                         f"BatchNorm children), not --model {cfg.model}")
    if cfg.sync_batchnorm and cfg.mode == "async":
        raise UsageError("--sync-batchnorm: not --mode async, whose replicas are of different ages: statistics "
                         "summed across them are not one batch's")


def check_sequence_pieces(cfg):
    """UsageError where --deterministic's fixed pieces of the sequence (strategies/context/sequence_pieces.py)
    do not reach: models without a sequence (each mode's own limits: its `refuses` in manual_dp/modes/)."""
    K = cfg.sequence_pieces or 1
    if K > 1 and cfg.model not in SEQUENCE_MODELS:
        raise UsageError(f"--sequence-pieces cuts a sequence of tokens: --model transformer and gpt have one, --model "
                         f"{cfg.model} does not")


def check_local(cfg):
    """UsageError for local SGD's values no run can use (the flags' modes are resolve's concern)."""
    if cfg.sync_every is not None and cfg.sync_every < 1:
        raise UsageError(f"--sync-every must be >= 1, got {cfg.sync_every}")
    if cfg.outer_lr is not None and not (cfg.outer_lr > 0 and math.isfinite(cfg.outer_lr)):
        raise UsageError(f"--outer-lr must be positive and finite, got {cfg.outer_lr}")
    if cfg.outer_momentum is not None and not 0 <= cfg.outer_momentum < 1:
        raise UsageError(f"--outer-momentum must be in [0, 1), got {cfg.outer_momentum}")
    if cfg.mode == "local" and cfg.outer_momentum is not None and cfg.outer_optimizer != "nesterov":
        raise UsageError("--outer-momentum applies only to --outer-optimizer nesterov")   # as given, before resolve


def check_layout(cfg, n_contexts, n_processes=1):
    """Raise UsageError if the mode cannot be laid out on n_contexts contexts per process: its own
    refusals (its entry's `fits`), then what every mode needs."""
    n = n_contexts
    modes.of(cfg).fits(cfg, n)
    replicas = modes.of(cfg).replicas(cfg, n) * n_processes
    if cfg.batch_size < replicas:
        raise UsageError(f"--batch-size {cfg.batch_size} is smaller than the {replicas} devices it is "
                         f"split over")
    micro = cfg.micro_batches or 1
    if micro > cfg.batch_size // replicas:
        raise UsageError(f"--micro-batches {micro} is larger than the per-device batch of "
                         f"{cfg.batch_size // replicas} (--batch-size {cfg.batch_size} over "
                         f"{replicas} pipeline(s))")
    if (cfg.tensor_pieces or 1) > 1 and cfg.model == "lenet":
        for what, size in modes.tensor_split_sizes(cfg.width).items():
            if size % cfg.tensor_pieces:
                raise UsageError(f"--tensor-pieces {cfg.tensor_pieces} does not divide {what} ({size} at "
                                 f"--width {cfg.width})")


BYTE_UNITS = {"": 1, "B": 1, "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12, "KB": 10 ** 3,
              "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30,
              "TIB": 2 ** 40}


def parse_bytes(text):
    """Bytes of "300MiB", "1.5G", "4096" (K, M, G, T: powers of 1000; KiB, MiB, GiB, TiB: of 1024),
    for --memory-per-device here and in the planner; UsageError otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    value = float(match.group(1)) * BYTE_UNITS[match.group(2).upper()] \
        if match and match.group(2).upper() in BYTE_UNITS else 0
    if not (value >= 1 and math.isfinite(value)):
        raise UsageError(f"--memory-per-device must be a byte count such as 300MiB, 2G or 1048576 "
                         f"(K, M, G: powers of 1000; KiB, MiB, GiB: of 1024), got {text!r}")
    return int(value)
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
    if cfg.bucket_mb is not None or cfg.trace:
        raise UsageError(f"--compress {cfg.compress} compresses the one fused gradient buffer: not with "
                         f"{'--bucket-mb' if cfg.bucket_mb is not None else '--trace'} (which cut it into buckets)")
    if cfg.backend == "dist_async":
        raise UsageError(f"--compress applies to summed gradients, not to --backend dist_async's "
                         f"parameter changes")
    if name in GATHERED and cfg.allreduce is not None:
        raise UsageError(f"--compress {name} gathers the compressed gradients instead of all-reducing "
                         f"them: --allreduce does not apply (it does with powersgd:R)")

