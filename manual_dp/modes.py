"""The one table of modes: each `--mode` is one entry that says which flags apply to it, how it is
built, what it refuses and why, how its header line reads, and how it is laid out as a mesh. The
command line's checks (checks.py), its build (cli/build.py), its output (cli/output.py), the memory
probe and the planner read this table instead of branching on the mode's name.

Nothing here loads MXNet at import: the strategies are imported when an entry builds one (the
command line reads its flags before MXNet loads). A build takes the run's settings and `Parts`,
what every layout is made from, among them `sums`: --deterministic's policy (strategies/sums/), read
once for every layout (None: each layout's fast sums).
"""
import dataclasses
import importlib
from dataclasses import dataclass
from typing import Callable, NamedTuple

from .config import (DEFAULT_ONLY_IN, FAST_STEP, LOSS_SCALE, MESH_TP, MODE_DEFAULTS, MODEL_APPLIES, MODELS,
                     SEQUENCE_PIECES, STAGES, TENSOR_PIECES, MODEL_SIZES, fields)
from .errors import UsageError
from .mesh import Mesh

PIPELINE_FLAGS = ("stages", "schedule", "virtual_stages", "micro_batches")
SHARDED = {1: "optimiser state", 2: "optimiser state and gradients", 3: "optimiser state, gradients and parameters"}
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B", "zb-h1": "ZB-H1"}


class Parts(NamedTuple):
    """What every layout is built from: the initial parameters, this process's contexts, the model
    (in the run's precision), the all-reduces (`reduce` for exact sums, `grad_reduce` for the
    gradients in the precision, `local` the in-process algorithm `algorithm` alone), the precision
    policy, the world, the sums policy (None, or --deterministic's FixedSums) and the padding of
    LeNet's cached graph (1: none)."""
    params: list
    ctx: list
    net: object
    reduce: Callable
    grad_reduce: Callable
    local: Callable
    algorithm: str
    policy: object
    world: object
    sums: object
    pad: int = 1


def strategy(module, name):
    """The class `name` of manual_dp.strategies.`module`, imported now (MXNet with it)."""
    return getattr(importlib.import_module(f".strategies.{module}", __package__), name)


def stages_of(cfg):
    return cfg.stages or STAGES


def virtual_stages(cfg):
    """Chunks of layers per pipeline context: --virtual-stages, 2 under interleaved by default."""
    return cfg.virtual_stages or (2 if cfg.schedule == "interleaved" else 1)


def mesh_tp(cfg):
    """--mode mesh's tensor degree: --tensor-parallel, else 1 beside --context-parallel, else MESH_TP."""
    return cfg.tensor_parallel or (1 if (cfg.context_parallel or 1) > 1 else MESH_TP)


def context_degree(cfg, n_contexts):
    """--mode context's C: --context-parallel, else every context a tensor group leaves."""
    return cfg.context_parallel or max(n_contexts // (cfg.tensor_parallel or 1), 1)


# ---- how each mode is built -------------------------------------------------------------------

def build_sync(cfg, p):
    if p.sums and (cfg.sequence_pieces or 1) > 1:  # the sequence in pieces: context parallelism's lanes, C = 1
        return build_context(cfg, p)
    from .fast.compress import make_reducer
    compressed = make_reducer(cfg.compress, p.reduce, [w.shape for w in p.params], p.world)
    bucket_mb = float("inf") if cfg.trace and cfg.bucket_mb is None else cfg.bucket_mb   # inf: one buffer
    model = strategy("data.data_parallel", "DataParallel")(
        p.params, p.ctx, cfg.optimizer, compressed or p.grad_reduce, cfg.fuse_grads, cfg.graph, conv_pad=p.pad,
        bucket_mb=bucket_mb, model=p.net, sync_batchnorm=cfg.sync_batchnorm, stats_reduce=p.reduce, sums=p.sums)
    if cfg.trace:
        model.trace(cfg.trace, algorithm=p.algorithm)
    return strategy("wrappers.compressed", "Compressed")(model, compressed, cfg.compress, p.world) \
        if compressed else model


def build_async(cfg, p):
    return strategy("data.async_dp", "AsyncDataParallel")(p.params, p.ctx, cfg.optimizer, cfg.staleness, model=p.net)


def build_local(cfg, p):
    return strategy("data.local_sgd", "LocalSGD")(p.params, p.ctx, cfg.optimizer, cfg.sync_every, cfg.outer_optimizer,
                                                  cfg.outer_lr, cfg.outer_momentum, p.reduce, model=p.net)


def build_zero(cfg, p):
    world = p.world
    cross_sum = world.allreduce if world.size > 1 else None   # the owned gradient shards summed by the engine
    if p.policy.precision == "fp32" or p.sums:      # sums: the fixed tree (across processes a table per shard)
        return strategy("zero.zero", "ZeroRedundancy")(
            p.params, p.ctx, cfg.optimizer, cfg.zero_stage, cross_sum=cross_sum, model=p.net,
            sync_batchnorm=cfg.sync_batchnorm, stats_reduce=p.reduce, sums=p.sums)
    return strategy("zero.zero_mixed", "MixedZero")(p.params, p.ctx, cfg.optimizer, cfg.zero_stage,
                                                    cross_sum=cross_sum, model=p.net, precision=p.policy.precision,
                                                    native=p.policy.native)   # 16-bit parameters and gradients


def build_pipeline(cfg, p):
    return strategy("pipeline.pipeline", "PipelineParallel")(
        p.params, p.ctx, cfg.optimizer, cfg.micro_batches or 1, p.grad_reduce, stages_of(cfg),
        cfg.schedule or "gpipe", cfg.recompute, model=p.net, virtual_stages=virtual_stages(cfg), sums=p.sums)


def build_tensor(cfg, p):
    # f and g inside a group stay in this process; `reduce` sums over groups (sums: trees, swapped subtrees)
    return strategy("tensor.tensor", "TensorParallel")(
        p.params, p.ctx, cfg.optimizer, cfg.tensor_parallel, p.reduce, p.local, model=p.net,
        sequence_parallel=cfg.sequence_parallel, zero_stage=cfg.zero_stage or 0, sums=p.sums,
        sequence_pieces=cfg.sequence_pieces)


def build_context(cfg, p):
    C = context_degree(cfg, len(p.ctx)) if cfg.mode == "context" else 1
    T = (cfg.tensor_parallel or 1) if cfg.mode == "context" else 1
    if ((cfg.tensor_pieces or 1) > 1 if p.sums else T > 1):   # a grid of cp x tp per replica (sums: Q pieces)
        return strategy("context.context_tensor", "ContextTensorParallel")(
            p.params, p.ctx, cfg.optimizer, C, T, cfg.attention or "ring", p.grad_reduce, p.local, model=p.net,
            zero_stage=cfg.zero_stage or 0, sums=p.sums, sequence_pieces=cfg.sequence_pieces)
    # attention's collectives inside a group; `grad_reduce` sums over all (sums: K lanes, fixed trees)
    return strategy("context.context", "ContextParallel")(
        p.params, p.ctx, cfg.optimizer, C, cfg.attention or "ring", p.grad_reduce, p.local, model=p.net,
        zero_stage=cfg.zero_stage or 0, sums=p.sums, sequence_pieces=cfg.sequence_pieces)


def build_mesh(cfg, p):
    S, M, schedule, V = stages_of(cfg), cfg.micro_batches or 1, cfg.schedule or "gpipe", virtual_stages(cfg)
    if p.sums and (cfg.context_parallel or 1) > 1:  # lanes in each stage
        return strategy("mesh.mesh_lanes", "MeshLanes")(
            p.params, p.ctx, cfg.optimizer, S, cfg.context_parallel, M, schedule, V, cfg.attention or "ring",
            cfg.sequence_pieces, p.sums, p.net)
    if p.sums:                                      # tensor groups in Q pieces; every stage's leaves in the tree
        return strategy("mesh.mesh_deterministic", "MeshDeterministic")(
            p.params, p.ctx, cfg.optimizer, S, mesh_tp(cfg), M, schedule, V, sums=p.sums, model=p.net)
    # tensor groups inside pipelines inside data parallelism
    return strategy("mesh.mesh_parallel", "MeshParallel")(
        p.params, p.ctx, cfg.optimizer, S, mesh_tp(cfg), M, schedule, V, p.grad_reduce, p.local, model=p.net,
        sequence_parallel=cfg.sequence_parallel, context_parallel=cfg.context_parallel or 1,
        attention=cfg.attention or "ring", zero_stage=cfg.zero_stage or 0)


# ---- how each mode's header line reads --------------------------------------------------------

def schedule_name(cfg):
    return SCHEDULE_NAMES.get(cfg.schedule, "GPipe")


def describe_sync(cfg):
    if cfg.deterministic:
        return ("sync, deterministic: pieces of the batch added in one fixed tree, the same bits on any "
                "number of contexts and processes")
    return (f"sync: replicas in lock-step, gradients all-reduced ({cfg.allreduce}"
            f"{', fused' if cfg.fuse_grads else ''}{', cached graph' if cfg.graph and not cfg.sync_batchnorm else ''}"
            f"{f', buckets of {cfg.bucket_mb:g} MB overlapping backward' if cfg.bucket_mb is not None else ''})")


def describe_zero(cfg):
    sharded = SHARDED.get(cfg.zero_stage, "")
    if cfg.deterministic:
        return (f"zero, deterministic: ZeRO stage {cfg.zero_stage}, pieces of the batch added in one fixed tree, "
                "each shard's sum on its context, the same bits on any number of contexts and processes")
    return (f"zero: ZeRO stage {cfg.zero_stage}, {sharded} sharded over the contexts"
            + (f", {cfg.precision} parameters and gradients kept, float32 master weights beside the optimiser "
               f"state (strategies/zero/zero_mixed.py)" if cfg.precision != "fp32" else ""))


def describe_local(cfg):
    return (f"local: replicas step alone, every {cfg.sync_every} steps their average change is applied by outer "
            f"{cfg.outer_optimizer} lr {cfg.outer_lr}"
            + (f" momentum {cfg.outer_momentum}" if cfg.outer_optimizer == "nesterov" else "") + f" ({cfg.allreduce})")


PIPELINE_DETERMINISTIC = (", deterministic: each stage's gradients per piece of the batch, added in the fixed tree "
                          "of --deterministic --mode sync: its bits on any cut, schedule and replica count")


def describe_model(cfg):
    line = "model: convs on the first context, dense layers on the second" if stages_of(cfg) == 2 \
        else "model: one stage per context"
    return line + (PIPELINE_DETERMINISTIC if cfg.deterministic else "")


def describe_pipeline(cfg):
    return (f"pipeline: model split, {cfg.micro_batches} micro-batches on {schedule_name(cfg)}'s schedule"
            + (PIPELINE_DETERMINISTIC if cfg.deterministic else ""))


def describe_hybrid(cfg):
    return (f"hybrid: data parallel over {stages_of(cfg)}-stage pipelines, {cfg.micro_batches} micro-batches "
            f"each ({'the fixed tree' if cfg.deterministic else cfg.allreduce})"
            + (PIPELINE_DETERMINISTIC if cfg.deterministic else ""))


def describe_tensor(cfg):
    if not cfg.deterministic:
        return (f"tensor: layers split over {cfg.tensor_parallel or 'all'} context(s) per tensor group (Megatron's "
                f"f and g, {cfg.allreduce}), groups data parallel")
    return (f"tensor, deterministic: layers split over {cfg.tensor_parallel or 'all'} context(s) per tensor group "
            f"in {cfg.tensor_pieces} fixed pieces, pieces of the batch and of the split layers added in fixed trees: "
            f"the bits of every layout given --tensor-pieces {cfg.tensor_pieces}"
            + (f" --sequence-pieces {cfg.sequence_pieces}: the sequence parallel regions in {cfg.sequence_pieces} "
               f"fixed pieces of the sequence, each on one context, their layer norms' gradients added in the tree"
               if cfg.sequence_parallel else ""))


def describe_context(cfg):
    if not cfg.deterministic:
        return (f"context: every sequence cut over {cfg.context_parallel or 'all'} context(s) per group, "
                f"{cfg.attention} attention between the blocks, groups data parallel ({cfg.allreduce})")
    tp = (cfg.tensor_parallel or 1) > 1
    return (f"context, deterministic: every sequence in {cfg.sequence_pieces} fixed pieces over "
            f"{cfg.context_parallel or 'all'} context(s) per group, {cfg.attention} attention folding them in "
            + (f"one order, each piece's split layers in {cfg.tensor_pieces} fixed pieces over "
               f"{cfg.tensor_parallel} tensor context(s), " if tp else "one order, ")
            + f"their sums and the batch's pieces added in fixed trees: the bits of every layout given "
            f"--sequence-pieces {cfg.sequence_pieces}" + (f" --tensor-pieces {cfg.tensor_pieces}" if tp else ""))


def describe_mesh(cfg):
    S = stages_of(cfg)
    if not cfg.deterministic:
        return (f"mesh: {S}-stage pipelines of {cfg.tensor_parallel or 2}-context tensor groups, {cfg.micro_batches} "
                f"micro-batches on {schedule_name(cfg)}'s schedule, pipelines data parallel ({cfg.allreduce})")
    if (cfg.context_parallel or 1) > 1:
        return (f"mesh, deterministic: {S}-stage pipelines of {cfg.context_parallel}-context context-parallel "
                f"groups, every sequence in {cfg.sequence_pieces} fixed pieces ({cfg.attention} attention folding "
                f"them in one order), {cfg.micro_batches} micro-batches of whole batch pieces on {schedule_name(cfg)}'s "
                f"schedule, each stage's gradients per piece added in the fixed trees: the bits of every layout "
                f"given --sequence-pieces {cfg.sequence_pieces}")
    return (f"mesh, deterministic: {S}-stage pipelines of {cfg.tensor_parallel or 2}-context tensor groups, every "
            f"split layer in {cfg.tensor_pieces} fixed pieces, {cfg.micro_batches} micro-batches of whole batch "
            f"pieces on {schedule_name(cfg)}'s schedule, each stage's gradients per piece added in the fixed tree: "
            f"the bits of every layout given --tensor-pieces {cfg.tensor_pieces}")


# ---- how each mode is laid out ----------------------------------------------------------------

def every_context_a_replica(cfg, n):
    return n


def one_replica_per_pipeline(cfg, n):
    return n // stages_of(cfg)


def mesh_replicas(cfg, n):
    return n // (stages_of(cfg) * mesh_group(cfg))


def mesh_group(cfg):
    """The contexts of one --mode mesh stage: C x T with --context-parallel, else its tensor group."""
    C = cfg.context_parallel or 1
    return C * (cfg.tensor_parallel or 1) if C > 1 else cfg.tensor_parallel or MESH_TP


def data_grid(cfg, n):
    return {"dp": n}


def pipeline_grid(cfg, n):
    return {"pp": n}


def hybrid_grid(cfg, n):
    return {"dp": n // stages_of(cfg), "pp": stages_of(cfg)}


def tensor_grid(cfg, n):
    T = cfg.tensor_parallel or n
    return {"dp": n // T, "tp": T}


def context_grid(cfg, n):
    C, T = context_degree(cfg, n), cfg.tensor_parallel or 1
    return {"dp": n // (C * T), "cp": C, "tp": T}


def mesh_grid(cfg, n):
    S, T, C = stages_of(cfg), mesh_tp(cfg), cfg.context_parallel or 1
    return {"dp": n // (S * T * C), "pp": S, "cp": C, "tp": T}


def grid_of(cfg, n):
    """The mesh (manual_dp.mesh.Mesh) cfg's mode lays its n contexts out as."""
    return Mesh(**of(cfg).grid(cfg, n))


# ---- what each mode's layout refuses ----------------------------------------------------------

def fits_anywhere(cfg, n):
    """No refusal: every context count lays the mode out."""


def fits_pipeline(cfg, n):
    """UsageError unless there is exactly one context per stage."""
    S = stages_of(cfg)
    if n != S:
        raise UsageError(f"--mode {cfg.mode} needs exactly {S} contexts (one per stage of --stages {S}), "
                         f"got {n}: use --cpus {S} or --mode hybrid")


def fits_hybrid(cfg, n):
    """UsageError unless the stages divide the contexts into pipelines."""
    if n % stages_of(cfg):
        raise UsageError(f"--mode hybrid needs a multiple of {stages_of(cfg)} contexts (replicas x "
                         f"{stages_of(cfg)} stages), got {n}")


def fits_tensor(cfg, n):
    """UsageError unless the tensor groups divide the contexts and, under --deterministic, the pieces."""
    T = cfg.tensor_parallel or n
    if cfg.model == "lenet" or n % T:
        check_tensor_layout(T, n, cfg.width)            # other models: Model.tensor_refusal
    if cfg.deterministic and cfg.sequence_parallel and (cfg.sequence_pieces or 1) % T:
        raise UsageError(f"--deterministic --sequence-parallel cuts the sequence into {cfg.sequence_pieces or 1} "
                         f"pieces: --tensor-parallel {T} does not divide them (give --sequence-pieces a multiple "
                         f"of it)")
    if cfg.deterministic:
        check_tensor_pieces(cfg.tensor_pieces, T, cfg.mode)


def fits_context(cfg, n):
    """UsageError unless cp x tp groups divide the contexts and, under --deterministic, the pieces."""
    tp = cfg.tensor_parallel or 1
    cp = cfg.context_parallel or max(n // tp, 1)
    if n % (cp * tp):
        raise UsageError(f"--context-parallel {cp}" + (f" x --tensor-parallel {tp}" if tp > 1 else "")
                         + f" does not divide the {n} contexts into groups")
    if cfg.deterministic and (cfg.sequence_pieces or 1) % cp:
        raise UsageError(f"--deterministic --mode context cuts the sequence into {cfg.sequence_pieces or 1} pieces: "
                         f"--context-parallel {cp} does not divide them (give --sequence-pieces a multiple of {cp})")
    if cfg.deterministic and tp > 1:
        check_tensor_pieces(cfg.tensor_pieces or 1, cfg.tensor_parallel, cfg.mode)


def fits_mesh(cfg, n):
    """UsageError unless pipelines of stage groups divide the contexts and, under --deterministic, the pieces."""
    S, C, T = stages_of(cfg), cfg.context_parallel or 1, mesh_group(cfg)
    if n % (S * T):
        group = "--tensor-parallel" if C == 1 else "--context-parallel" if T == C else \
            "--context-parallel x --tensor-parallel"
        raise UsageError(f"--mode mesh needs a multiple of --stages {S} x {group} {T} contexts, got {n}")
    if cfg.deterministic and (cfg.sequence_pieces or 1) % C:
        raise UsageError(f"--deterministic --mode mesh cuts the sequence into {cfg.sequence_pieces} pieces: "
                         f"--context-parallel {cfg.context_parallel} does not divide them (give --sequence-pieces "
                         f"a multiple of {cfg.context_parallel})")
    if cfg.deterministic:
        check_tensor_pieces(cfg.tensor_pieces, mesh_tp(cfg), cfg.mode)


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


def check_tensor_pieces(Q, T, mode="tensor"):
    """Raise UsageError unless T divides --deterministic's Q pieces of every split layer."""
    if Q % T:
        fits = [t for t in range(1, Q + 1) if Q % t == 0]
        raise UsageError(f"--deterministic --mode {mode} cuts every split layer into {Q} pieces "
                         f"(--tensor-pieces): --tensor-parallel {T} does not divide them (use "
                         f"{' or '.join(map(str, fits))}, or give --tensor-pieces a multiple of {T})")


@dataclass(frozen=True)
class Mode:
    """One --mode: `flags` the mode-specific flags that apply to it; `build(cfg, parts)` its strategy;
    `describe(cfg)` its header line; `replicas(cfg, n)` the data-parallel replicas of n contexts;
    `grid(cfg, n)` the mesh it lays n contexts out as ({dimension: size}); `shapes` the sets of
    dimensions besides dp of the --mesh shapes it lays out; `fits(cfg, n)` raises UsageError where
    n contexts cannot be laid out so (before any device is touched); `stages` whether
    it cuts the model in pipeline stages; `sequence` whether it needs a model with a sequence of
    tokens; `splits` whether it splits layers or the sequence itself (its line names the pieces); `deterministic` and `running` why --deterministic, or a model with BatchNorm's running
    statistics, is refused ("" where they are not); `refused(cfg)` what a one-line refusal of a layout
    the build cannot make (a ValueError) starts with (None: the error is no user's)."""
    name: str
    summary: str
    strategy: str
    flags: tuple
    build: Callable
    describe: Callable
    replicas: Callable = every_context_a_replica
    grid: Callable = data_grid
    shapes: tuple = (frozenset(),)
    fits: Callable = fits_anywhere
    stages: bool = False
    sequence: bool = False
    deterministic: str = ""
    running: str = ""
    splits: bool = False
    refused: Callable = lambda cfg: None


PP, CP, TP = frozenset({"pp"}), frozenset({"cp"}), frozenset({"tp"})     # --mesh shapes besides dp
DATA_FLAGS = ("precision", "check_replicas", "deterministic")
SUMMED = ("clip_norm", "loss_scale", "scale_window", "tensor_pieces")     # one reduced gradient per update

TABLE = {m.name: m for m in (
    Mode("sync", "replicas in lock-step, gradients all-reduced", "DataParallel",
         DATA_FLAGS + SUMMED + ("allreduce", "fuse_grads", "graph", "no_autotune", "sync_batchnorm", "sequence_pieces",
                                "bucket_mb", "trace", "compress"),
         build_sync, describe_sync,
         refused=lambda cfg: f"--deterministic --sequence-pieces {cfg.sequence_pieces}: " if cfg.deterministic else None),
    Mode("async", "a master copy on the first context, replicas refreshed every S+1 updates", "AsyncDataParallel",
         ("precision", "deterministic", "staleness"), build_async, lambda cfg: (
             f"async: master on the first context, replicas up to {cfg.staleness} updates stale"),
         deterministic="stale replicas compute other gradients than one context by design; use --mode sync"),
    Mode("model", "the model's stages on consecutive contexts, the activation copied by hand", "PipelineParallel",
         DATA_FLAGS + SUMMED + ("stages", "recompute"), build_pipeline, describe_model,
         one_replica_per_pipeline, pipeline_grid, (PP,), fits_pipeline, stages=True,
         refused=lambda cfg: f"--schedule {cfg.schedule}: "),
    Mode("pipeline", "model + micro-batches on GPipe, 1F1B, interleaved or ZB-H1", "PipelineParallel",
         DATA_FLAGS + SUMMED + PIPELINE_FLAGS + ("recompute",), build_pipeline, describe_pipeline,
         one_replica_per_pipeline, pipeline_grid, (PP,), fits_pipeline, stages=True,
         refused=lambda cfg: f"--schedule {cfg.schedule}: "),
    Mode("hybrid", "data parallel over pipelines", "PipelineParallel",
         DATA_FLAGS + SUMMED + PIPELINE_FLAGS + ("recompute", "allreduce"), build_pipeline, describe_hybrid,
         one_replica_per_pipeline, hybrid_grid, (PP,), fits_hybrid, stages=True,
         refused=lambda cfg: f"--schedule {cfg.schedule}: "),
    Mode("zero", "data parallel with ZeRO's sharding (--zero-stage 1-3)", "ZeroRedundancy, MixedZero",
         DATA_FLAGS + SUMMED + ("sync_batchnorm", "zero_stage"), build_zero, describe_zero),
    Mode("local", "local SGD / DiLoCo: replicas meet every --sync-every steps", "LocalSGD",
         ("precision", "check_replicas", "deterministic", "allreduce", "sync_every", "outer_optimizer", "outer_lr",
          "outer_momentum"), build_local, describe_local,
         deterministic="local SGD averages the replicas' parameters, not their gradients, so its rounding differs "
                       "from one context's even at --sync-every 1; use --mode sync"),
    Mode("tensor", "Megatron's split layers (--sequence-parallel: Megatron-SP), groups data parallel",
         "TensorParallel", DATA_FLAGS + SUMMED + ("allreduce", "zero_stage", "tensor_parallel", "sequence_parallel",
                                                 "sequence_pieces"),
         build_tensor, describe_tensor, grid=tensor_grid, shapes=(TP,), fits=fits_tensor, splits=True,
         refused=lambda cfg: "--deterministic --sequence-parallel: " if cfg.deterministic and cfg.sequence_parallel
         else None),
    Mode("context", "the sequence cut over a group: ring or Ulysses attention", "ContextParallel",
         DATA_FLAGS + SUMMED + ("allreduce", "zero_stage", "tensor_parallel", "context_parallel", "attention",
                                "sequence_pieces"),
         build_context, describe_context, grid=context_grid, shapes=(CP, CP | TP), fits=fits_context, sequence=True,
         splits=True,
         running="it cuts a sequence of tokens, which only the transformer (no BatchNorm) has",
         refused=lambda cfg: f"--deterministic --sequence-pieces {cfg.sequence_pieces}: " if cfg.deterministic
         else "" if (cfg.tensor_parallel or 1) > 1 else None),
    Mode("mesh", "data x pipeline x tensor (or context) at once", "MeshParallel",
         DATA_FLAGS + SUMMED + PIPELINE_FLAGS + ("allreduce", "zero_stage", "tensor_parallel", "sequence_parallel",
                                                 "context_parallel", "attention", "sequence_pieces"),
         build_mesh, describe_mesh, mesh_replicas, mesh_grid, (PP | TP, PP | CP, PP | CP | TP), fits_mesh,
         stages=True, sequence=True, splits=True,
         running="it lays out the transformer, whose blocks have no BatchNorm",
         refused=lambda cfg: "--deterministic --mode mesh: " if cfg.deterministic else "--mode mesh: "),
)}
MODES = tuple(TABLE)


FLAGS = tuple(dict.fromkeys(f for mode in TABLE.values() for f in mode.flags))   # every mode-specific flag
MESH_FLAGS = {"pp": "stages", "cp": "context_parallel", "tp": "tensor_parallel"}   # --mesh's sizes as flags


def mode_of(mesh, given="sync"):
    """(mode, {flag: value}) that lay `mesh` out: the table's modes of its shape, `given` (the
    --mode given with it: sync by default) if it is one of them, else the first (a pipeline of one
    replica is --mode pipeline, of several hybrid); ValueError (one line) otherwise."""
    used = frozenset(d for d in mesh.used() if d != "dp")
    shaped = [name for name, mode in TABLE.items() if used in mode.shapes
              and (not used == PP or (name == "hybrid") == (mesh.dp > 1))]
    if not used and given not in shaped:
        raise ValueError(f"--mesh {mesh} is data parallel only: --mode {given} lays out more")
    if not shaped:
        raise ValueError(f"--mesh {mesh}: no mode lays out {' x '.join(sorted(used))}")
    want = given if given in shaped else "pipeline" if "pipeline" in shaped else shaped[0]
    if given not in ("sync", want):
        raise ValueError(f"--mesh {mesh} is --mode {want}, not --mode {given}")
    return want, {MESH_FLAGS[d]: getattr(mesh, d) for d in sorted(used)}


def applies(flag):
    """The modes the mode-specific `flag` applies to, in the table's order."""
    return tuple(name for name, mode in TABLE.items() if flag in mode.flags)


def resolve(cfg):
    """`cfg` with every None that the mode decides filled in; refuses flags the mode ignores (each
    mode's `flags` in the table)."""
    values, defaults = {}, {f.name: f.default for f in fields()}
    for name, modes in ((flag, applies(flag)) for flag in FLAGS):
        given = getattr(cfg, name)
        if given != defaults[name] and cfg.mode not in modes:
            raise UsageError(f"--{name.replace('_', '-')} applies only to --mode "
                             f"{' or '.join(modes)}, not --mode {cfg.mode}")
        default = MODE_DEFAULTS.get(name, FAST_STEP.get(name, defaults[name]))
        default = default if cfg.mode in DEFAULT_ONLY_IN.get(name, modes) else None
        values[name] = given if given is not None else default
    if not cfg.deterministic:                                # --tensor-pieces orders --deterministic's sums only
        values["tensor_pieces"] = values["sequence_pieces"] = None
    elif cfg.mode == "context" and (cfg.tensor_parallel or 1) > 1 and cfg.tensor_pieces is None:
        values["tensor_pieces"] = TENSOR_PIECES             # cp x tp: split layers in pieces, as --mode tensor's
    elif cfg.mode == "tensor" and cfg.sequence_parallel and cfg.sequence_pieces is None:
        values["sequence_pieces"] = SEQUENCE_PIECES         # Megatron-SP: the sequence in pieces, as --mode context's
    elif cfg.mode == "mesh" and (cfg.context_parallel or 1) > 1:   # lanes in a pipeline: split layers whole
        values["tensor_pieces"] = cfg.tensor_pieces or 1
        values["sequence_pieces"] = cfg.sequence_pieces or SEQUENCE_PIECES
    for name, default in LOSS_SCALE.items():                 # fp16's loss scale, and only fp16's
        given = getattr(cfg, name)
        if given is not None and cfg.precision != "fp16":
            raise UsageError(f"--{name.replace('_', '-')} applies only to --precision fp16 (bf16 and fp32 "
                             f"need no loss scale)")
        if cfg.precision == "fp16" and cfg.mode in applies(name):
            values[name] = given if given is not None else default
    kind = cfg.model if cfg.model in MODELS else "PATH.py:FUNCTION"
    for name, models in MODEL_APPLIES.items():
        given = getattr(cfg, name)
        if given != defaults[name] and kind not in models:
            raise UsageError(f"--{name.replace('_', '-')} applies only to --model {' or '.join(models)}, "
                             f"not --model {cfg.model}")
        if given is None and kind in models:
            values[name] = MODEL_SIZES[kind][name]
    return dataclasses.replace(cfg, **values)


def of(cfg):
    """cfg's entry of the table."""
    return TABLE[cfg.mode]


def as_mode(cfg, name):
    """cfg in mode `name` (its mode-specific flags back to their defaults), for the memory probe."""
    return dataclasses.replace(cfg, mode=name)


def fixed_sums(cfg, world):
    """--deterministic's FixedSums for this process of the job (None without it): its subtrees swapped
    with the other processes' by the job's all-reduce. The one place --deterministic is read."""
    if not cfg.deterministic:
        return None
    from .strategies.sums.fixed_sums import FixedSums
    return FixedSums(rank=world.rank, size=world.size, tensor_pieces=cfg.tensor_pieces or 1,
                     exchange=lambda table, key: world.allreduce(table, key + "x".join(map(str, table.shape))))

