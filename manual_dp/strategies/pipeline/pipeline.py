"""Model, pipeline and hybrid parallelism: a model's stages (runs of its layers) on different contexts, copied across by
hand, on a schedule of manual_dp.strategies.pipeline.schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1), optionally
recomputing activations in the backward."""
import numpy as np
from mxnet import nd

from ...config import FAST_STEP, RunConfig
from ...fast.collectives import make_allreduce
from ...lesson import shard_sizes, split_and_load
from ...models.contract import count_correct
from ...models import as_model
from ...models.batchnorm import Batch, Moments, first_norm, fold_mean, moments_of
from ...optim import apply_update_and_clear, init_states
from ...replicas import fingerprint
from ..base import Strategy
from ..data.data_parallel import host_state, load_into
from ..running import RunningStats
from ...memory import part_activation_elems
from .schedules import bubbles, check_micro, check_name, held, plan, run_order, simulate
from .pipeline_pass import ReplicaPass, SplitPass, cut, piece_actions, stage_params
from ..sums.fixed_sums import refuse_running_pieces
from .pipeline_sums import FixedPipeline
from .stages import make_stages, param_slices, split_params
from ..tensor.tensor_pieces import piece_stage


class PipelineParallel(RunningStats, FixedPipeline, Strategy):
    """len(ctx) // S data-parallel replicas of an S-device pipeline; replica r's device d is ctx[S r + d].

    S contexts and micro_batches=1: model parallelism. More micro-batches: a pipeline, on the
    schedule `schedule` ("gpipe", "1f1b", "interleaved", "zb-h1"; manual_dp.strategies.pipeline.schedules).
    virtual_stages V (interleaved only): the model cut into S V stages, stage k on device k % S.
    More contexts: hybrid, data parallel over pipelines with gradients all-reduced per stage.
    recompute: activations dropped in the forward, recomputed in the backward. measure: every action
    timed (between nd.waitall()s), the schedule replayed with the measured durations: end_epoch's
    "bubble_measured". Every variant takes the same step as one device on the whole batch.
    model: the network (manual_dp.models; None: the lesson's LeNet of the parameters' width), cut by Model.cuts.
    sums: None, each stage adding its micro-batches' gradients as its kernels go and the replicas'
    by allreduce_fn; or --deterministic's FixedSums (strategies/sums/fixed_sums.py): every replica runs its
    run of the batch's pieces, a micro-batch piece by piece, and each stage's per-piece gradients
    are the leaves of the one tree, so the parameters take the bits of --deterministic --mode sync.

    A model with BatchNorm normalises each micro-batch with its own statistics (GPipe's choice:
    waiting for the whole batch's would stop the pipeline), and after the step the mean of every
    micro-batch's statistics, of every replica, is folded into the running ones (as torchgpipe's
    deferred BatchNorm): a step of m micro-batches is data parallelism's over m contexts with
    per-context statistics. Each stage starts at its own first BatchNorm (Moments.seek), so a
    stage recompute runs again records the same statistics in the same place. With sums each piece
    is normalised with its own statistics, as --deterministic --mode sync does (pipeline_sums.py).
    """

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, micro_batches=1, allreduce_fn=None,
                 stages=2, schedule="gpipe", recompute=False, model=None, virtual_stages=1, measure=False,
                 sums=None):
        self.net = as_model(model, params)
        refuse_running_pieces(self.net.stats(), sums.tensor_pieces if sums else 1)
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
        self.cuts = self.net.cuts(n)
        bare = [ids for ids in self.cuts[:-1] if not any(self.net.layers[i].params for i in ids)] if sums else []
        if bare:                                 # its leaf in the tree would be empty (pipeline_sums.py)
            raise ValueError(f"--deterministic: a pipeline stage of {', '.join(self.net.layers[i].name for i in bare[0])} "
                             f"alone holds no parameters to sum: use fewer stages")
        Q = sums.tensor_pieces if sums else 1                 # --tensor-pieces: split layers in Q pieces
        if Q > 1 and not self.net.splits_by_layer():
            raise ValueError(f"--tensor-pieces {Q} in a pipeline needs a model whose layers split one by one "
                             f"(the transformer); {self.net.name} splits as a whole")
        self.stages = make_stages(n, self.net) if Q == 1 else [piece_stage(self.net, ids, Q) for ids in self.cuts]
        # norms[s]: the number of the first BatchNorm of stage s, where its forward starts counting
        self.norms = [first_norm(self.net.layers, ids[0]) for ids in self.cuts]
        if self.net.stats():
            self.stages = [from_norm(stage, first) for stage, first in zip(self.stages, self.norms)]
        self.elems = [part_activation_elems(pieces, model=self.net) for pieces in self.cuts]
        self.grid = [self.ctx[r:r + stages] for r in range(0, len(ctx), stages)]   # grid[replica][device]
        self.places = [[row[k % stages] for k in range(n)] for row in self.grid]   # places[replica][stage]
        self.params = [[stage_params(P, c) for P, c in zip(split_params(params, n, self.net), places)]
                       for places in self.places]
        self.states = [[init_states(P, optimizer) for P in row] for row in self.params]
        self.t, self.bubbles, self.measured, self.peaks = 0, [], [], {}
        self.sums, self.held = sums, None
        self.keep_running(False, self.allreduce_fn)
        self.batch_moments = []            # per replica, each micro-batch's Moments of this step (namespaces)
        for p in (p for row in self.params for P in row for p in P) if sums else ():
            p.attach_grad(grad_req="write")              # each piece's backward overwrites

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
        if self.sums:
            return self.fixed_backward(X, y)
        firsts, lasts = [p[0] for p in self.places], [p[-1] for p in self.places]
        self.batch_moments = []
        metrics = [self.run_replica(row, places, P, Xr, yr) for row, places, P, Xr, yr in zip(
            self.grid, self.places, self.params, split_and_load(X, firsts), split_and_load(y, lasts))]
        if self.running:
            self.fold_micro()
        return metrics

    def namespaces(self, Xs):
        """Each micro-batch's operators' namespace: its dropout masks, and with BatchNorm a Moments
        of its own (the micro-batch's statistics, kept in self.batch_moments for the fold)."""
        if not self.running:
            return [self.net.noisy(nd, X) for X in Xs]
        moments = [Moments(train=True) for _ in Xs]
        self.batch_moments.append(moments)
        return [self.net.noisy(Batch(nd, M), X) for M, X in zip(moments, Xs)]

    def fold_micro(self):
        """Afterwards every context's running statistics took the mean of every micro-batch's (of
        every replica and process) batch statistics: each replica sums its micro-batches' on its
        first context, the replicas' sums are all-reduced (the strategy's all-reduce, across
        processes too), and the first context's result is copied everywhere."""
        sums = []
        for places, moments in zip(self.places, self.batch_moments):
            home = places[0]
            rows = [nd.concat(*[x.as_in_context(home) for per_norm in M.batch for x in per_norm[0]],
                              nd.ones((1,), ctx=home), dim=0) for M in moments]
            sums.append(nd.add_n(*rows) if len(rows) > 1 else rows[0])
        self.stats_reduce(sums)
        total = sums[0].as_in_context(self.running[0][0].context)
        fold_mean(self.running, nd.broadcast_div(total[:-1], total[-1:]))

    def run_replica(self, row, places, P, Xr, yr, parts=None, collect=None):
        """One replica's pass over its shard (Xr, yr), on the devices `row`, stage k on places[k];
        returns its (loss sum, number correct) and keeps its bubble and peaks. parts: the rows of
        each piece (--deterministic): a micro-batch of whole pieces runs them one by one, and
        collect(s, q, grads) takes stage s's gradients of piece q."""
        sizes = [b - a for a, b in parts] if parts else None
        p = self.plan(len(sizes) if parts else Xr.shape[0])
        Xs, ys = (cut(Xr, p.n_micro), cut(yr, p.n_micro)) if not parts else \
            ([Xr[a:b] for a, b in parts], [yr[a:b] for a, b in parts])
        self.bubbles.append(bubbles(p, simulate(p))[0])
        run = (SplitPass if p.split else ReplicaPass)(Xs, ys, P, places, self.stages, self.elems,
                                                      self.recompute, self.S, self.measure,
                                                      self.namespaces(Xs), collect)
        groups = np.cumsum([0] + shard_sizes(len(Xs), p.n_micro))
        metrics = run.run(run_order(p) if not parts else
                          piece_actions(run_order(p), [range(a, b) for a, b in zip(groups, groups[1:])]))
        if self.measure:   # the schedule replayed with each (phase, stage)'s median measured time
            took = run.median_durations()
            self.measured.append(bubbles(p, simulate(p, took), took)[0])
        for c, peak in zip(row, run.peak):
            self.peaks[str(c)] = max(self.peaks.get(str(c), 0), peak)
        return metrics

    def update(self, lr, n_examples):
        """Sum each stage's gradients over the replicas, then one optimiser step everywhere."""
        if self.sums:
            self.place_totals()
        for s, P in enumerate(self.params[0]) if not self.sums else ():
            for i in range(len(P)):
                self.allreduce_fn([row[s][i].grad for row in self.params])
        self.t += 1
        n_examples = self.counted(n_examples)
        for row, row_states in zip(self.params, self.states):
            for P, S in zip(row, row_states):
                apply_update_and_clear(P, S, self.optimizer, lr, self.t, n_examples)
        self.held = None

    def reduced_grads(self):
        """The first replica's stages' gradients, in the model's order (--deterministic: the tree's)."""
        if self.sums:
            return [t[:sum(p.size for p in P)] for t, P in zip(self.held, self.params[0])]
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
                h = stage(h if s == 0 else h.copyto(c), P[s], self.evaluating(s, c))
            counts.append(count_correct(h, yr).copyto(self.ctx[0]))
        return nd.add_n(*counts)

    def evaluating(self, s, c):
        """Stage s's namespace on context c at evaluation: its BatchNorms normalise with c's running
        statistics (numbered from the stage's first)."""
        if not self.running:
            return nd
        return Batch(nd, Moments(False, [self.running[self.ctx.index(c)]], first=self.norms[s]))

    def fingerprints(self):
        """Per stage, the copy of every pipeline replica (and every context's running statistics)."""
        names = self.net.names()
        stages = {f"stage {s}": [fingerprint(places[s], P[s], names[sl]) for places, P in zip(self.places, self.params)]
                  for s, sl in enumerate(param_slices(len(self.stages), self.net))}
        return {**stages, **self.running_fingerprints()}

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
        state = [s for row in self.states for S in row for st in S for s in st] + self.running_arrays()
        return {"param": params, "grad": [p.grad for p in params], "state": state}

    @property
    def batch_places(self):
        """A pipeline replica a place (strategies/base.py)."""
        return len(self.grid)

    def state_dict(self):
        """Replica 0's parameters and optimiser state, in the model's order."""
        return host_state([p for P in self.params[0] for p in P], [st for S in self.states[0] for st in S],
                          self.t, **self.running_state())

    def load_state_dict(self, state):
        self.load_running(state)
        for row, row_states in zip(self.params, self.states):
            load_into([p for P in row for p in P], [st for S in row_states for st in S], state)
        self.t = state["t"]


def from_norm(stage, first):
    """`stage` (a stage's forward) whose BatchNorms are numbered from `first`, in training too: the
    namespace's Moments seeks there before it runs (evaluation's Moments starts there already)."""
    def run(h, params, F=nd):
        moments = moments_of(F)
        if moments is not None:
            moments.seek(first)
        return stage(h, params, F)
    return run
