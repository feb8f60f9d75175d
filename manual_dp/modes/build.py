"""How each mode is built: a strategy from the run's settings and the Parts every layout is made of.
The strategies are imported when a build runs (MXNet with them), not when the table is read."""
import importlib
from typing import Callable, NamedTuple

from .layout import context_degree, mesh_tp, stages_of, virtual_stages


class Parts(NamedTuple):
    """What every layout is built from: the initial parameters, this process's contexts, the model
    (in the run's precision), the all-reduces (`reduce` for exact sums, `grad_reduce` for the
    gradients in the precision, `local` the in-process algorithm `algorithm` alone), the precision
    policy, the world, the sums policy (None, or --deterministic's FixedSums) and the padding of
    LeNet's cached graph (1: none), and --compress's reducer (None: none)."""
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
    compressed: object = None
    wire: object = None          # --link's EmulatedLink, for collectives not given as an all-reduce (ZeRO's)


def strategy(module, name):
    """The class `name` of manual_dp.strategies.`module`, imported now (MXNet with it)."""
    return getattr(importlib.import_module(f"..strategies.{module}", __package__), name)


def build_sync(cfg, p):
    if p.sums and (cfg.sequence_pieces or 1) > 1:  # the sequence in pieces: context parallelism's lanes, C = 1
        return build_context(cfg, p)
    compressed = p.compressed
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
            sync_batchnorm=cfg.sync_batchnorm, stats_reduce=p.reduce, sums=p.sums, wire=p.wire)
    return strategy("zero.zero_mixed", "MixedZero")(p.params, p.ctx, cfg.optimizer, cfg.zero_stage,
                                                    cross_sum=cross_sum, model=p.net, precision=p.policy.precision,
                                                    native=p.policy.native, wire=p.wire)   # 16-bit parameters, gradients


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
    # tensor (or context) groups inside pipelines inside data parallelism (sums: tensor groups in Q pieces,
    # or each stage's sequence in K lanes; every stage's leaves in the tree)
    return strategy("mesh.mesh_parallel", "MeshParallel")(
        p.params, p.ctx, cfg.optimizer, stages_of(cfg), mesh_tp(cfg), cfg.micro_batches or 1, cfg.schedule or "gpipe",
        virtual_stages(cfg), p.grad_reduce, p.local, model=p.net, sequence_parallel=cfg.sequence_parallel,
        context_parallel=cfg.context_parallel or 1, attention=cfg.attention or "ring", zero_stage=cfg.zero_stage or 0,
        sums=p.sums, sequence_pieces=cfg.sequence_pieces)


def build_expert(cfg, p):
    # the experts sharded over each group (their all-to-alls inside it); `grad_reduce` sums each copy's gradients
    return strategy("expert.expert_parallel", "ExpertParallel")(p.params, p.ctx, cfg.optimizer, cfg.expert_parallel,
                                                                p.grad_reduce, model=p.net)
