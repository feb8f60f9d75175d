"""What a run is made of, from its RunConfig: this process's contexts, the network, the precision,
the strategy of its mode composed with the world (build_model), the learning rate, and --dry-run's
report. manual_dp.cli.run trains with them; the memory probe and the replay build the same."""
import functools

import mxnet as mx

from .. import checks, config
from ..errors import UsageError
from ..fast import autotune
from ..fast.collectives import ALLREDUCE_ALGORITHMS, make_allreduce
from ..fast.compress import make_reducer
from ..mesh import Mesh
from ..models import build as build_network
from ..models.dropout import Noise
from ..models.precise import Precise
from ..precision import Policy
from ..schedule import make_lr, updates_per_epoch
from ..strategies.pipeline import schedules
from ..strategies.wrappers.accum import GradAccum
from ..strategies.data.async_dp import AsyncDataParallel
from ..strategies.base import innermost
from ..strategies.wrappers.compressed import Compressed
from ..strategies.context.context import ContextParallel
from ..strategies.context.context_deterministic import ContextDeterministic
from ..strategies.context.grid_deterministic import GridDeterministic
from ..strategies.mesh.mesh_lanes import MeshLanes
from ..strategies.tensor.sequence_deterministic import SequenceParallelDeterministic
from ..strategies.context.context_tensor import ContextTensorParallel
from ..strategies.data.data_parallel import DataParallel
from ..strategies.data.deterministic import DeterministicDataParallel
from ..strategies.sums.fixed_sums import FixedSums
from ..strategies.data.local_sgd import LocalSGD
from ..strategies.wrappers.loss_scaled import LossScaled
from ..strategies.mesh.mesh_deterministic import MeshDeterministic
from ..strategies.mesh.mesh_parallel import MeshParallel
from ..strategies.pipeline.pipeline import PipelineParallel
from ..strategies.pipeline.stage_costs import priced_lines, relative
from ..strategies.pipeline.stage_times import stage_times
from ..strategies.tensor.tensor import TensorParallel
from ..strategies.tensor.tensor_deterministic import TensorDeterministic
from ..strategies.zero.zero import ZeroRedundancy
from ..strategies.zero.zero_deterministic import DeterministicZero
from ..strategies.zero.zero_mixed import MixedZero
from .output import describe


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


def graph_pad(cfg, world):
    """The padding of the convolutions of the cached graph this run builds (rank 0's choice), or
    None if it pads none: LeNet's sync step with its graph (--deterministic runs it unpadded)."""
    if cfg.model == "lenet" and cfg.mode == "sync" and cfg.graph and not cfg.deterministic:
        return world.share(lambda: conv_pad(cfg))
    return None


@functools.lru_cache(maxsize=4)
def network_of(model, width, layers, d_model, heads, patch, seed, dropout=0.0):
    try:
        net = build_network(model, width, layers, d_model, heads, patch, seed)
        if dropout:
            net.drop(Noise(dropout, seed))
        return net
    except ValueError as e:
        raise UsageError(f"--model {model}: {e}") from None


def network(cfg):
    """The models.Model that cfg names, built once per process (a user's block is loaded once), with
    cfg's dropout."""
    return network_of(cfg.model, cfg.width, cfg.layers, cfg.d_model, cfg.heads, cfg.patch, cfg.seed, cfg.dropout)


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
    net = network(cfg)
    if cfg.model not in config.MODELS:                # a user's block: its BatchNorms are known now
        checks.check_running(cfg, bool(net.stats()))
    net = precise(net, policy)
    refusal = net.tensor_refusal(cfg.tensor_parallel or len(ctx)) if cfg.mode == "tensor" else None
    if refusal:
        raise UsageError(f"--tensor-parallel {refusal}")
    refusal = net.tensor_refusal(cfg.tensor_pieces) if (cfg.tensor_pieces or 1) > 1 else None
    if refusal:
        raise UsageError(f"--tensor-pieces {refusal}")
    if (cfg.tensor_pieces or 1) > 1 and cfg.mode in ("model", "pipeline", "hybrid") and not net.splits_by_layer():
        raise UsageError(f"--tensor-pieces {cfg.tensor_pieces} in a pipeline needs a model whose layers split one "
                         f"by one (the transformer, the MLP's pairs do not): --model {cfg.model} splits as a whole")
    T = mesh_tp(cfg) if cfg.mode == "mesh" else cfg.tensor_parallel or len(ctx)
    refusal = net.sequence_refusal(T, "ring") if cfg.sequence_parallel else None
    if refusal:
        raise UsageError(f"--sequence-parallel: {refusal}")
    refusal = net.sequence_refusal(context_degree(cfg, len(ctx)), cfg.attention) if cfg.mode == "context" else None
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
    if cfg.deterministic and (cfg.mode == "context" or (cfg.mode == "sync" and (cfg.sequence_pieces or 1) > 1)):
        try:
            C = context_degree(cfg, len(ctx)) if cfg.mode == "context" else 1
            T = (cfg.tensor_parallel or 1) if cfg.mode == "context" else 1
            model = GridDeterministic(params, ctx, cfg.optimizer, C, T, cfg.attention or "ring", cfg.sequence_pieces,
                                      cfg.tensor_pieces, fixed_sums(cfg, world), net) \
                if (cfg.tensor_pieces or 1) > 1 else \
                ContextDeterministic(params, ctx, cfg.optimizer, C, cfg.attention or "ring", cfg.sequence_pieces,
                                     sums=fixed_sums(cfg, world), model=net)
        except ValueError as e:
            raise UsageError(f"--deterministic --sequence-pieces {cfg.sequence_pieces}: {e}") from None
    elif cfg.mode == "sync":
        pad = graph_pad(cfg, world)                                              # rank 0's
        if pad is not None:
            print(f"cached graph: convolution channels padded to multiples of {pad}" if pad > 1 else
                  "cached graph: convolutions unpadded" + (" (--no-autotune)" if cfg.no_autotune else ""))
        pad = pad or 1
        bucket_mb = float("inf") if cfg.trace and cfg.bucket_mb is None else cfg.bucket_mb  # inf: one buffer
        compressed = make_reducer(cfg.compress, reduce, [p.shape for p in params], world)
        sums = fixed_sums(cfg, world)
        model = DeterministicDataParallel(params, ctx, cfg.optimizer, graph=cfg.graph, rank=world.rank,
                                          size=world.size, exchange=sums and sums.exchange, model=net,
                                          tensor_pieces=sums and sums.tensor_pieces) \
            if cfg.deterministic else \
            DataParallel(params, ctx, cfg.optimizer, compressed or grad_reduce, cfg.fuse_grads, cfg.graph,
                         conv_pad=pad, bucket_mb=bucket_mb, model=net, sync_batchnorm=cfg.sync_batchnorm,
                         stats_reduce=reduce)
        if cfg.trace:
            model.trace(cfg.trace, algorithm=name)
        model = Compressed(model, compressed, cfg.compress, world) if compressed else model
    elif cfg.mode == "async":
        model = AsyncDataParallel(params, ctx, cfg.optimizer, cfg.staleness, model=net)
    elif cfg.mode == "zero" and cfg.deterministic:   # across processes: a zero-slot table per shard
        model = DeterministicZero(
            params, ctx, cfg.optimizer, cfg.zero_stage,
            rank=world.rank, size=world.size, exchange=lambda table, i: world.allreduce(
                table, f"zero-tree{i}-" + "x".join(map(str, table.shape))), model=net,
            tensor_pieces=cfg.tensor_pieces or 1)
    elif cfg.mode == "zero":    # across processes: the owned gradient shards summed by the engine
        cross_sum = world.allreduce if world.size > 1 else None
        model = ZeroRedundancy(params, ctx, cfg.optimizer, cfg.zero_stage, cross_sum=cross_sum, model=net,
                               sync_batchnorm=cfg.sync_batchnorm, stats_reduce=reduce) \
            if policy.precision == "fp32" else \
            MixedZero(params, ctx, cfg.optimizer, cfg.zero_stage, cross_sum=cross_sum, model=net,
                      precision=policy.precision, native=policy.native)   # 16-bit parameters and gradients
    elif cfg.mode == "local":
        model = LocalSGD(params, ctx, cfg.optimizer, cfg.sync_every, cfg.outer_optimizer, cfg.outer_lr,
                         cfg.outer_momentum, reduce, model=net)
    elif cfg.mode == "tensor" and cfg.deterministic and cfg.sequence_parallel:   # Megatron-SP in the lanes' trees
        try:
            model = SequenceParallelDeterministic(params, ctx, cfg.optimizer, cfg.tensor_parallel, cfg.sequence_pieces,
                                                  cfg.tensor_pieces, fixed_sums(cfg, world), net)
        except ValueError as e:
            raise UsageError(f"--deterministic --sequence-parallel: {e}") from None
    elif cfg.mode == "tensor" and cfg.deterministic:   # every sum in a fixed tree; processes swap subtrees
        model = TensorDeterministic(
            params, ctx, cfg.optimizer, cfg.tensor_parallel, pieces=cfg.tensor_pieces, rank=world.rank,
            size=world.size, model=net,
            exchange=lambda table: world.allreduce(table, "tensortree" + "x".join(map(str, table.shape))))
    elif cfg.mode == "tensor":   # f and g inside a group stay in this process; `reduce` sums over groups
        model = TensorParallel(params, ctx, cfg.optimizer, cfg.tensor_parallel, reduce, make_allreduce(name), model=net,
                               sequence_parallel=cfg.sequence_parallel, zero_stage=cfg.zero_stage or 0)
    elif cfg.mode == "mesh" and cfg.deterministic and (cfg.context_parallel or 1) > 1:   # lanes in each stage
        try:
            model = MeshLanes(params, ctx, cfg.optimizer, cfg.stages or config.STAGES, cfg.context_parallel,
                              cfg.micro_batches or 1, cfg.schedule or "gpipe", virtual_stages(cfg), cfg.attention or "ring",
                              cfg.sequence_pieces, fixed_sums(cfg, world), net)
        except ValueError as e:
            raise UsageError(f"--deterministic --mode mesh: {e}") from None
    elif cfg.mode == "mesh" and cfg.deterministic:   # tensor groups in Q pieces; every stage's leaves in the tree
        try:
            model = MeshDeterministic(params, ctx, cfg.optimizer, cfg.stages or config.STAGES, mesh_tp(cfg),
                                      cfg.micro_batches or 1, cfg.schedule or "gpipe", virtual_stages(cfg),
                                      sums=fixed_sums(cfg, world), model=net)
        except ValueError as e:
            raise UsageError(f"--deterministic --mode mesh: {e}") from None
    elif cfg.mode == "mesh":     # tensor groups inside pipelines inside data parallelism
        try:
            model = MeshParallel(params, ctx, cfg.optimizer, cfg.stages or config.STAGES, mesh_tp(cfg),
                                 cfg.micro_batches or 1, cfg.schedule or "gpipe", virtual_stages(cfg), grad_reduce,
                                 make_allreduce(name), model=net, sequence_parallel=cfg.sequence_parallel,
                                 context_parallel=cfg.context_parallel or 1, attention=cfg.attention or "ring",
                                 zero_stage=cfg.zero_stage or 0)
        except ValueError as e:
            raise UsageError(f"--mode mesh: {e}") from None
    elif cfg.mode == "context" and (cfg.tensor_parallel or 1) > 1:   # a grid of cp x tp per replica
        try:
            model = ContextTensorParallel(params, ctx, cfg.optimizer, context_degree(cfg, len(ctx)),
                                          cfg.tensor_parallel, cfg.attention, grad_reduce, make_allreduce(name),
                                          model=net, zero_stage=cfg.zero_stage or 0)
        except ValueError as e:
            raise UsageError(str(e)) from None
    elif cfg.mode == "context":  # attention's collectives inside a group; `grad_reduce` sums over all
        model = ContextParallel(params, ctx, cfg.optimizer, cfg.context_parallel, cfg.attention, grad_reduce,
                                make_allreduce(name), model=net, zero_stage=cfg.zero_stage or 0)
    else:
        try:
            model = PipelineParallel(params, ctx, cfg.optimizer, cfg.micro_batches or 1, grad_reduce,
                                     cfg.stages or config.STAGES, cfg.schedule or "gpipe", cfg.recompute, model=net,
                                     virtual_stages=virtual_stages(cfg), sums=fixed_sums(cfg, world))
        except ValueError as e:
            raise UsageError(f"--schedule {cfg.schedule}: {e}") from None
    model = world.wrap(model)
    model = GradAccum(model, cfg.grad_accum) if cfg.grad_accum > 1 else model
    model = LossScaled(model, policy.scaler) if policy.scaler else model
    return model.clip(cfg.clip_norm)          # None: the global gradient norm is only logged


def fixed_sums(cfg, world):
    """--deterministic's FixedSums for this process of the job (None without it): its subtrees
    swapped with the other processes' by the job's all-reduce."""
    if not cfg.deterministic:
        return None
    return FixedSums(rank=world.rank, size=world.size, tensor_pieces=cfg.tensor_pieces or 1,
                     exchange=lambda table, key: world.allreduce(table, key + "x".join(map(str, table.shape))))


def virtual_stages(cfg):
    """Chunks of layers per pipeline context: --virtual-stages, 2 under interleaved by default."""
    return cfg.virtual_stages or (2 if cfg.schedule == "interleaved" else 1)


def dry_run(cfg, ctx, world):
    """--dry-run: the layout and, for a pipeline, its schedule, checked; nothing trained."""
    net = network(cfg)
    model = build_model(cfg, net.init_params(cfg.seed, cfg.init_scale), ctx, world)   # refuses what cannot run
    print(f"model {net.name}: {net.n_params():,} parameters in {len(net.layers)} layers")
    print(f"mode {describe(cfg)}")
    print("\n".join(Mesh.for_mode(cfg.mode, len(ctx), degree(cfg, len(ctx))).describe(ctx, world.size, cfg.deterministic)))
    if cfg.mode in ("model", "pipeline", "hybrid", "mesh"):
        S = cfg.stages or config.STAGES
        replicas = len(ctx) // (S * (mesh_tp(cfg) * (cfg.context_parallel or 1) if cfg.mode == "mesh" else 1))
        M = min(cfg.micro_batches or 1, cfg.batch_size // (replicas * world.size))
        name, V = cfg.schedule or "gpipe", virtual_stages(cfg)
        p = schedules.plan(name, S, M, V)
        print(schedules.dry_run(name, S, M, V))
        print("\n".join(priced_lines(net, p, cfg.recompute)))
        pipe = innermost(model)
        if isinstance(pipe, PipelineParallel) and not pipe.sums:      # not a mesh's groups, nor --deterministic's pieces
            micro = cfg.batch_size // (replicas * world.size * M)
            print("\n".join(priced_lines(net, p, costs=relative(stage_times(pipe, micro)),
                                          how=f"its actions timed here, one micro-batch of {micro} alone")))
    print("dry run: nothing trained")
    return []


def degree(cfg, n_contexts):
    """The mode's own dimension: tensor's T, hybrid's S, context's C or (C, T) (None: every context)."""
    T = cfg.tensor_parallel or 1
    context = (context_degree(cfg, n_contexts), T) if T > 1 else cfg.context_parallel
    return {"tensor": cfg.tensor_parallel, "hybrid": cfg.stages or config.STAGES, "context": context,
            "mesh": (cfg.stages or config.STAGES, mesh_tp(cfg), cfg.context_parallel or 1)}.get(cfg.mode)


def context_degree(cfg, n_contexts):
    """--mode context's C: --context-parallel, else every context a tensor group leaves."""
    return cfg.context_parallel or max(n_contexts // (cfg.tensor_parallel or 1), 1)


def mesh_tp(cfg):
    """--mode mesh's tensor degree: --tensor-parallel, else 1 beside --context-parallel, else MESH_TP."""
    return cfg.tensor_parallel or (1 if (cfg.context_parallel or 1) > 1 else config.MESH_TP)


def learning_rate(cfg, n_train):
    """--lr scaled by --scale-lr and ramped by --warmup-epochs: a float or a schedule of the update."""
    return make_lr(cfg.lr, cfg.batch_size * cfg.grad_accum, cfg.scale_lr, cfg.warmup_epochs,
                   updates_per_epoch(n_train, cfg.batch_size, cfg.grad_accum))
