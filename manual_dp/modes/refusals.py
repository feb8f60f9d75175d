"""What each mode refuses of a run's settings, before any device is touched: each function returns
the one line a refusal says (the command line raises it as a UsageError), or None."""


def refuse_nothing(cfg):
    """No refusal of its own."""


def refuse_async(cfg):
    """Async SGD runs in one process (dist_async is the parameter servers' own)."""
    if cfg.backend in ("horovod", "dist_sync"):
        return (f"--backend {cfg.backend} runs every mode but async (for asynchronous training across "
                f"processes use --backend dist_async)")


def refuse_tensor(cfg):
    """Tensor parallelism splits column/row pairs, and cuts the sequence only under --sequence-parallel."""
    if cfg.model == "resnet":
        return ("--mode tensor splits layers in column/row pairs (the transformer's, a user's Dense pairs): "
                "--model resnet has none")
    if (cfg.sequence_pieces or 1) > 1 and not cfg.sequence_parallel:
        return "--sequence-pieces in --mode tensor cuts the sequence of --sequence-parallel: give it too"


def refuse_context(cfg):
    if cfg.deterministic and cfg.zero_stage:
        return ("--deterministic --mode context: dp x cp x tp only, not --zero-stage (its shards are not cut in "
                "the fixed pieces yet)")


def refuse_mesh(cfg):
    """What --deterministic's pieces do not reach in a pipeline of groups yet."""
    cp = cfg.context_parallel or 1
    if cfg.sequence_parallel and cfg.deterministic:
        return ("--sequence-parallel --deterministic: --mode tensor only, not --mode mesh (a pipeline's stages do "
                "not run the sequence's fixed pieces yet)")
    cp_tp = cp > 1 and ((cfg.tensor_parallel or 1) > 1 or (cfg.tensor_pieces or 1) > 1)
    if cfg.deterministic and (cp_tp or cfg.zero_stage):
        return "--deterministic --mode mesh: dp x pp x tp or dp x pp x cp only: " + (
            "not cp with tp or --tensor-pieces in a pipeline (a lane's split layers are not cut in the fixed pieces "
            "in pipeline stages yet)" if cp_tp else "not --zero-stage (its shards are not cut in the fixed pieces yet)")
    if (cfg.sequence_pieces or 1) > 1 and cp == 1:
        return "--sequence-pieces in --mode mesh cuts the sequence of cp > 1: give --context-parallel too"


def refuse_expert(cfg):
    """Expert parallelism shards an MoE GPT's experts, in one process."""
    if not cfg.experts:
        return (f"--mode expert shards the experts of an MoE: give --model gpt --experts E (--model {cfg.model} "
                f"has none)")
    if cfg.backend != "local":
        return f"--mode expert runs in one process: not --backend {cfg.backend} yet"
