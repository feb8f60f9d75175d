"""manual_dp: data-parallel LeNet training on MXNet, written by hand.

Names are imported lazily, so `import manual_dp` does no work and `python -m manual_dp.train`
runs its module once.
"""
import importlib
import sys
import types

__version__ = "0.1.0"

_EXPORTS = {
    "load_fashion_mnist": "data", "batches": "data",
    "init_lenet_params": "model", "lenet": "model", "cross_entropy": "model",
    "get_params": "parallel", "split_and_load": "parallel", "allreduce": "parallel",
    "train_batch": "step", "DataParallel": "step",
    "ALLREDUCE_ALGORITHMS": "collectives", "make_allreduce": "collectives",
    "train": "train", "evaluate": "train",
    "AsyncDataParallel": "async_dp", "last_refresh": "async_dp", "PipelineParallel": "pipeline",
    "GradAccum": "accum", "SyncPhases": "accum",
    "conv_stage": "stages", "dense_stage": "stages", "split_params": "stages", "send": "stages",
    "gpipe_schedule": "stages", "bubble_fraction": "stages",
    "make_lr": "schedule", "scaled_lr": "schedule", "Warmup": "schedule", "lr_at": "schedule",
    "updates_per_epoch": "schedule", "per_context": "memory",
    "TwoLevelDataParallel": "distributed", "rank_rows": "distributed",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'manual_dp' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


def __dir__():
    return __all__ + ["__version__"]


class _Package(types.ModuleType):
    """Keeps `manual_dp.train` the function: importing the submodule `manual_dp.train` (the CLI)
    would otherwise rebind the package attribute to the module."""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and name in _EXPORTS and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
