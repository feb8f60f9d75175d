"""Model, pipeline and hybrid parallelism: a model's stages (runs of its layers) on different contexts, copied across by
hand, on GPipe's or 1F1B's schedule, optionally recomputing activations in the backward."""
import numpy as np
from mxnet import autograd, nd

from ..config import FAST_STEP, RunConfig
from ..fast.collectives import make_allreduce
from ..lesson import cross_entropy, n_correct, shard_sizes, split_and_load
from ..models import as_model, stateless
from ..optim import apply_update_and_clear, init_states
from ..replicas import fingerprint
from .base import Strategy
from .data_parallel import host_state, load_into
from ..memory import FLOAT_BYTES, part_activation_elems
from .schedules import bubble_fraction, held_peaks, schedule as schedule_ticks, stage_orders
from .stages import make_stages, param_slices, send, split_params


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


class ReplicaPass:
    """One replica's run of a schedule over micro-batches Xs (on ctx[0]) and ys (on ctx[-1]), action
    by action, counting the activation bytes each stage holds as it goes (`peak`).

    Afterwards params[s][i].grad holds (adds) the gradient of the loss summed over all micro-batches.
    recompute: a forward keeps only the stage's input; its backward runs the forward again, recorded.
    """

    def __init__(self, Xs, ys, params, ctx, stages, elems, recompute):
        self.Xs, self.ys, self.params, self.ctx, self.stages = Xs, ys, params, ctx, stages
        self.elems, self.recompute, self.last, M = elems, recompute, len(stages) - 1, len(Xs)
        self.received = [[None] * M for _ in stages]   # received[s][m]: stage s's input for micro-batch m
        self.produced = [[None] * M for _ in stages]   # produced[s][m]: its output; losses on the last stage
        self.held, self.peak, self.metrics = [0] * len(stages), [0] * len(stages), []

    def hold(self, s, nbytes):
        """Stage s holds nbytes more (fewer, if negative); its peak is kept."""
        self.held[s] += nbytes
        self.peak[s] = max(self.peak[s], self.held[s])

    def run_stage(self, s, m):
        """Stage s's forward on micro-batch m: its output, or on the last stage its losses (B,)."""
        out = self.stages[s](self.received[s][m], self.params[s])
        if s < self.last:
            return out
        losses = cross_entropy(out, self.ys[m])
        self.metrics.append((losses.sum(), n_correct(out, self.ys[m])))
        return losses

    def forward(self, s, m):
        """Stage s's forward on micro-batch m, recorded unless recomputed later."""
        self.received[s][m] = self.Xs[m] if s == 0 else send(self.produced[s - 1][m], self.ctx[s])
        if self.recompute:
            if s > 0:
                self.produced[s - 1][m] = None                          # copied: stage s - 1 drops it
            with autograd.train_mode():
                self.produced[s][m] = self.run_stage(s, m)
            self.hold(s, self.received[s][m].size * FLOAT_BYTES)     # the input alone stays
        else:
            with autograd.record():
                self.produced[s][m] = self.run_stage(s, m)
            self.hold(s, self.full_bytes(s, m))

    def full_bytes(self, s, m):
        """Bytes of every activation stage s's recorded forward on micro-batch m keeps."""
        return self.Xs[m].shape[0] * self.elems[s] * FLOAT_BYTES

    def backward(self, s, m):
        """Stage s's backward on micro-batch m; then it holds nothing of m."""
        if self.recompute:
            self.hold(s, self.full_bytes(s, m))                        # recomputed, for one backward
            with autograd.record():
                out = self.stages[s](self.received[s][m], self.params[s])
                self.produced[s][m] = cross_entropy(out, self.ys[m]) if s == self.last else out
            self.hold(s, -self.full_bytes(s, m) - self.received[s][m].size * FLOAT_BYTES)
        else:
            self.hold(s, -self.full_bytes(s, m))
        if s == self.last:
            self.produced[s][m].backward()
        else:  # the gradient crosses the boundary back, copied by hand
            self.produced[s][m].backward(self.received[s + 1][m].grad.copyto(self.ctx[s]))
        self.produced[s][m] = None
        if s < self.last:
            self.received[s + 1][m] = None

    def run(self, ticks):
        """Every action of `ticks`; returns (loss sum, number correct) on the last stage's context."""
        for tick in ticks:
            for phase, s, m in tick:
                (self.forward if phase == "F" else self.backward)(s, m)
        return nd.add_n(*[l for l, _ in self.metrics]), nd.add_n(*[c for _, c in self.metrics])


class PipelineParallel(Strategy):
    """len(ctx) // S data-parallel replicas of an S-stage model; replica r's stage s on ctx[S r + s].

    S contexts and micro_batches=1: model parallelism. More micro-batches: a pipeline, on GPipe's
    or 1F1B's schedule. More contexts: hybrid, data parallel over pipelines with gradients
    all-reduced per stage. recompute: activations dropped in the forward, recomputed in the backward.
    Every variant takes the same step as one device on the whole batch. model: the network
    (manual_dp.models; None: the lesson's LeNet of the parameters' width), cut by Model.cuts.
    """

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, micro_batches=1, allreduce_fn=None,
                 stages=2, schedule="gpipe", recompute=False, model=None):
        self.net = stateless(as_model(model, params), "model, pipeline and hybrid parallelism")
        if not 1 <= stages <= len(self.net.layers) or len(ctx) < stages or len(ctx) % stages:
            raise ValueError(f"{len(ctx)} contexts cannot be cut into {stages}-stage pipelines "
                             f"of {self.net.name}'s {len(self.net.layers)} layers")
        stage_orders(schedule, stages, 1)                               # refuses an unknown schedule
        self.ctx, self.optimizer = list(ctx), optimizer
        self.allreduce_fn = allreduce_fn or make_allreduce(FAST_STEP["allreduce"])
        self.micro_batches, self.schedule, self.recompute = micro_batches, schedule, recompute
        self.stages, self.cuts = make_stages(stages, self.net), self.net.cuts(stages)
        self.elems = [part_activation_elems(pieces, model=self.net) for pieces in self.cuts]
        self.grid = [self.ctx[r:r + stages] for r in range(0, len(ctx), stages)]   # grid[replica][stage]
        self.params = [[stage_params(P, c) for P, c in zip(split_params(params, stages, self.net), row)]
                       for row in self.grid]
        self.states = [[init_states(P, optimizer) for P in row] for row in self.params]
        self.t, self.bubbles, self.peaks = 0, [], {}

    def backward(self, X, y):
        """Every replica pipelines its shard of the batch; gradients add up where each stage lives.
        Afterwards self.peaks[context] is the most activation bytes it held at once, so far."""
        firsts, lasts = [row[0] for row in self.grid], [row[-1] for row in self.grid]
        metrics = []
        for row, P, Xr, yr in zip(self.grid, self.params, split_and_load(X, firsts),
                                  split_and_load(y, lasts)):
            Xs, ys = cut(Xr, self.micro_batches), cut(yr, self.micro_batches)
            ticks = schedule_ticks(self.schedule, len(self.stages), len(Xs))
            self.bubbles.append(bubble_fraction(ticks, len(self.stages)))
            run = ReplicaPass(Xs, ys, P, row, self.stages, self.elems, self.recompute)
            metrics.append(run.run(ticks))
            for c, peak in zip(row, run.peak):
                self.peaks[str(c)] = max(self.peaks.get(str(c), 0), peak)
        return metrics

    def update(self, lr, n_examples):
        """Sum each stage's gradients over the replicas, then one optimiser step everywhere."""
        for s, P in enumerate(self.params[0]):
            for i in range(len(P)):
                self.allreduce_fn([row[s][i].grad for row in self.params])
        self.t += 1
        n_examples = self.counted(n_examples)
        for row, row_states in zip(self.params, self.states):
            for P, S in zip(row, row_states):
                apply_update_and_clear(P, S, self.optimizer, lr, self.t, n_examples)

    def reduced_grads(self):
        """The first replica's stages' gradients, in the model's order."""
        return [p.grad for P in self.params[0] for p in P]

    def end_epoch(self, lr):
        """The mean bubble fraction of the epoch's schedules (idle share of stage time), and the
        activation bytes each context held at its peak, counted as the schedules ran."""
        stats = {"bubble_fraction": float(np.mean(self.bubbles))} if self.bubbles else {}
        if self.peaks:
            stats["activation_peak_bytes"] = dict(self.peaks)
        self.bubbles, self.peaks = [], {}
        return stats

    def correct(self, X, y):
        """Correct predictions on (X, y), sharded over the replicas, each through its stages."""
        rows = self.grid[:min(len(self.grid), X.shape[0])]
        counts = []
        for row, P, Xr, yr in zip(rows, self.params, split_and_load(X, [r[0] for r in rows]),
                                  split_and_load(y, [r[-1] for r in rows])):
            h = Xr
            for s, (stage, c) in enumerate(zip(self.stages, row)):
                h = stage(h if s == 0 else h.copyto(c), P[s])
            counts.append(n_correct(h, yr).copyto(self.ctx[0]))
        return nd.add_n(*counts)

    def fingerprints(self):
        """Per stage, the copy of every pipeline replica."""
        names = self.net.names()
        return {f"stage {s}": [fingerprint(row[s], P[s], names[sl]) for row, P in zip(self.grid, self.params)]
                for s, sl in enumerate(param_slices(len(self.stages), self.net))}

    def layout(self, batch_size):
        """(context, part, examples whose activations of `part` it holds at the peak) per placement
        (part: the stage's pieces, or ("input", first piece) under recompute; manual_dp.memory).

        GPipe keeps every micro-batch's activations until its backward: the whole shard; 1F1B at
        most S - s micro-batches on stage s. Recompute keeps those micro-batches' stage inputs and
        the activations of one micro-batch, while its backward runs.
        """
        out = []
        for row, n in zip(self.grid, shard_sizes(batch_size, len(self.grid))):
            sizes = shard_sizes(n, min(self.micro_batches, n))
            held = held_peaks(schedule_ticks(self.schedule, len(row), len(sizes)), len(row), sizes)
            for c, pieces, h in zip(row, self.cuts, held):
                out += ([(c, ("input", pieces[0]), h), (c, pieces, max(sizes))] if self.recompute
                        else [(c, pieces, h)])
        return out

    def arrays(self):
        """Every array this strategy keeps: {"param", "grad", "state"} (see Strategy.arrays)."""
        params = [p for row in self.params for P in row for p in P]
        state = [s for row in self.states for S in row for st in S for s in st]
        return {"param": params, "grad": [p.grad for p in params], "state": state}

    @property
    def min_batch(self):
        return len(self.grid)

    def state_dict(self):
        """Replica 0's parameters and optimiser state, in the model's order."""
        return host_state([p for P in self.params[0] for p in P], [st for S in self.states[0] for st in S],
                          self.t)

    def load_state_dict(self, state):
        for row, row_states in zip(self.params, self.states):
            load_into([p for P in row for p in P], [st for S in row_states for st in S], state)
        self.t = state["t"]
