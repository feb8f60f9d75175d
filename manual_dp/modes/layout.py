"""How each mode lays out its contexts and what its layout refuses: the stages, groups and degrees
the table's entries read, their meshes (`grid`), the devices a batch is split over (`replicas`),
and their refusals (`fits`), each raising UsageError in one line before any device is touched."""
from ..config import MESH_TP, STAGES
from ..errors import UsageError


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


def expert_grid(cfg, n):
    N = cfg.expert_parallel or n
    return {"dp": n // N, "ep": N}


def tensor_grid(cfg, n):
    T = cfg.tensor_parallel or n
    return {"dp": n // T, "tp": T}


def context_grid(cfg, n):
    C, T = context_degree(cfg, n), cfg.tensor_parallel or 1
    return {"dp": n // (C * T), "cp": C, "tp": T}


def mesh_grid(cfg, n):
    S, T, C = stages_of(cfg), mesh_tp(cfg), cfg.context_parallel or 1
    return {"dp": n // (S * T * C), "pp": S, "cp": C, "tp": T}


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


def fits_expert(cfg, n):
    """UsageError unless the expert-parallel groups divide the contexts and their size the experts."""
    N = cfg.expert_parallel or n
    if N < 1 or n % N:
        raise UsageError(f"--expert-parallel {N} does not divide the {n} contexts into groups")
    if cfg.experts % N:
        raise UsageError(f"--expert-parallel {N} does not divide --experts {cfg.experts}: each context of a group "
                         f"holds E/N experts")
