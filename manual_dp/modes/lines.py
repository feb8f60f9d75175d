"""How each mode's header line reads: one line on what the mode does with the run's settings."""
from ..config import NEXT_TOKEN_MODELS
from .layout import stages_of

SHARDED = {1: "optimiser state", 2: "optimiser state and gradients", 3: "optimiser state, gradients and parameters"}
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B", "zb-h1": "ZB-H1"}


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
        causal = cfg.model in NEXT_TOKEN_MODELS        # a causal model's balanced cut (fast/causal_attention.py)
        return (f"context: every sequence cut over {cfg.context_parallel or 'all'} context(s) per group"
                + (", in 2C chunks, context j holding chunks j and 2C - 1 - j (causal attention's work balanced), "
                   f"causal {cfg.attention}" if causal else f", {cfg.attention}")
                + f" attention between the blocks, groups data parallel ({cfg.allreduce})")
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


def describe_expert(cfg):
    E, N = cfg.experts, cfg.expert_parallel
    per = ("one group of every context, E/n experts each, n the contexts" if not N else
           "one expert a context, context j of a group holding expert j" if E == N else
           f"{E // N} experts a context, context j of a group holding experts {E // N}j to {E // N}j + {E // N - 1}")
    return (f"expert: the {E} experts of every MoE block sharded over {N or 'all'} context(s) per group ({per}), "
            f"the rest replicated; each context routes its rows, an all-to-all sends every expert's slots to its "
            f"context and one brings the outputs back; groups data parallel ({cfg.allreduce})")
