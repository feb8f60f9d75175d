"""manual_dp: parallel training on MXNet device contexts, written by hand.

The names of `__all__` (_EXPORTS, after this docstring) are imported lazily, so `import manual_dp`
loads no MXNet; it does one thing: put the thread settings for the default devices in the
environment before MXNet loads (manual_dp.fast.runtime.on_import), so that a notebook runs as fast
as the command line.

Read it in this order (each folder's docstring lists its own files in reading order):

    lesson.py         the lesson, "multiple GPUs from scratch", top to bottom: everything else builds on it
    strategies/       the strategy contract (base.py), one folder per parallel dimension, the wrappers
    models/           the model contract (contract.py) and the models every strategy can train
    fast/             the same step, faster: collectives, flat buffers, the cached graph, thread settings
    errors.py         the errors a run can end with, for the library and the command line alike
    config.py         every default of a training run, in one place: RunConfig
    modes/            the one table of modes: each mode's flags, build, refusals, header line and mesh
    checks.py         the checks of a run's settings that need no device, file or MXNet
    optim.py          optimisers written by hand: state per parameter, living where the parameter lives
    schedule.py       learning-rate schedules, per update: linear scaling and linear warm-up
    precision.py      mixed precision: float32 master weights, products in bf16 or fp16, fp16's loss scale
    loss_scale.py     fp16's dynamic loss scale: skipped overflows, and when the model no longer trains
    mesh.py           an N-D device mesh: the contexts as a grid whose dimensions are kinds of parallelism
    datasets/         the data contract and every --data: Fashion-MNIST, the fortunes, the user's arrays
    loop.py           the training loop around any strategy: epochs of steps, evaluation, a record per epoch
    checkpoint.py     checkpoints: everything needed to continue a run, checked as a whole when read back
    checkpoint_fields.py  what each field of a checkpoint's metadata may hold, checked before it is used
    replicas.py       are the replicas still identical? checksums of every copy of every parameter
    memory.py         bytes per context: the peak one training step holds on each context, by kind
    digests.py        --digests FILE: per update, a fingerprint of every gradient, parameter and state
    diverge.py        `python -m manual_dp.diverge A B`: where two runs part, from their --digests files
<<<<<<< HEAD
    perturb.py        --perturb KIND:SEED: a run nudged by one ulp, or its batches' rows reshuffled
    yardstick.py      `python -m manual_dp.yardstick -- FLAGS`: how far rounding alone moves a run; a gap judged
=======
    ledger.py         --ledger FILE: per update, where an MoE GPT routed every token; diverge compares two
>>>>>>> moe
    replay/           `diverge A B --replay`: where inside one update two runs part
    cli/              the command line around the library: flags, one run, its output
    train.py          `python -m manual_dp.train [flags]`: train from the command line
    sample.py         `python -m manual_dp.sample DIR`: text from a trained language model's checkpoint
    multiprocess/     more than one process: Horovod, MXNet's parameter server, the launcher
    launch.py         `python -m manual_dp.launch [options] -- COMMAND...` (multiprocess/launcher, elastic)
    flight.py         `python -m manual_dp.flight DIR`: where the ranks of a job part, from flight records
    measure.py        measuring all-reduce: microseconds and GB/s beside the copy bound and the memory floor
    flops.py          how much arithmetic LeNet needs, and how much this machine can do
    costmodel.py      cost model of a data-parallel step: compute, then an all-reduce over links
    costmodel_cpu.py  cost model of an all-reduce over the CPU contexts of one machine
    links.py          --link's presets (with sources) priced by the cost model, and --straggler's value
    minimax.py        the best fit by the worst error: a small linear programme
    timeline.py       `python -m manual_dp.timeline TRACE -o timeline.png`: a --trace as a Gantt chart
    tracefile.py      a --trace file read back for the timeline, checked before any of it is used
    jsonfile.py       a JSON document read from a path that may hold anything: bounded, a regular file
    bench/            `python -m manual_dp.bench` and its siblings: measurements side by side
    plan.py           `python -m manual_dp.plan`: every layout of N devices, predicted; the fastest that fits
    planner/          the planner's layouts, predictions, table and --verify
"""
import importlib

from . import config as _config
from .fast import runtime as _runtime

__version__ = "0.2.0"

_EXPORTS = {
    "lesson": ["LENET_SHAPES", "init_lenet_params", "lenet", "cross_entropy", "get_params",
               "split_and_load", "allreduce", "sgd", "train_batch"],
    "config": ["RunConfig"],
    "datasets.fashion_mnist": ["load_fashion_mnist"],
    "datasets.contract": ["batches"],
    "strategies.base": ["Strategy"],
    "strategies.data.data_parallel": ["DataParallel"],
    "strategies.wrappers.accum": ["GradAccum"],
    "strategies.data.async_dp": ["AsyncDataParallel", "last_refresh"],
    "strategies.pipeline.pipeline": ["PipelineParallel"],
    "strategies.pipeline.stages": ["conv_stage", "dense_stage", "split_params", "send"],
    "strategies.pipeline.schedules": ["gpipe_schedule", "bubble_fraction"],
    "fast.collectives": ["ALLREDUCE_ALGORITHMS", "make_allreduce"],
    "strategies.tensor.tensor": ["TensorParallel"],
    "loop": ["fit", "evaluate"],
    "schedule": ["make_lr", "scaled_lr", "Warmup", "lr_at", "updates_per_epoch"],
    "memory": ["per_context", "measure"],
    "strategies.zero.zero": ["ZeroRedundancy"],
    "strategies.zero.zero_mixed": ["MixedZero"],
    "strategies.data.local_sgd": ["LocalSGD"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


_runtime.on_import(0 if _runtime.visible_gpus() else _config.DEFAULT_CPU_CONTEXTS)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'manual_dp' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)


def __dir__():
    return __all__ + ["__version__"]
