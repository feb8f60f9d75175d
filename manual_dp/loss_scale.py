"""fp16's dynamic loss scale (manual_dp.precision): the gradient leaving the loss is multiplied by
the scale S, an update divides by S, and a gradient with an inf or NaN skips the update and halves
S; after `window` good updates S doubles. When the model no longer trains, it says so: the scale
below MIN_SCALE, every update of an epoch skipped after the model had trained, or a run none of
whose updates was applied."""
import numpy as np

from .errors import CheckpointError, DivergedError

MIN_SCALE = 2.0 ** -24                          # below it fp16's smallest step: scaling cannot rescue


class LossScale:
    """fp16's dynamic loss scale: `scale` multiplies the loss's gradient; `update(finite)` after
    every reduced gradient: True to apply it, False to skip (then the scale halves); `window` good
    updates in a row double it. DivergedError once the scale falls below MIN_SCALE, or when every
    update of an epoch is skipped after the model had trained (epoch_stats). Before the first
    applied update the scale is still coming down from its start (a --loss-scale of 1e30 skips
    for a hundred updates): a run that ends so has not trained, which `untrained` says."""

    def __init__(self, scale=2.0 ** 16, window=200):
        self.scale, self.window, self.good, self.skipped = float(scale), int(window), 0, 0
        self.applied = 0                                   # updates applied in the run, checkpointed
        self.epoch_skipped = self.epoch_applied = 0

    def update(self, finite):
        if finite:
            self.good += 1
            self.applied += 1
            self.epoch_applied += 1
            if self.good == self.window:
                self.scale, self.good = self.scale * 2, 0
            return True
        self.scale, self.good = self.scale / 2, 0
        self.skipped += 1
        self.epoch_skipped += 1
        if self.scale < MIN_SCALE:
            raise DivergedError(f"fp16 gradients overflow at every loss scale (down to {self.scale:.3g}): "
                                f"the run diverged; try --precision bf16 or a lower --lr")
        return False

    def epoch_stats(self):
        """{"loss_scale", "skipped_steps"} (skipped since the last call), for the epoch's record;
        DivergedError if every update since the last call overflowed and was skipped, after the
        model had trained."""
        if self.epoch_skipped and not self.epoch_applied and self.applied:
            raise DivergedError(f"every update of the epoch ({self.epoch_skipped}) overflowed fp16 and was skipped "
                                f"after the model had trained, the loss scale halved down to {self.scale:g}")
        out = {"loss_scale": self.scale, "skipped_steps": self.epoch_skipped}
        self.epoch_skipped = self.epoch_applied = 0
        return out

    def untrained(self):
        """What to say of a run none of whose updates was applied (every one overflowed), or None."""
        if self.skipped and not self.applied:
            return (f"every update of the run ({self.skipped}) overflowed fp16 and was skipped, the loss scale "
                    f"halved down to {self.scale:g}: the model has not trained (a lower --loss-scale starts nearer)")
        return None

    def state(self):
        return np.array([self.scale, self.good, self.skipped, self.applied], dtype=np.float64)

    def load(self, values):
        """The state of `state()` (a checkpoint's; one of three values, from before `applied` was
        kept, counts as trained); CheckpointError for values no scale can hold."""
        values = np.asarray(values, dtype=np.float64).ravel()
        counts = values[1:]
        if len(values) not in (3, 4) or not np.isfinite(values).all() or values[0] <= 0 or (counts < 0).any() \
                or (counts != np.floor(counts)).any():
            raise CheckpointError(f"its fp16 loss scale state {values.tolist()[:4]} is no scale and counts")
        self.scale, self.good, self.skipped = float(values[0]), int(values[1]), int(values[2])
        self.applied = int(values[3]) if len(values) == 4 else 1
