"""Every default of a training run, in one place: RunConfig, from which the command line is built.

The notebooks, the benchmark and the tests read their defaults here too. Nothing here imports
MXNet: the command line reads its flags before MXNet loads (manual_dp.fast.runtime).
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from .fast.runtime import visible_gpus

MESH_TP = 2                   # --mode mesh: contexts per tensor group unless --tensor-parallel says
ATTENTIONS = ("ring", "ulysses")                              # --attention (manual_dp/fast/attention.py)
OPTIMIZERS = ("sgd", "momentum", "adam")
MODELS = ("lenet", "mlp", "transformer", "resnet", "lstm", "gpt")   # or PATH.py:FUNCTION, the user's Gluon block (manual_dp/models/)
TRANSFORMER = dict(layers=2, d_model=64, heads=4, patch=0)   # --model transformer's default sizes
LSTM = dict(layers=1, d_model=128)                          # --model lstm's: LSTM layers, hidden units (= embedding)
GPT = dict(layers=2, d_model=128, heads=4)                  # --model gpt's: blocks, width of a token, heads
MODEL_SIZES = {"transformer": TRANSFORMER, "lstm": LSTM, "gpt": GPT}    # each sized model's defaults
SEQUENCE_MODELS = ("transformer", "gpt")   # models whose tokens context and sequence parallelism cut
NEXT_TOKEN_MODELS = ("gpt",)  # models that predict the next token at every position (datasets.task_of)
# Training flags a model sets unless they are given (on the command line or in --config's file):
MODEL_RUN_DEFAULTS = {"gpt": dict(optimizer="adam", lr=0.003, batch_size=64, epochs=1)}
SEQ_LEN = 128                 # --seq-len: tokens per example of a text data set (a fortune's first bytes)
CORPUS_SEQ_LEN = 64           # --seq-len of a language model's corpus (a window is --seq-len + 1 tokens)
VOCABS = ("bytes", "chars")   # --vocab of a text corpus (datasets/corpus.py): the first is the default
TEXT_TRAIN = 0.9              # --data text:PATH: the share of the file, from its start, that trains
FORTUNES = dict(directory="/usr/share/games/fortunes", categories=10, test_every=10)   # --data fortunes (datasets/)
LOSS_SCALE = dict(loss_scale=2.0 ** 16, scale_window=200)     # --precision fp16's dynamic loss scale
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")          # --schedule (manual_dp/strategies/pipeline/schedules.py)
PIPELINE_COSTS = dict(input_grad=1.0, weight_grad=1.0)   # a layer's gradients over its forward FLOPs (strategies/pipeline/stage_costs.py)
PRECISIONS = ("fp32", "bf16", "fp16")                          # --precision (manual_dp/precision.py)
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
BACKENDS = ("local", "horovod", "dist_sync", "dist_async")
STAGES = 2                    # pipeline stages by default (LeNet: convolutions | dense layers)
MAX_STAGES = 4                # LeNet's layers: conv1 | conv2 | dense1 | dense2 (models/lenet.py CUTS); others: their layer count
MAX_LAYERS = 256              # --layers at most (GPT-3 has 96; the planner's search grows as the square: 1,000 took 17 s)
DEFAULT_CPU_CONTEXTS = 2      # contexts when there is no GPU and none are named
FAST_STEP = dict(allreduce="reduce_bcast", fuse_grads=True, graph=True)
LESSON_STEP = dict(allreduce="lesson", fuse_grads=False, graph=False)
CACHE_BYTES_UNKNOWN = 32 << 20   # the last-level cache costmodel_cpu assumes where /sys does not give it (this
                                 # project's AMD EPYC machines: 32 MiB)
PLAN_TOP, PLAN_STEPS = 3, 3    # python -m manual_dp.plan --verify: layouts run, steps timed each
PLAN_MAX_DEVICES, PLAN_MAX_BATCH = 4096, 1 << 22    # what the planner lays out at most (memory, time bounded)
ZERO_MEMORY = dict(width=16, cpus=4, optimizer="adam", precision="bf16", batch=64)   # python -m manual_dp.bench.zero_memory
PIECE_ROWS = 64               # --deterministic: rows per piece, the unit whose gradient is computed whole
                              # (64, not 32: half the calls; measured in docs/performance.md, 2026-11-26)
TENSOR_PIECES = 4             # --deterministic --mode tensor's default --tensor-pieces: pieces of every split layer, whatever T
SEQUENCE_PIECES = 4           # --deterministic --mode context's default --sequence-pieces: pieces of the sequence, whatever C


# The groups of --help and the sections of a --config file, in their order: {name: what its flags decide}.
GROUPS = {
    "devices": "which devices train, and how much memory each may hold",
    "model": "the network and its sizes",
    "data": "what to train on (--data), where Fashion-MNIST is, and how much of it to use",
    "parallelism": "how the contexts share the work: the mode, its layout, its sums and its collectives",
    "precision": "the precision of the products",
    "optimisation": "epochs, batches, the learning rate and its schedule, the update",
    "checkpoints": "a checkpoint every epoch, and continuing from it",
    "output": "what the run writes and shows besides its checkpoints",
    "processes": "more than one process (see docs/multi-machine.md)",
}
EXCLUSIVE = ("gpus", "cpus")          # flags of which a run is given one at most


def flag(default, help, group, **argparse):
    """A RunConfig field: its default, its --help text, its group of GROUPS, argparse extras."""
    if group not in GROUPS:
        raise ValueError(f"flag group {group!r} is not one of {', '.join(GROUPS)}")
    return field(default=default, metadata=dict(help=help, group=group, argparse=argparse))


@dataclass
class RunConfig:
    """One training run. A field `name` is the flag `--name`; None means "decided by the mode"."""
    gpus: Optional[int] = flag(None, "train on gpu(0..N-1) (default: every GPU, else 2 CPU contexts)",
                               "devices")
    cpus: Optional[int] = flag(None, "train on cpu(0..N-1)", "devices")
    memory_per_device: Optional[str] = flag(None, "emulate devices of this many bytes (300MiB, 2G: K, M, "
                                                  "G of 1000, KiB, MiB, GiB of 1024): refuse, before training, a layout whose "
                                                  "measured peak on a context exceeds it, and name the modes "
                                                  "that fit (manual_dp/memory.py)", "devices")
    model: str = flag("lenet", "the network: lenet, mlp, transformer (a small vision transformer), lstm (seed "
                               "000's text classifier), gpt (a causal language model: --data fortunes or "
                               "text:PATH; Adam, lr 0.003, batch 64, 1 epoch unless given), or "
                               "PATH.py:FUNCTION, a function returning your own Gluon HybridBlock "
                               "(manual_dp/models/)", "model")
    width: int = flag(1, "lenet, mlp and resnet: multiply the channels and hidden units (LeNet's 20, 50, 128) by W: "
                         "parameters, gradients, optimiser state and activations grow (W=16: 32.6M "
                         "parameters)", "model")
    layers: Optional[int] = flag(None, f"transformer, gpt: blocks (default {TRANSFORMER['layers']}, gpt {GPT['layers']}); "
                                       f"lstm: LSTM layers ({LSTM['layers']})", "model")
    d_model: Optional[int] = flag(None, f"transformer, gpt, lstm: width of a token (default {TRANSFORMER['d_model']}, "
                                        f"gpt {GPT['d_model']}, lstm {LSTM['d_model']})",
                                  "model")
    heads: Optional[int] = flag(None, f"transformer, gpt: attention heads, dividing --d-model (default "
                                      f"{TRANSFORMER['heads']})", "model")
    patch: Optional[int] = flag(None, "transformer: tokens are P x P patches (P divides 28); 0: image rows "
                                      "(default 0)", "model")
    dropout: float = flag(0.0, "transformer, or a Gluon block with Dropout children: drop this share of the "
                               "units at every dropout site while training, with masks drawn per (batch, "
                               "example), the same in every layout, micro-batching, recompute and resume "
                               "(manual_dp/models/dropout.py)", "model")
    experts: int = flag(0, "gpt: E experts in every block's MLP, routed per window (a mixture of experts, "
                           "models/moe.py); 0: the dense MLP", "model")
    top_k: int = flag(1, "gpt --experts: experts per token, 1 (Switch) or 2 (GShard's renormalised gates)",
                      "model", choices=(1, 2))
    capacity_factor: str = flag("1.25", "gpt --experts: slots per expert and window ceil(F x tokens x top-k / "
                                        "experts), the tokens past them dropped; none: dropless", "model")
    aux_loss_coef: float = flag(0.01, "gpt --experts: weight of the load-balancing loss E x sum_e f_e P_e",
                                "model")
    ledger: Optional[str] = flag(None, "gpt --experts: write, per update, every token's expert(s), slot and "
                                       "dropped flag in each MoE block, with a digest, to this file; compare two "
                                       "runs with python -m manual_dp.diverge A B", "output")
    init_scale: Optional[float] = flag(None, "std of normal(0, s) weights; default He init; "
                                             "0.01 is the lesson's", "model")
    data: str = flag("fashion-mnist", "the data set: fashion-mnist (28x28 images, 10 classes); fortunes[:DIR] "
                                      "(Debian's fortunes package: a fortune's category from its first --seq-len "
                                      "bytes, the largest categories, for --model lstm or mlp; for --model gpt the fortunes' text); "
                                      "text:PATH (any text file, --model gpt); npz:PATH (your arrays "
                                      "X, y and optionally X_test, y_test; integer X are token ids) "
                                      "(manual_dp/datasets/)", "data")
    seq_len: Optional[int] = flag(None, f"fortunes and text: tokens of each example: a fortune's first bytes, "
                                        f"left-padded, or a corpus's window (default {SEQ_LEN}; a corpus "
                                        f"{CORPUS_SEQ_LEN})", "data")
    vocab: Optional[str] = flag(None, "--model gpt on fortunes or text:PATH: the tokens, bytes (256) or chars "
                                      "(the text's distinct characters; it must be UTF-8) (default bytes)",
                                "data", choices=VOCABS)
    data_dir: Optional[str] = flag(None, "directory with the four Fashion-MNIST IDX .gz files "
                                         "(default: $MANUAL_DP_DATA, then Debian's package, then "
                                         "MXNet's cache)", "data")
    train_size: Optional[int] = flag(None, "use only the first N training examples", "data")
    test_size: Optional[int] = flag(None, "use only the first N test examples", "data")
    mode: str = flag("sync", "sync: data parallel; async: parameter server with stale replicas; "
                             "model: convs on one context, dense layers on the next; pipeline: "
                             "model + GPipe micro-batches; hybrid: data parallel over 2-context "
                             "pipelines; zero: data parallel with ZeRO's sharding (--zero-stage); "
                             "local: local SGD / DiLoCo, replicas meet every --sync-every steps; "
                             "tensor: Megatron's split layers; context: the sequence cut over the "
                             "contexts (--model transformer, or gpt: causal, in balanced chunks); mesh: data x pipeline x tensor at once "
                             "(--stages x --tensor-parallel a pipeline). --mesh lays these out as a grid",
                "parallelism")
    mesh: Optional[str] = flag(None, "the contexts as a grid, dp=D,pp=P,cp=C,tp=T (any subset, the product the "
                                     "number of contexts): dp alone is sync (or --mode zero, async, local), "
                                     "dp x tp tensor, dp x pp hybrid, pp model/pipeline, dp x cp context "
                                     "(manual_dp/mesh.py)", "parallelism")
    staleness: Optional[int] = flag(None, "async only: replicas refreshed every S+1 updates "
                                          "(default 0)", "parallelism")
    zero_stage: Optional[int] = flag(None, "zero: ZeRO shards over the contexts 1: the optimiser state, "
                                           "2: also the gradients, 3: also the parameters (default 1); tensor, "
                                           "context, mesh: 1 shards the optimiser state over the data dimension, "
                                           "2 also the gradients, 3 also the parameters (default off)",
                                     "parallelism", choices=(1, 2, 3))
    sync_every: Optional[int] = flag(None, "local only: inner optimiser steps each replica takes on its own "
                                           "shards between syncs (H; default 4)", "parallelism")
    outer_optimizer: Optional[str] = flag(None, "local only: what applies the averaged change at a sync "
                                                "(default sgd; nesterov as in DiLoCo)", "parallelism",
                                          choices=("sgd", "nesterov"))
    outer_lr: Optional[float] = flag(None, "local only: the outer optimiser's learning rate (default 1: "
                                           "sgd then averages the replicas)", "parallelism")
    outer_momentum: Optional[float] = flag(None, "local with --outer-optimizer nesterov only: its momentum "
                                                 "(default 0.9)", "parallelism")
    stages: Optional[int] = flag(None, "model, pipeline, hybrid and mesh: the model's layers cut into S "
                                       "stages balanced by their FLOPs, one context each, S up to the layer "
                                       "count (LeNet: 2 convs | dense, ... 4 conv1 | conv2 | dense1 | dense2; "
                                       "default 2)", "parallelism")
    micro_batches: Optional[int] = flag(None, "pipeline, hybrid and mesh only: micro-batches per batch and "
                                              "pipeline (default 4)", "parallelism")
    schedule: Optional[str] = flag(None, "pipeline, hybrid and mesh: gpipe (every forward, then every backward), "
                                         "1f1b (one forward, one backward: stage s holds at most S - s "
                                         "micro-batches), interleaved (--virtual-stages chunks a context, "
                                         "bubble / V) or zb-h1 (backward split into input and weight "
                                         "gradients, W fills the bubble) (default gpipe; "
                                         "manual_dp/strategies/pipeline/schedules.py)", "parallelism",
                                   choices=SCHEDULES)
    virtual_stages: Optional[int] = flag(None, "pipeline, hybrid and mesh with --schedule interleaved: chunks of layers "
                                               "each context holds, the model cut into S x V stages (default 2)",
                                         "parallelism")
    recompute: bool = flag(False, "model, pipeline and hybrid: keep only each stage's input per "
                                  "micro-batch, recompute its activations in the backward (less memory, "
                                  "more time)", "parallelism")
    tensor_parallel: Optional[int] = flag(None, "tensor, mesh and context: contexts per tensor group, each "
                                                "holding a 1/T shard of every split layer; the groups are "
                                                "data parallel (default: every context, one group; mesh 2)",
                                          "parallelism")
    sequence_parallel: bool = flag(False, "tensor and mesh, --model transformer: Megatron's sequence parallelism: "
                                          "between the split layers each context keeps 1/T of the tokens "
                                          "(all-gather before a column-parallel layer, reduce-scatter after a "
                                          "row-parallel one, instead of all-reduces)", "parallelism")
    context_parallel: Optional[int] = flag(None, "context and mesh: contexts per context-parallel group, each "
                                                 "holding a 1/C block of every sequence; the groups are data "
                                                 "parallel (default: every context, one group)", "parallelism")
    expert_parallel: Optional[int] = flag(None, "expert, --model gpt --experts E: contexts per expert-parallel "
                                                "group, each holding E/N of every block's experts (the rest "
                                                "replicated); the groups are data parallel (default: every "
                                                "context, one group)", "parallelism")
    attention: Optional[str] = flag(None, "context and mesh: how the blocks of a sequence attend to each other: ring "
                                          "(key and value blocks passed round, online softmax) or ulysses "
                                          "(all-to-all to head groups and back) (default ring)",
                                    "parallelism", choices=ATTENTIONS)
    deterministic: bool = flag(False, "the same bits on any number of contexts and processes, and in sync, "
                                      "zero, model, pipeline, hybrid, tensor, context (dp x cp x tp) and mesh (dp x pp x tp or dp x pp x cp) alike: every batch cut into pieces of "
                                      f"{PIECE_ROWS} rows whose gradients are added in one fixed tree (a model "
                                      "with BatchNorm: each piece normalised with its own statistics); one thread per op (manual_dp/strategies/sums/fixed_sums.py)", "parallelism")
    perturb: Optional[str] = flag(None, "nudge the run by as little as floats allow: weights:SEED (every initial "
                                        "parameter one ulp up or down), inputs:SEED (every input value), order:SEED "
                                        "(the rows of every batch reshuffled); python -m manual_dp.yardstick runs "
                                        "several to judge a gap between runs (manual_dp/perturb.py)", "parallelism",
                                  metavar="KIND:SEED")
    tensor_pieces: Optional[int] = flag(None, "--deterministic: every split layer (channels, heads, hidden units) "
                                              "computed in Q fixed pieces whose partial sums are added in one tree, "
                                              "in every layout: then --mode tensor with any --tensor-parallel dividing "
                                              "Q (and --mode mesh with tp dividing Q) has the bits of sync, zero and pipelines given the same Q; "
                                              "with --sequence-pieces K, --mode context --tensor-parallel T has --mode sync's given K and Q "
                                              f"(default {TENSOR_PIECES} in tensor and mesh mode and context with --tensor-parallel > 1, else 1: whole; "
                                              "manual_dp/strategies/tensor/tensor_pieces.py)", "parallelism")
    sequence_pieces: Optional[int] = flag(None, "--deterministic, --model transformer: the sequence computed in K "
                                                "fixed pieces, attention folded in one order and every sum over "
                                                "them in one tree: then --mode context with any --context-parallel "
                                                "dividing K, --mode tensor --sequence-parallel with T dividing K and --mode mesh pp x cp, have the bits of --mode sync given the same K (default "
                                                f"{SEQUENCE_PIECES} in context mode, tensor with --sequence-parallel and mesh with cp > 1, else 1: whole; "
                                                "manual_dp/strategies/context/sequence_pieces.py)", "parallelism")
    sync_batchnorm: bool = flag(False, "sync and zero, --model resnet: BatchNorm statistics over every context's "
                                       "shard (summed by hand), equal to one context; default: each "
                                       "context its own, as Gluon computes them", "parallelism")
    allreduce: Optional[str] = flag(None, "sync, hybrid, local, tensor, context and mesh: how gradients (local: parameters) are "
                                          "summed over the contexts (manual_dp.fast.collectives; default "
                                          f"{FAST_STEP['allreduce']})", "parallelism")
    fuse_grads: Optional[bool] = flag(None, "sync only: one flat gradient buffer per device, one "
                                            "all-reduce and one optimiser update a step (default on)",
                                      "parallelism")
    graph: Optional[bool] = flag(None, "sync only: the model as a cached symbolic graph instead of layer "
                                       "by layer (default on)", "parallelism")
    bucket_mb: Optional[float] = flag(None, "sync only: gradients in buckets of this many MB, last layer "
                                            "first, each all-reduced as soon as backward has written it "
                                            "(0: one per parameter; default: one fused buffer)", "parallelism")
    compress: str = flag("none", "sync only: what each replica sends instead of its float32 gradient, "
                                 "with error feedback: none, fp16, 2bit[:T] (MXNet's, T=0.5), 1bit, "
                                 "topk:K, powersgd:R (manual_dp/fast/compress.py)", "parallelism")
    link: Optional[str] = flag(None, "emulate this link between the CPU contexts: every transfer of the "
                                     "all-reduce takes latency + bytes / bandwidth, hop by hop, on the engine: "
                                     "pcie3, pcie4, nvlink, eth1, eth10, eth100, ib or GBPS,LATENCY_US "
                                     "(manual_dp/links.py states each preset's source)", "parallelism",
                               metavar="NAME|GBPS,LATENCY_US")
    straggler: Optional[str] = flag(None, "sync, async, local: context I's forward and backward take FACTOR times as "
                                          "long (a delay on the engine after its backward, FACTOR - 1 times its "
                                          "compute as measured on the first steps; manual_dp/strategies/"
                                          "wrappers/straggler.py)", "parallelism", metavar="I:FACTOR")
    no_autotune: bool = flag(False, "sync only: do not measure which padding "
                                    "of the convolutions' channels is fastest on this CPU "
                                    "(manual_dp/fast/autotune.py); use none ($MANUAL_DP_CONV_PAD names one)",
                             "parallelism")
    check_replicas: Optional[int] = flag(None, "every N updates, compare checksums of every copy of the "
                                               "parameters (contexts, stages, processes); stop at the first "
                                               "difference", "parallelism")
    dry_run: bool = flag(False, "print the layout (the mesh and its groups; for a pipeline the schedule's "
                                "timeline, the micro-batches each stage holds at its peak and the bubble) and "
                                "stop before loading data or training", "parallelism")
    precision: str = flag("fp32", "bf16, fp16: products (matrix multiplies, convolutions) in that precision, "
                                  "float32 master weights and optimiser; fp16 with a dynamic loss scale "
                                  "(manual_dp/precision.py)", "precision", choices=PRECISIONS)
    loss_scale: Optional[float] = flag(None, f"fp16 only: the loss scale to start from (default {LOSS_SCALE['loss_scale']:g}); "
                                             "halved on every overflow, the update skipped", "precision")
    scale_window: Optional[int] = flag(None, f"fp16 only: good updates in a row before the loss scale doubles "
                                             f"(default {LOSS_SCALE['scale_window']})", "precision")
    epochs: int = flag(10, "passes over the training set", "optimisation")
    batch_size: int = flag(256, "global batch, split over the contexts", "optimisation")
    grad_accum: int = flag(1, "batches per update", "optimisation")
    lr: float = flag(0.05, "learning rate", "optimisation")
    scale_lr: str = flag("none", "linear: lr x batch-size x grad-accum / 256 (Goyal et al.)",
                         "optimisation", choices=("none", "linear"))
    warmup_epochs: float = flag(0.0, "ramp the lr up linearly over this many epochs, per update",
                                "optimisation")
    optimizer: str = flag("momentum", "update rule (momentum: SGD with momentum 0.9)", "optimisation",
                          choices=OPTIMIZERS)
    clip_norm: Optional[float] = flag(None, "scale the gradient by min(1, C / its global L2 norm) before every "
                                            "update, every parameter counted once in any layout; the norm is "
                                            "logged per epoch either way (manual_dp/strategies/clipping.py)", "optimisation")
    seed: int = flag(0, "seeds the initial weights and the data order", "optimisation")
    checkpoint_dir: Optional[str] = flag(None, "save a checkpoint here at the end of every epoch, and the run's "
                                               "resolved settings in DIR/config.toml (for --config)",
                                         "checkpoints", metavar="DIR")
    resume: bool = flag(False, "continue from --checkpoint-dir (mid-epoch too: from the batch after its last update)",
                        "checkpoints")
    checkpoint_every: int = flag(0, "also save a checkpoint after every N updates, mid-epoch (0: at the end of "
                                    "each epoch only)", "checkpoints", metavar="N")
    max_steps: int = flag(0, "end the run after N updates in all, its checkpoint written (0: no limit); "
                             "--resume with a larger N goes on", "checkpoints", metavar="N")
    async_checkpoint: bool = flag(False, "write checkpoints from a thread of their own: the step copies the "
                                         "state to the host and training goes on", "checkpoints")
    log_json: Optional[str] = flag(None, "write one JSON object per epoch to this file, and the run's resolved "
                                         "settings to PATH.config.toml (for --config)", "output",
                                   metavar="PATH")
    digests: Optional[str] = flag(None, "write, per update, a digest, sum and norm of every gradient, parameter "
                                        "and optimiser-state tensor to this file; compare two runs with "
                                        "python -m manual_dp.diverge A B", "output")
    trace: Optional[str] = flag(None, "sync only: record a few steps (MXNet's profiler and the "
                                      "trainer's spans) as a Chrome trace to this file; draw it with "
                                      "python -m manual_dp.timeline", "output")
    no_progress: bool = flag(False, "no progress bar, even on a terminal", "output")
    backend: str = flag("local", "local: this process alone; horovod: under horovodrun; dist_sync, "
                                 "dist_async: MXNet's parameter-server KVStore under python -m "
                                 "manual_dp.launch", "processes",
                        choices=BACKENDS)
    timeout: float = flag(120.0, "seconds without progress after which a process of a multi-process "
                                 "job gives up", "processes")
    flight_record: Optional[str] = flag(None, "every process writes its flight record (its last collectives) "
                                              "to DIR/flight-RANK.json at the end of the run and when it fails; "
                                              "python -m manual_dp.flight DIR names where the ranks part. Without "
                                              "it a failing job (watchdog, signal, failed collective) writes them "
                                              "to TMPDIR/manual_dp-flight-JOB, named in its error line",
                                        "processes", metavar="DIR")


# Mode defaults (which modes each mode-specific flag applies to: manual_dp/modes.py's table).
MODE_DEFAULTS = {"staleness": 0, "micro_batches": 4, "stages": STAGES, "schedule": "gpipe", "zero_stage": 1,
                 "sync_every": 4, "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.9,
                 "attention": "ring", "tensor_pieces": TENSOR_PIECES,
                 "sequence_pieces": SEQUENCE_PIECES}
# Flags whose default holds only in some of the modes they apply to (elsewhere: off unless given).
DEFAULT_ONLY_IN = {"zero_stage": ("zero",), "tensor_pieces": ("tensor", "mesh"), "sequence_pieces": ("context",)}      # tensor, context and mesh: ZeRO over the data dimension if asked
# The model each size flag applies to (given for another: refused), and its default there.
MODEL_APPLIES = {"width": ("lenet", "mlp", "resnet"), "layers": ("transformer", "lstm", "gpt"),
                 "d_model": ("transformer", "lstm", "gpt"), "heads": ("transformer", "gpt"), "patch": ("transformer",)}
# Settings that must match for --resume to continue the same run.
RUN_KEYS = ("model", "layers", "d_model", "heads", "patch", "dropout", "sync_batchnorm", "clip_norm", "precision",
            "scale_window", "batch_size", "lr", "optimizer", "init_scale", "seed", "width", "train_size", "test_size",
            "mode", "staleness", "micro_batches", "grad_accum", "scale_lr", "warmup_epochs",
            "sync_every", "outer_optimizer", "outer_lr", "outer_momentum", "compress", "data", "seq_len", "vocab",
            "experts", "top_k", "capacity_factor", "aux_loss_coef")

# Settings a checkpoint keeps that only fix the order of --deterministic's sums: --resume goes on
# when they differ, and says that the bits of the run saved will not be met.
ORDER_KEYS = ("deterministic", "tensor_pieces", "sequence_pieces", "perturb")

# Keys added to RUN_KEYS after checkpoints were written without them: their value in those runs.
DEFAULTS_OF_NEWER_KEYS = {"model": "lenet", "layers": None, "d_model": None, "heads": None, "patch": None,
                          "dropout": 0.0,
                          "sync_batchnorm": False, "clip_norm": None, "precision": "fp32", "scale_window": None,
                          "width": 1, "sync_every": None, "outer_optimizer": None, "outer_lr": None,
                          "outer_momentum": None, "compress": "none", "data": "fashion-mnist", "seq_len": None,
                          "vocab": None, "experts": 0, "top_k": 1, "capacity_factor": "1.25", "aux_loss_coef": 0.01}


def fields():
    """RunConfig's fields, in the order --help lists them."""
    return dataclasses.fields(RunConfig)


def device_request(cfg):
    """("gpu", n) or ("cpu", n): the devices --gpus/--cpus name; by default every GPU that MXNet
    will see, else DEFAULT_CPU_CONTEXTS CPU contexts. Decided without loading MXNet."""
    if cfg.gpus is not None:
        return "gpu", cfg.gpus
    if cfg.cpus is not None:
        return "cpu", cfg.cpus
    n = visible_gpus()
    return ("gpu", n) if n else ("cpu", DEFAULT_CPU_CONTEXTS)


# --compress: name -> (what its argument is, its default; None: no argument, required: must be given)
COMPRESSORS = {"none": None, "fp16": None, "2bit": (float, 0.5), "1bit": None,
               "topk": (int, "required"), "powersgd": (int, "required")}
GATHERED = ("fp16", "2bit", "1bit", "topk")     # cannot be summed compressed: gathered instead


