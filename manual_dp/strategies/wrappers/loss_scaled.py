"""fp16's loss scale around any strategy (manual_dp.precision): the scale the gradients carry goes
to the strategy's NormLog (which unscales, and skips an update whose gradient overflowed), and into
checkpoints, so that a resumed run continues from the same scale."""
from ...errors import CheckpointError
from ..base import Wrapper


class LossScaled(Wrapper):
    """`model` whose updates divide by `scaler.scale` (precision.LossScale) and skip on overflow."""

    def __init__(self, model, scaler):
        super().__init__(model)
        self.scaler = scaler

    def clip(self, clip_norm, scaler=None):
        self.model.clip(clip_norm, self.scaler)
        return self

    def state_dict(self):
        state = self.model.state_dict()
        return dict(state, extra=dict(state.get("extra", {}), loss_scale=[self.scaler.state()]))

    def load_state_dict(self, state):
        extra = dict(state.get("extra", {}))
        if "loss_scale" not in extra:
            raise CheckpointError("the checkpoint holds no fp16 loss scale: it was not written by an fp16 run")
        self.scaler.load(extra.pop("loss_scale")[0])
        self.model.load_state_dict(dict(state, extra=extra))
