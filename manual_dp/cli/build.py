"""What a run is made of, from its RunConfig: this process's contexts, the network, the precision,
the strategy of its mode composed with the world (build_model), the learning rate, and --dry-run's
report. manual_dp.cli.run trains with them; the memory probe and the replay build the same."""
import functools

import mxnet as mx

from .. import checks, config, datasets, modes
from ..errors import UsageError
from ..fast import autotune
from ..fast.collectives import ALLREDUCE_ALGORITHMS, make_allreduce
from ..fast.compress import make_reducer
from ..fast.link import EmulatedLink
from ..links import parse_link, parse_straggler
from ..models import build as build_network
from ..models.dropout import Noise
from ..models.moe import Experts
from ..models.precise import Precise
from ..models.room import room
from ..planner.predict import OPT_COPIES
from ..precision import Policy
from ..schedule import make_lr, updates_per_epoch
from ..strategies.base import innermost
from ..strategies.pipeline import schedules
from ..strategies.pipeline.pipeline import PipelineParallel
from ..strategies.pipeline.stage_costs import priced_lines, relative
from ..strategies.pipeline.stage_times import stage_times
from ..strategies.wrappers.accum import GradAccum
from ..strategies.wrappers.loss_scaled import LossScaled
from ..strategies.wrappers.straggler import Straggler
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
def network_of(model, width, layers, d_model, heads, patch, seed, dropout=0.0, spec=None, room=None, experts=None):
    try:
        net = build_network(model, width, layers, d_model, heads, patch, seed, spec, room, experts)
        if dropout:
            net.drop(Noise(dropout, seed))
        return net
    except ValueError as e:
        raise UsageError(f"--model {model}: {e}") from None


def network(cfg):
    """The models.Model that cfg names, reading cfg's data (datasets.spec_of), built once per process
    (a user's block is loaded once), with cfg's dropout; refused in one line if the run would not
    fit in this machine's memory (models/room.py); --experts: every block's MLP a mixture of experts."""
    return network_of(cfg.model, cfg.width, cfg.layers, cfg.d_model, cfg.heads, cfg.patch, cfg.seed, cfg.dropout,
                      datasets.spec_of(cfg), room_of(cfg.optimizer, recorded(cfg), config.device_request(cfg)[0] == "gpu"),
                      experts_of(cfg))


def experts_of(cfg):
    """The models.moe.Experts of --experts, --top-k, --capacity-factor, --aux-loss-coef; None for 0."""
    if not cfg.experts:
        return None
    return Experts(cfg.experts, cfg.top_k, checks.capacity_factor(cfg.capacity_factor), cfg.aux_loss_coef)


def recorded(cfg):
    """Examples whose activations the run holds at once, at least: the batch, a micro-batch of a
    pipeline, a piece under --deterministic, none counted under --recompute."""
    if cfg.recompute:
        return 0
    if cfg.deterministic:
        return min(cfg.batch_size, config.PIECE_ROWS)
    return -(-cfg.batch_size // (cfg.micro_batches or 1))


@functools.lru_cache(maxsize=4)
def room_of(optimizer, examples, on_gpus):
    """The memory a run of these settings has (models/room.py), read once per process (so that the
    network is built once)."""
    return room(OPT_COPIES[optimizer], optimizer, examples, on_gpus)


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
    """The strategy of cfg.mode (its entry of manual_dp.modes.TABLE) on `ctx` for cfg's model in the
    precision of `policy` (default policy_of(cfg)), composed with the world (the cross-process sum and
    this process's rows), then wrapped from outside: gradient accumulation, fp16's loss scale, clipping."""
    policy = policy or policy_of(cfg)
    net = network(cfg)
    if cfg.model not in config.MODELS:                # a user's block: its BatchNorms are known now
        checks.check_running(cfg, bool(net.stats()))
    net = precise(net, policy)
    refuse_layout(cfg, net, len(ctx), world)
    name = cfg.allreduce or config.FAST_STEP["allreduce"]  # model, pipeline: one replica, nothing to sum here
    if name not in ALLREDUCE_ALGORITHMS:
        raise UsageError(f"--allreduce {name}: choose from {', '.join(ALLREDUCE_ALGORITHMS)}")
    wire = EmulatedLink(parse_link(cfg.link)) if cfg.link else None          # --link: every transfer delayed
    reduce = world.reducer(make_allreduce(name, wire))
    grad_reduce = world.reducer(policy.reducer(make_allreduce(name, wire), name))   # gradients: in the precision
    grad_reduce = policy.rounding(grad_reduce) if world.size > 1 else grad_reduce
    parts = modes.Parts(params, ctx, net, reduce, grad_reduce, make_allreduce(name, wire), name, policy, world,
                        modes.fixed_sums(cfg, world), padding(cfg, world),
                        make_reducer(cfg.compress, reduce, [w.shape for w in params], world), wire)
    mode = modes.of(cfg)
    try:
        model = mode.build(cfg, parts)
    except ValueError as e:
        if mode.refused(cfg) is None:
            raise
        raise UsageError(f"{mode.refused(cfg)}{e}") from None
    model = world.wrap(model)
    model = Straggler(model, *parse_straggler(cfg.straggler, len(ctx))) if cfg.straggler else model
    model = GradAccum(model, cfg.grad_accum) if cfg.grad_accum > 1 else model
    model = LossScaled(model, policy.scaler) if policy.scaler else model
    return model.clip(cfg.clip_norm)          # None: the global gradient norm is only logged


def refuse_layout(cfg, net, n_contexts, world):
    """UsageError (one line) where cfg's layout cannot cut the model `net` (known once it is built)."""
    mode = modes.of(cfg)
    refusal = net.tensor_refusal(cfg.tensor_parallel or n_contexts) if cfg.mode == "tensor" else None
    if refusal:
        raise UsageError(f"--tensor-parallel {refusal}")
    refusal = net.tensor_refusal(cfg.tensor_pieces) if (cfg.tensor_pieces or 1) > 1 else None
    if refusal:
        raise UsageError(f"--tensor-pieces {refusal}")
    if (cfg.tensor_pieces or 1) > 1 and mode.stages and not net.splits_by_layer():
        raise UsageError(f"--tensor-pieces {cfg.tensor_pieces} in a pipeline needs a model whose layers split one "
                         f"by one (the transformer, the MLP's pairs do not): --model {cfg.model} splits as a whole")
    T = modes.mesh_tp(cfg) if cfg.mode == "mesh" else cfg.tensor_parallel or n_contexts
    refusal = net.sequence_refusal(T, None) if cfg.sequence_parallel else None
    if refusal:
        raise UsageError(f"--sequence-parallel: {refusal}")
    C = modes.context_degree(cfg, n_contexts)
    refusal = net.sequence_refusal(C, cfg.attention) if mode.sequence and not mode.stages else None
    if refusal:
        raise UsageError(f"--mode {cfg.mode}: {refusal}")
    if (cfg.stages or 1) * modes.virtual_stages(cfg) > len(net.layers):
        chunks = f" x --virtual-stages {modes.virtual_stages(cfg)}" if modes.virtual_stages(cfg) > 1 else ""
        raise UsageError(f"--stages {cfg.stages}{chunks}: --model {cfg.model} has {len(net.layers)} layers to cut "
                         f"between ({', '.join(layer.name for layer in net.layers)})")
    if cfg.zero_stage and cfg.mode != "zero" and world.size > 1:
        raise UsageError(f"--zero-stage with --mode {cfg.mode} shards over this process's contexts only: not yet "
                         f"across {world.size} processes")


def padding(cfg, world):
    """The channel padding of LeNet's cached graph (1: none), its choice printed where there is one."""
    pad = graph_pad(cfg, world)                                              # rank 0's
    if pad is not None:
        print(f"cached graph: convolution channels padded to multiples of {pad}" if pad > 1 else
              "cached graph: convolutions unpadded" + (" (--no-autotune)" if cfg.no_autotune else ""))
    return pad or 1


def dry_run(cfg, ctx, world):
    """--dry-run: the layout and, for a pipeline, its schedule, checked; nothing trained."""
    net = network(cfg)
    model = build_model(cfg, net.init_params(cfg.seed, cfg.init_scale), ctx, world)   # refuses what cannot run
    print(f"model {net.name}: {net.n_params():,} parameters in {len(net.layers)} layers")
    print(f"mode {describe(cfg)}")
    print("\n".join(modes.grid_of(cfg, len(ctx)).describe(ctx, world.size, cfg.deterministic)))
    if modes.of(cfg).stages:
        replicas = modes.of(cfg).replicas(cfg, len(ctx))
        M = min(cfg.micro_batches or 1, cfg.batch_size // (replicas * world.size))
        S, name, V = modes.stages_of(cfg), cfg.schedule or "gpipe", modes.virtual_stages(cfg)
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


def learning_rate(cfg, n_train):
    """--lr scaled by --scale-lr and ramped by --warmup-epochs: a float or a schedule of the update."""
    return make_lr(cfg.lr, cfg.batch_size * cfg.grad_accum, cfg.scale_lr, cfg.warmup_epochs,
                   updates_per_epoch(n_train, cfg.batch_size, cfg.grad_accum))
