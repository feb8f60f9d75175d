"""--compress: data parallelism whose all-reduce sends compressed gradients with error feedback.

The compression itself is an all-reduce (manual_dp.fast.compress, manual_dp.fast.powersgd) handed
to DataParallel like any other; this wrapper owns what that all-reduce keeps between steps, the
residual of every replica (and PowerSGD's Q), so that they are counted in the memory report,
saved in state_dict()["extra"] and restored by load_state_dict, and reports the bytes each
replica sends per update.

In a job of several processes each keeps its own replicas' residuals; at the end of every epoch
they are gathered (every rank takes part), so that rank 0's checkpoint holds all of them in the
order of the global replicas. A checkpoint saved with another number of replicas gives the sum of
its residuals (what is still owed to the parameters) to the first replica.
"""
import numpy as np

from ...fast.compress import gather_bytes
from ..base import Wrapper


class Compressed(Wrapper):
    """`model` (a DataParallel with fused gradients) whose all-reduce is `reducer`; `label` names
    the compression (e.g. "2bit:0.5"); `world` the process's place in the job (None: alone)."""

    def __init__(self, model, reducer, label, world=None):
        if not getattr(model, "flat", None):
            raise ValueError("gradient compression needs fused gradients (one flat buffer per replica)")
        super().__init__(model)
        self.reducer, self.label, self.world, self.gathered = reducer, label, world, None
        reducer.prepare([f.grad for f in model.flat])

    @property
    def size(self):
        return self.world.size if self.world is not None else 1

    @property
    def rank(self):
        return self.world.rank if self.world is not None else 0

    def end_epoch(self, lr):
        """The model's end of epoch; then every process's residuals gathered (several processes)."""
        extras = self.model.end_epoch(lr)
        if self.size > 1:
            self.gathered = self.gather_state()
        n = self.reducer.residuals[0].size
        return {**extras, "compress": self.label,
                "compress_bytes_per_step": self.reducer.bytes_per_replica(), "fp32_bytes_per_step": 4 * n}

    def gather_state(self):
        """The reducer's state with the residuals of every replica of every process, in order."""
        state = self.reducer.state()
        mine = state["residual"]
        home = self.reducer.residuals[0].context
        data = gather_bytes(self.world, b"".join(r.astype(np.float32).tobytes() for r in mine),
                            f"compress.residuals.{len(mine)}x{mine[0].size}", home)
        every = [np.frombuffer(d, dtype=np.float32).reshape(len(mine), -1) for d in data]
        return dict(state, residual=[row.copy() for rows in every for row in rows])

    def arrays(self):
        arrays = self.model.arrays()
        held = list(self.reducer.residuals) + [q for Q in getattr(self.reducer, "Q", []) for q in Q]
        return {"param": arrays["param"], "state": arrays["state"] + held}

    def state_dict(self):
        """The model's state; its "extra" adds "residual" (one per global replica; in a job of
        several processes, as gathered at the last end of epoch) and the reducer's other state."""
        state = self.model.state_dict()
        mine = self.gathered if self.size > 1 and self.gathered else self.reducer.state()
        return dict(state, extra={**state.get("extra", {}), **mine})

    def load_state_dict(self, state):
        self.model.load_state_dict(state)
        extra = state.get("extra", {})
        k, n = len(self.reducer.residuals), self.reducer.residuals[0].size
        saved, first = extra.get("residual"), self.rank * k
        zero = np.zeros(n, dtype=np.float32)
        if not saved:
            mine = [zero] * k
        elif len(saved) == k * self.size:
            mine = list(saved[first:first + k])
        else:                                    # another replica count: the sum to replica 0
            total = np.sum(saved, axis=0, dtype=np.float32)
            mine = [total if first + i == 0 else zero for i in range(k)]
        if any(np.shape(r) != (n,) for r in mine):
            raise ValueError(f"the checkpoint's residuals do not have this run's {n} gradients")
        self.reducer.load(dict(extra, residual=mine))
        self.gathered = None
