"""manual_dp: parallel training of LeNet on MXNet, written by hand.

Read it in this order (the README has the whole path): lesson, strategies/base, strategies/
data/, fast/, the other strategies' folders, loop, cli/, multiprocess/. The names below are
imported lazily, so `import manual_dp` loads no MXNet; it does one thing: put the thread settings
for the default devices in the environment before MXNet loads (manual_dp.fast.runtime.on_import),
so that a notebook runs as fast as the command line.
"""
import importlib

from . import config as _config
from .fast import runtime as _runtime

__version__ = "0.2.0"

_EXPORTS = {
    "lesson": ["LENET_SHAPES", "init_lenet_params", "lenet", "cross_entropy", "get_params",
               "split_and_load", "allreduce", "sgd", "train_batch"],
    "config": ["RunConfig"],
    "data": ["load_fashion_mnist", "batches"],
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
