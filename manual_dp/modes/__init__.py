"""The one table of modes (this file): each `--mode` is one entry that says which flags apply to it, how it is
built, what it refuses and why, how its header line reads, and how it is laid out as a mesh. The
command line's checks (checks.py), its build (cli/build.py), its output (cli/output.py), the memory
probe and the planner read this table instead of branching on the mode's name.

Nothing here loads MXNet at import: the strategies are imported when an entry builds one (the
command line reads its flags before MXNet loads). A build takes the run's settings and `Parts`,
what every layout is made from, among them `sums`: --deterministic's policy (strategies/sums/), read
once for every layout (None: each layout's fast sums).

    __init__.py  the table: each mode's entry, the flags it applies to, resolve, --mesh's modes
    build.py     how each mode is built: Parts, one build function per mode
    lines.py     how each mode's header line reads
    layout.py    how each mode lays out its contexts (grid, replicas) and what it refuses (fits)
    refusals.py  what each mode refuses of a run's settings (refuses)
"""
import dataclasses
from dataclasses import dataclass
from typing import Callable

from ..config import (DEFAULT_ONLY_IN, FAST_STEP, LOSS_SCALE, MODE_DEFAULTS, MODEL_APPLIES, MODELS,
                      SEQUENCE_PIECES, TENSOR_PIECES, MODEL_SIZES, fields)
from ..errors import UsageError
from ..mesh import Mesh
from .build import (Parts, build_async, build_context, build_local, build_mesh, build_pipeline, build_sync,
                    build_tensor, build_zero, build_expert)
from .layout import (check_tensor_layout, context_degree, context_grid, data_grid, every_context_a_replica,
                     expert_grid, fits_anywhere, fits_context, fits_expert, fits_hybrid, fits_mesh, fits_pipeline,
                     fits_tensor, hybrid_grid,
                     mesh_grid, mesh_group, mesh_replicas, mesh_tp, one_replica_per_pipeline, pipeline_grid,
                     stages_of, tensor_grid, tensor_split_sizes, virtual_stages)
from .refusals import refuse_async, refuse_context, refuse_expert, refuse_mesh, refuse_nothing, refuse_tensor
from .lines import (SCHEDULE_NAMES, SHARDED, describe_context, describe_expert, describe_hybrid, describe_local, describe_mesh,
                    describe_model, describe_pipeline, describe_sync, describe_tensor, describe_zero)

PIPELINE_FLAGS = ("stages", "schedule", "virtual_stages", "micro_batches")


@dataclass(frozen=True)
class Mode:
    """One --mode: `flags` the mode-specific flags that apply to it; `build(cfg, parts)` its strategy;
    `describe(cfg)` its header line; `replicas(cfg, n)` the data-parallel replicas of n contexts;
    `grid(cfg, n)` the mesh it lays n contexts out as ({dimension: size}); `shapes` the sets of
    dimensions besides dp of the --mesh shapes it lays out; `fits(cfg, n)` raises UsageError where
    n contexts cannot be laid out so (before any device is touched); `stages` whether
    it cuts the model in pipeline stages; `sequence` whether it needs a model with a sequence of
    tokens; `splits` whether it splits layers or the sequence itself (its line names the pieces); `deterministic` and `running` why --deterministic, or a model with BatchNorm's running
    statistics, is refused ("" where they are not); `refuses(cfg)` the one line a refusal of cfg's settings says (None: it takes them), checked before
    any device is touched; `refused(cfg)` what a one-line refusal of a layout
    the build cannot make (a ValueError) starts with (None: the error is no user's); `algorithm` what
    it computes: every layout equal to one context computes "one context", and a checkpoint of one
    resumes in any other (async and local SGD compute algorithms of their own)."""
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
    refuses: Callable = refuse_nothing
    algorithm: str = "one context"


PP, CP, TP, EP = frozenset({"pp"}), frozenset({"cp"}), frozenset({"tp"}), frozenset({"ep"})   # --mesh shapes besides dp
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
         deterministic="stale replicas compute other gradients than one context by design; use --mode sync",
         refuses=refuse_async, algorithm="async"),
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
                       "from one context's even at --sync-every 1; use --mode sync", algorithm="local SGD"),
    Mode("tensor", "Megatron's split layers (--sequence-parallel: Megatron-SP), groups data parallel",
         "TensorParallel", DATA_FLAGS + SUMMED + ("allreduce", "zero_stage", "tensor_parallel", "sequence_parallel",
                                                 "sequence_pieces"),
         build_tensor, describe_tensor, grid=tensor_grid, shapes=(TP,), fits=fits_tensor, splits=True,
         refused=lambda cfg: "--deterministic --sequence-parallel: " if cfg.deterministic and cfg.sequence_parallel
         else None, refuses=refuse_tensor),
    Mode("context", "the sequence cut over a group: ring or Ulysses attention", "ContextParallel",
         DATA_FLAGS + SUMMED + ("allreduce", "zero_stage", "tensor_parallel", "context_parallel", "attention",
                                "sequence_pieces"),
         build_context, describe_context, grid=context_grid, shapes=(CP, CP | TP), fits=fits_context, sequence=True,
         splits=True,
         running="it cuts a sequence of tokens, which only the transformer (no BatchNorm) has",
         refused=lambda cfg: f"--deterministic --sequence-pieces {cfg.sequence_pieces}: " if cfg.deterministic
         else "" if (cfg.tensor_parallel or 1) > 1 else None, refuses=refuse_context),
    Mode("expert", "an MoE's experts sharded over a group, all-to-all to them and back", "ExpertParallel",
         ("check_replicas", "deterministic", "clip_norm", "allreduce", "expert_parallel"), build_expert,
         describe_expert, grid=expert_grid, shapes=(EP,), fits=fits_expert,
         deterministic="the experts' sums are not cut in the fixed pieces yet; use --mode sync, zero or a pipeline",
         refuses=refuse_expert),
    Mode("mesh", "data x pipeline x tensor (or context) at once", "MeshParallel",
         DATA_FLAGS + SUMMED + PIPELINE_FLAGS + ("allreduce", "zero_stage", "tensor_parallel", "sequence_parallel",
                                                 "context_parallel", "attention", "sequence_pieces"),
         build_mesh, describe_mesh, mesh_replicas, mesh_grid, (PP | TP, PP | CP, PP | CP | TP), fits_mesh,
         stages=True, sequence=True, splits=True,
         running="it lays out the transformer, whose blocks have no BatchNorm",
         refused=lambda cfg: "--deterministic --mode mesh: " if cfg.deterministic else "--mode mesh: ",
         refuses=refuse_mesh),
)}
MODES = tuple(TABLE)


FLAGS = tuple(dict.fromkeys(f for mode in TABLE.values() for f in mode.flags))   # every mode-specific flag
MESH_FLAGS = {"pp": "stages", "cp": "context_parallel", "tp": "tensor_parallel",
              "ep": "expert_parallel"}                                # --mesh's sizes as flags


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


def fixed_sums(cfg, world):
    """--deterministic's FixedSums for this process of the job (None without it): its subtrees swapped
    with the other processes' by the job's all-reduce. The one place --deterministic is read."""
    if not cfg.deterministic:
        return None
    from ..strategies.sums.fixed_sums import FixedSums
    return FixedSums(rank=world.rank, size=world.size, tensor_pieces=cfg.tensor_pieces or 1,
                     exchange=lambda table, key: world.allreduce(table, key + "x".join(map(str, table.shape))))


def grid_of(cfg, n):
    """The mesh (manual_dp.mesh.Mesh) cfg's mode lays its n contexts out as."""
    return Mesh(**of(cfg).grid(cfg, n))


__all__ = ["Mode", "TABLE", "MODES", "FLAGS", "Parts", "of", "applies", "resolve", "mode_of", "grid_of", "fixed_sums",
           "stages_of", "virtual_stages", "mesh_tp", "mesh_group", "context_degree", "tensor_split_sizes",
           "check_tensor_layout", "SCHEDULE_NAMES", "SHARDED"]
