"""Model, pipeline and hybrid parallelism: LeNet's stages on different contexts, copied across by hand."""
import numpy as np
from mxnet import autograd, nd

from ..config import FAST_STEP, RunConfig
from ..fast.collectives import make_allreduce
from ..lesson import LENET_SHAPES, cross_entropy, n_correct, shard_sizes, split_and_load
from ..optim import apply_update_and_clear, init_states
from ..replicas import fingerprint
from .base import Strategy
from .data_parallel import host_state, load_into
from .stages import STAGE_SLICES, STAGES, bubble_fraction, gpipe_schedule, send, split_params


def stage_params(params, ctx):
    """Copies of `params` on `ctx` whose gradients add up over backward passes until zeroed."""
    copies = [p.copyto(ctx) for p in params]
    for p in copies:
        p.attach_grad(grad_req="add")
    return copies


def cut(X, n):
    """X split along axis 0 into min(n, len(X)) micro-batches that differ in size by at most one."""
    ends = np.cumsum(shard_sizes(X.shape[0], min(n, X.shape[0])))
    return [X[int(a):int(b)] for a, b in zip(np.r_[0, ends[:-1]], ends)]


def run_schedule(Xs, ys, params, ctx):
    """One replica's GPipe pass over micro-batches Xs (on ctx[0]) and ys (on ctx[-1]).

    Afterwards params[s][i].grad holds (adds) the gradient of the loss summed over all micro-batches.
    Returns (loss sum, number correct) on the last stage's context.
    """
    last, M = len(STAGES) - 1, len(Xs)
    received = [[None] * M for _ in STAGES]   # received[s][m]: stage s's input for micro-batch m
    produced = [[None] * M for _ in STAGES]   # produced[s][m]: its output; the losses on the last stage
    metrics = []
    for tick in gpipe_schedule(len(STAGES), M):
        for phase, s, m in tick:
            if phase == "F":
                received[s][m] = Xs[m] if s == 0 else send(produced[s - 1][m], ctx[s])
                with autograd.record():
                    out = STAGES[s](received[s][m], params[s])
                    produced[s][m] = cross_entropy(out, ys[m]) if s == last else out
                if s == last:
                    metrics.append((produced[s][m].sum(), n_correct(out, ys[m])))
            elif s == last:
                produced[s][m].backward()
            else:  # the gradient crosses the boundary back, copied by hand
                produced[s][m].backward(received[s + 1][m].grad.copyto(ctx[s]))
            if phase == "B":   # stage s is done with micro-batch m: its activations can go
                produced[s][m] = None
                if s < last:
                    received[s + 1][m] = None
    return nd.add_n(*[l for l, _ in metrics]), nd.add_n(*[c for _, c in metrics])


class PipelineParallel(Strategy):
    """len(ctx) // 2 data-parallel replicas of a two-stage LeNet; replica r's stage s on ctx[2r + s].

    Two contexts and micro_batches=1: model parallelism. More micro-batches: a GPipe pipeline.
    More contexts: hybrid, data parallel over pipelines with gradients all-reduced per stage.
    Every variant takes the same step as one device on the whole batch.
    """

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, micro_batches=1, allreduce_fn=None):
        n = len(STAGES)
        if len(ctx) < n or len(ctx) % n:
            raise ValueError(f"{len(ctx)} contexts cannot be cut into {n}-stage pipelines")
        self.ctx, self.optimizer = list(ctx), optimizer
        self.allreduce_fn = allreduce_fn or make_allreduce(FAST_STEP["allreduce"])
        self.micro_batches = micro_batches
        self.grid = [self.ctx[r:r + n] for r in range(0, len(ctx), n)]   # grid[replica][stage]
        self.params = [[stage_params(P, c) for P, c in zip(split_params(params), row)]
                       for row in self.grid]
        self.states = [[init_states(P, optimizer) for P in row] for row in self.params]
        self.t, self.bubbles = 0, []

    def backward(self, X, y):
        """Every replica pipelines its shard of the batch; gradients add up where each stage lives."""
        firsts, lasts = [row[0] for row in self.grid], [row[-1] for row in self.grid]
        metrics = []
        for row, P, Xr, yr in zip(self.grid, self.params, split_and_load(X, firsts),
                                  split_and_load(y, lasts)):
            Xs, ys = cut(Xr, self.micro_batches), cut(yr, self.micro_batches)
            self.bubbles.append(bubble_fraction(gpipe_schedule(len(STAGES), len(Xs)), len(STAGES)))
            metrics.append(run_schedule(Xs, ys, P, row))
        return metrics

    def update(self, lr, n_examples):
        """Sum each stage's gradients over the replicas, then one optimiser step everywhere."""
        for s, P in enumerate(self.params[0]):
            for i in range(len(P)):
                self.allreduce_fn([row[s][i].grad for row in self.params])
        self.t += 1
        for row, row_states in zip(self.params, self.states):
            for P, S in zip(row, row_states):
                apply_update_and_clear(P, S, self.optimizer, lr, self.t, n_examples)

    def end_epoch(self, lr):
        """The mean bubble fraction of the epoch's schedules (idle share of stage time)."""
        stats = {"bubble_fraction": float(np.mean(self.bubbles))} if self.bubbles else {}
        self.bubbles = []
        return stats

    def correct(self, X, y):
        """Correct predictions on (X, y), sharded over the replicas, each through its stages."""
        rows = self.grid[:min(len(self.grid), X.shape[0])]
        counts = []
        for row, P, Xr, yr in zip(rows, self.params, split_and_load(X, [r[0] for r in rows]),
                                  split_and_load(y, [r[-1] for r in rows])):
            h = Xr
            for s, (stage, c) in enumerate(zip(STAGES, row)):
                h = stage(h if s == 0 else h.copyto(c), P[s])
            counts.append(n_correct(h, yr).copyto(self.ctx[0]))
        return nd.add_n(*counts)

    def fingerprints(self):
        """Per stage, the copy of every pipeline replica."""
        names = [name for name, _ in LENET_SHAPES]
        return {f"stage {s}": [fingerprint(row[s], P[s], names[sl]) for row, P in zip(self.grid, self.params)]
                for s, sl in enumerate(STAGE_SLICES)}

    def layout(self, batch_size):
        """(context, stage, examples whose activations it holds at the peak) for each placement.

        GPipe keeps every micro-batch's activations until its backward: the whole shard.
        """
        sizes = shard_sizes(batch_size, len(self.grid))
        return [(c, s, n) for row, n in zip(self.grid, sizes) for s, c in enumerate(row)]

    def arrays(self):
        """Every array this strategy keeps: {"param", "grad", "state"} (see Strategy.arrays)."""
        params = [p for row in self.params for P in row for p in P]
        state = [s for row in self.states for S in row for st in S for s in st]
        return {"param": params, "grad": [p.grad for p in params], "state": state}

    @property
    def min_batch(self):
        return len(self.grid)

    def state_dict(self):
        """Replica 0's parameters and optimiser state, in lenet's order."""
        return host_state([p for P in self.params[0] for p in P], [st for S in self.states[0] for st in S],
                          self.t)

    def load_state_dict(self, state):
        for row, row_states in zip(self.params, self.states):
            load_into([p for P in row for p in P], [st for S in row_states for st in S], state)
        self.t = state["t"]
