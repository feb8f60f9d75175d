"""Model, pipeline and hybrid parallelism: a model's stages (runs of its layers) on different contexts, copied across by
hand, on a schedule of manual_dp.strategies.schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1), optionally
recomputing activations in the backward."""
from time import perf_counter

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
from .schedules import bubbles, check_micro, check_name, held, plan, run_order, simulate
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
    by action, counting the activation bytes each device holds as it goes (`peak`). Stage s runs on
    ctx[s], device s % n_devices (interleaved: several stages a device).

    Afterwards params[s][i].grad holds (adds) the gradient of the loss summed over all micro-batches.
    recompute: a forward keeps only the stage's input; its backward runs the forward again, recorded.
    measure: each action timed between nd.waitall()s, in `durations` (seconds, by (phase, stage)).
    """

    def __init__(self, Xs, ys, params, ctx, stages, elems, recompute, n_devices=None, measure=False):
        self.Xs, self.ys, self.params, self.ctx, self.stages = Xs, ys, params, ctx, stages
        self.elems, self.recompute, self.last, M = elems, recompute, len(stages) - 1, len(Xs)
        self.n_devices = n_devices or len(stages)
        self.received = [[None] * M for _ in stages]   # received[s][m]: stage s's input for micro-batch m
        self.produced = [[None] * M for _ in stages]   # produced[s][m]: its output; losses on the last stage
        self.held, self.peak, self.metrics = [0] * self.n_devices, [0] * self.n_devices, []
        self.durations = {} if measure else None

    def hold(self, s, nbytes):
        """Stage s's device holds nbytes more (fewer, if negative); its peak is kept."""
        d = s % self.n_devices
        self.held[d] += nbytes
        self.peak[d] = max(self.peak[d], self.held[d])

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

    def rerun(self, s, m):
        """Recompute: stage s's forward on micro-batch m again, recorded (its metrics counted once)."""
        self.hold(s, self.full_bytes(s, m))
        with autograd.record():
            out = self.stages[s](self.received[s][m], self.params[s])
            self.produced[s][m] = cross_entropy(out, self.ys[m]) if s == self.last else out

    def backward(self, s, m):
        """Stage s's backward on micro-batch m; then it holds nothing of m."""
        if self.recompute:
            self.rerun(s, m)                                           # recomputed, for one backward
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

    def act(self, phase, s, m):
        """Runs one action: "F" forward, "B" backward (SplitPass: B and W)."""
        (self.forward if phase == "F" else self.backward)(s, m)

    def run(self, actions):
        """Every (phase, stage, micro-batch) of `actions`, in order; returns (loss sum, number correct)
        on the last stage's context."""
        for action in actions:
            if self.durations is None:
                self.act(*action)
                continue
            nd.waitall()                                 # measuring: the action's own time only
            start = perf_counter()
            self.act(*action)
            nd.waitall()
            self.durations.setdefault(action[:2], []).append(perf_counter() - start)
        return nd.add_n(*[l for l, _ in self.metrics]), nd.add_n(*[c for _, c in self.metrics])

    def mean_durations(self):
        """{(phase, stage): mean seconds} of the measured actions."""
        return {k: float(np.mean(v)) for k, v in self.durations.items()}


class SplitPass(ReplicaPass):
    """ReplicaPass with the backward split as ZB-H1 asks: B, the gradient with respect to the stage's
    input only (what the previous stage waits for), sent back; W, later, the weight gradients from the
    same graph and the same output gradient, added into params[s][i].grad.

    What W costs here: MXNet's autograd.grad walks the stage's recorded graph from its output each
    time, so B runs the backward chain inside the stage (without the weight gradients' own ops) and
    W runs it again: the stage's backward is done once and a half, not once (a real ZB splits each
    operator, so that B + W cost one backward). The graph stays recorded from F until W: the stage
    holds all its activations until W, not only until B. Stage 0 has no input gradient: its B is
    empty (unless it recomputes), its W the whole backward.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        M = len(self.Xs)
        self.sent = [[None] * M for _ in self.stages]    # sent[s][m]: B's gradient of stage s's input
        self.heads = [[None] * M for _ in self.stages]   # heads[s][m]: the gradient of its output, for W

    def act(self, phase, s, m):
        {"F": self.forward, "B": self.backward_input, "W": self.weight}[phase](s, m)

    def backward_input(self, s, m):
        """B: the gradient of stage s's input for micro-batch m, kept for stage s - 1."""
        if self.recompute:
            self.rerun(s, m)                                           # kept until W
        if s < self.last:   # the gradient crosses the boundary back, copied by hand
            self.heads[s][m], self.sent[s + 1][m] = self.sent[s + 1][m].copyto(self.ctx[s]), None
        if s > 0:
            self.sent[s][m] = autograd.grad(self.produced[s][m], [self.received[s][m]], head_grads=self.heads[s][m],
                                            retain_graph=True)[0]

    def weight(self, s, m):
        """W: stage s's weight gradients for micro-batch m, added in; then it holds nothing of m."""
        P = self.params[s]
        for p, g in zip(P, autograd.grad(self.produced[s][m], P, head_grads=self.heads[s][m])):
            p.grad[:] += g
        self.hold(s, -self.full_bytes(s, m) - (self.received[s][m].size * FLOAT_BYTES if self.recompute else 0))
        self.produced[s][m] = self.received[s][m] = self.heads[s][m] = None


class PipelineParallel(Strategy):
    """len(ctx) // S data-parallel replicas of an S-device pipeline; replica r's device d is ctx[S r + d].

    S contexts and micro_batches=1: model parallelism. More micro-batches: a pipeline, on the
    schedule `schedule` ("gpipe", "1f1b", "interleaved", "zb-h1"; manual_dp.strategies.schedules).
    virtual_stages V (interleaved only): the model cut into S V stages, stage k on device k % S.
    More contexts: hybrid, data parallel over pipelines with gradients all-reduced per stage.
    recompute: activations dropped in the forward, recomputed in the backward. measure: every action
    timed (between nd.waitall()s), the schedule replayed with the measured durations: end_epoch's
    "bubble_measured". Every variant takes the same step as one device on the whole batch.
    model: the network (manual_dp.models; None: the lesson's LeNet of the parameters' width), cut by Model.cuts.
    """

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, micro_batches=1, allreduce_fn=None,
                 stages=2, schedule="gpipe", recompute=False, model=None, virtual_stages=1, measure=False):
        self.net = stateless(as_model(model, params), "model, pipeline and hybrid parallelism")
        if not 1 <= stages <= len(self.net.layers) or len(ctx) < stages or len(ctx) % stages:
            raise ValueError(f"{len(ctx)} contexts cannot be cut into {stages}-stage pipelines "
                             f"of {self.net.name}'s {len(self.net.layers)} layers")
        check_name(schedule, stages, max(micro_batches, 1), virtual_stages)   # unknown; V > 1 not interleaved
        check_micro(schedule, stages, micro_batches)
        n = stages * virtual_stages
        if n > len(self.net.layers):
            raise ValueError(f"{stages} devices x {virtual_stages} virtual stages need {n} layers; "
                             f"{self.net.name} has {len(self.net.layers)}")
        self.ctx, self.optimizer, self.S, self.V = list(ctx), optimizer, stages, virtual_stages
        self.allreduce_fn = allreduce_fn or make_allreduce(FAST_STEP["allreduce"])
        self.micro_batches, self.schedule, self.recompute, self.measure = micro_batches, schedule, recompute, measure
        self.stages, self.cuts = make_stages(n, self.net), self.net.cuts(n)
        self.elems = [part_activation_elems(pieces, model=self.net) for pieces in self.cuts]
        self.grid = [self.ctx[r:r + stages] for r in range(0, len(ctx), stages)]   # grid[replica][device]
        self.places = [[row[k % stages] for k in range(n)] for row in self.grid]   # places[replica][stage]
        self.params = [[stage_params(P, c) for P, c in zip(split_params(params, n, self.net), places)]
                       for places in self.places]
        self.states = [[init_states(P, optimizer) for P in row] for row in self.params]
        self.t, self.bubbles, self.measured, self.peaks = 0, [], [], {}

    def plan(self, n_examples):
        """The schedule's Plan for a replica's shard of n_examples: min(M, n_examples) micro-batches
        (interleaved: rounded down to a multiple of S if more than S, so that it runs)."""
        m = min(self.micro_batches, n_examples)
        if self.schedule == "interleaved" and m > self.S and m % self.S:
            m -= m % self.S
        return plan(self.schedule, self.S, m, self.V)

    def backward(self, X, y):
        """Every replica pipelines its shard of the batch; gradients add up where each stage lives.
        Afterwards self.peaks[context] is the most activation bytes it held at once, so far."""
        firsts, lasts = [p[0] for p in self.places], [p[-1] for p in self.places]
        return [self.run_replica(row, places, P, Xr, yr) for row, places, P, Xr, yr in zip(
            self.grid, self.places, self.params, split_and_load(X, firsts), split_and_load(y, lasts))]

    def run_replica(self, row, places, P, Xr, yr):
        """One replica's pass over its shard (Xr, yr), on the devices `row`, stage k on places[k];
        returns its (loss sum, number correct) and keeps its bubble and peaks."""
        p = self.plan(Xr.shape[0])
        Xs, ys = cut(Xr, p.n_micro), cut(yr, p.n_micro)
        self.bubbles.append(bubbles(p, simulate(p))[0])
        run = (SplitPass if p.split else ReplicaPass)(Xs, ys, P, places, self.stages, self.elems,
                                                      self.recompute, self.S, self.measure)
        metrics = run.run(run_order(p))
        if self.measure:   # the schedule replayed with each (phase, stage)'s mean measured time
            took = run.mean_durations()
            self.measured.append(bubbles(p, simulate(p, took), took)[0])
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
        """The mean bubble fraction of the epoch's schedules (idle share of device time, unit durations),
        with measure=True the same replayed with the measured durations ("bubble_measured"), and the
        activation bytes each context held at its peak, counted as the schedules ran."""
        stats = {"bubble_fraction": float(np.mean(self.bubbles))} if self.bubbles else {}
        if self.measured:
            stats["bubble_measured"] = float(np.mean(self.measured))
        if self.peaks:
            stats["activation_peak_bytes"] = dict(self.peaks)
        self.bubbles, self.measured, self.peaks = [], [], {}
        return stats

    def correct(self, X, y):
        """Correct predictions on (X, y), sharded over the replicas, each through its stages."""
        rows = self.places[:min(len(self.places), X.shape[0])]
        counts = []
        for places, P, Xr, yr in zip(rows, self.params, split_and_load(X, [r[0] for r in rows]),
                                     split_and_load(y, [r[-1] for r in rows])):
            h = Xr
            for s, (stage, c) in enumerate(zip(self.stages, places)):
                h = stage(h if s == 0 else h.copyto(c), P[s])
            counts.append(n_correct(h, yr).copyto(self.ctx[0]))
        return nd.add_n(*counts)

    def fingerprints(self):
        """Per stage, the copy of every pipeline replica."""
        names = self.net.names()
        return {f"stage {s}": [fingerprint(places[s], P[s], names[sl]) for places, P in zip(self.places, self.params)]
                for s, sl in enumerate(param_slices(len(self.stages), self.net))}

    def layout(self, batch_size):
        """(context, part, examples whose activations of `part` it holds at the peak) per placement
        (part: the stage's pieces, or ("input", first piece) under recompute; manual_dp.memory).

        GPipe keeps every micro-batch's activations until its backward: the whole shard; 1F1B at
        most S - s micro-batches on stage s; ZB-H1 S on every stage, until W. Recompute keeps those
        micro-batches' stage inputs and the activations of one micro-batch, while its backward runs
        (ZB-H1: from B until W). Each stage's peak is exact; where a context holds two parts (several
        interleaved stages, or recompute's input and activations) their peaks are added, an upper
        bound on the context's (they need not peak at once).
        """
        out = []
        for places, n in zip(self.places, shard_sizes(batch_size, len(self.places))):
            p = self.plan(n)
            sizes = shard_sizes(n, p.n_micro)
            kept = held(p, sizes, per="stage")
            redone = held(p, sizes, per="stage", since="B", until="W") if p.split else [max(sizes)] * p.n_stages
            for c, pieces, h, r in zip(places, self.cuts, kept, redone):
                out += [(c, ("input", pieces[0]), h), (c, pieces, r)] if self.recompute else [(c, pieces, h)]
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
