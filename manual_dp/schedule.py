"""Learning-rate schedules, per update: Goyal et al.'s linear scaling rule and linear warm-up.

The training loop accepts `lr` as a float or as a callable of t, the number of updates taken so
far (t = 0 for the first update); `lr_at` reads either.
"""
import math
from dataclasses import dataclass

REFERENCE_BATCH = 256


def scaled_lr(lr, global_batch, rule="none"):
    """The rate for `global_batch`: under "linear", lr * global_batch / 256 (Goyal et al., 2017)."""
    if rule == "linear":
        return lr * global_batch / REFERENCE_BATCH
    if rule == "none":
        return lr
    raise ValueError(f"unknown lr scaling rule {rule!r}")


@dataclass(frozen=True)
class Warmup:
    """lr(t) = peak * (t + 1) / steps for the first `steps` updates, then peak: a linear ramp."""
    peak: float
    steps: int

    def __call__(self, t):
        return self.peak * min(1.0, (t + 1) / self.steps)


def updates_per_epoch(n_examples, batch_size, grad_accum=1):
    """Updates in one epoch: one per `grad_accum` batches, the last window possibly short."""
    return math.ceil(math.ceil(n_examples / batch_size) / grad_accum)


def make_lr(lr, global_batch, rule="none", warmup_epochs=0.0, n_updates_per_epoch=1):
    """The loop's `lr`: the scaled rate, ramped up over `warmup_epochs` epochs if that is > 0."""
    peak = scaled_lr(lr, global_batch, rule)
    steps = round(warmup_epochs * n_updates_per_epoch)
    return Warmup(peak, steps) if steps > 0 else peak


def lr_at(lr, t):
    """The rate of update t (from 0): `lr` itself, or lr(t) if it is a schedule."""
    return lr(t) if callable(lr) else lr
