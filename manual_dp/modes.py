"""The trainer's parallelism modes: checks of their flags, and the strategy each one builds."""
from .accum import GradAccum, SyncPhases
from .async_dp import AsyncDataParallel
from .cli import UsageError
from .collectives import make_allreduce
from .pipeline import PipelineParallel
from .schedule import make_lr, updates_per_epoch
from .stages import STAGES
from .step import DataParallel

DEFAULT_MICRO_BATCHES = 4   # the --micro-batches default of pipeline and hybrid


def micro_batches(args):
    if args.mode in ("pipeline", "hybrid"):
        return args.micro_batches or DEFAULT_MICRO_BATCHES
    return 1


def check(args, ctx):
    """Raise UsageError for mode settings this run cannot use on these contexts."""
    n, stages = len(ctx), len(STAGES)
    if args.staleness and args.mode != "async":
        raise UsageError(f"--staleness applies only to --mode async, not --mode {args.mode}")
    if args.micro_batches is not None and args.mode not in ("pipeline", "hybrid"):
        raise UsageError(f"--micro-batches applies only to --mode pipeline or hybrid, not {args.mode}")
    for flag, value, low in (("staleness", args.staleness, 0), ("micro-batches", args.micro_batches, 1),
                             ("grad-accum", args.grad_accum, 1), ("warmup-epochs", args.warmup_epochs, 0)):
        if value is not None and not value >= low:
            raise UsageError(f"--{flag} must be >= {low}, got {value}")
    if args.mode in ("model", "pipeline") and n != stages:
        raise UsageError(f"--mode {args.mode} needs exactly {stages} contexts (convs on the first, dense "
                         f"layers on the second), got {n}: use --cpus {stages} or --mode hybrid")
    if args.mode == "hybrid" and n % stages:
        raise UsageError(f"--mode hybrid needs a multiple of {stages} contexts (replicas x {stages} "
                         f"stages), got {n}")
    replicas = n // stages if args.mode in ("model", "pipeline", "hybrid") else n
    per_replica = args.batch_size // replicas
    if micro_batches(args) > per_replica:
        raise UsageError(f"--micro-batches {micro_batches(args)} is larger than the per-device batch of "
                         f"{per_replica} (--batch-size {args.batch_size} over {replicas} pipeline(s))")


def build(args, params, ctx):
    """The strategy object for args.mode (see manual_dp.step.DataParallel for the interface)."""
    reduce = make_allreduce(getattr(args, "allreduce", "lesson"))   # sync and hybrid all-reduce
    if args.mode == "sync":
        model = DataParallel(params, ctx, args.optimizer, reduce, fuse_grads=getattr(args, "fuse_grads", False),
                             graph=getattr(args, "graph", False)) if args.grad_accum == 1 else \
            SyncPhases(params, ctx, args.optimizer, allreduce_fn=reduce)
    elif args.mode == "async":
        model = AsyncDataParallel(params, ctx, args.optimizer, args.staleness)
    else:
        model = PipelineParallel(params, ctx, args.optimizer, micro_batches(args), allreduce_fn=reduce)
    return GradAccum(model, args.grad_accum) if args.grad_accum > 1 else model


def learning_rate(args, n_train):
    """--lr scaled by --scale-lr and ramped by --warmup-epochs: a float or a schedule of the update."""
    return make_lr(args.lr, args.batch_size * args.grad_accum, args.scale_lr, args.warmup_epochs,
                   updates_per_epoch(n_train, args.batch_size, args.grad_accum))


def describe(args):
    """One line on what the mode does with these settings."""
    return {"sync": "sync: replicas in lock-step, gradients all-reduced",
            "async": f"async: master on the first context, replicas up to {args.staleness} updates stale",
            "model": "model: convs on the first context, dense layers on the second",
            "pipeline": f"pipeline: model split, {micro_batches(args)} GPipe micro-batches",
            "hybrid": f"hybrid: data parallel over 2-stage pipelines, {micro_batches(args)} micro-batches each",
            }[args.mode] + (f", {args.grad_accum} batches per update" if args.grad_accum > 1 else "")


def format_extras(record):
    """What the mode measured this epoch, for the per-epoch line."""
    parts = []
    if "staleness_mean" in record:
        parts.append(f"staleness {record['staleness_mean']:.2f} (max {record['staleness_max']})")
    if "bubble_fraction" in record:
        parts.append(f"bubble {record['bubble_fraction']:.2f}")
    return "  " + "  ".join(parts) if parts else ""
