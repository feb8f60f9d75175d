"""--deterministic --mode mesh: MeshParallel(..., sums=FixedSums) on dp x pp x tp, with the bits of
--deterministic in every other layout given the same --tensor-pieces Q (sync on any count, ZeRO,
pipelines, tensor groups), on any dp x pp x tp whose T divides Q, and any number of processes.

It composes the two deterministic halves it is made of:

    inside a group   a stage is its layers on a tensor group as strategies/tensor/tensor_sums.py
                     runs the whole model: every split layer in Q pieces, Q/T per context, the
                     model's split_forward over a PieceJoin (strategies/tensor/tensor_pieces.py), whose f
                     and g add the pieces' partials in the fixed tree; a stage's leaf of a batch
                     piece is then exactly the slice of one context's leaf (piece_forward) that its
                     parameters own, as for strategies/pipeline/pipeline_sums.py's stages
    over the batch   as strategies/pipeline/pipeline_sums.py: every replica (the data dimension, across
                     processes too) takes its run of the batch's pieces of PIECE_ROWS rows
                     (FixedSums.cut); its micro-batches are runs of whole pieces, each stage runs
                     them piece by piece (PiecePass on the schedule's actions, piece_actions), and
                     each context's gradients of a piece are one leaf, added in the one tree over
                     the piece numbers (FixedSums.subtrees, total: each replica's whole subtrees on
                     its context, the rest on replica 0's context of that stage and shard position,
                     after the processes swapped their subtrees, key "mesh{k}.{j}-")

The update is elementwise, per piece array: the same bits everywhere. Schedules: gpipe, 1f1b and
interleaved (zb-h1's split backward is not written for tensor groups). Context parallelism in the
stages (pp x cp) is lane_sums.py: this half whose stages run lanes instead of tensor pieces; cp with
tp in a pipeline, sequence parallelism and ZeRO in one are refused. Each process must run its ops
with the same thread count (the command line gives one thread per op with --deterministic).
"""
import numpy as np
from mxnet import nd

from ...errors import CheckpointError
from ...fast.prefetch import host
from ...lesson import shard_sizes
from ...models.contract import count_correct
from ...mesh import Mesh
from ...models import stateless
from ...optim import apply_update_and_clear, init_states
from ...replicas import fingerprint
from ..sums.fixed_sums import into_grads, leaf, pieces, spans
from .group_stages import PiecePass, check_schedule, sequence_stage, tensor_stage
from ..pipeline.pipeline_pass import piece_actions
from ..pipeline.schedules import bubbles, run_order, simulate
from ..tensor.tensor_layout import copies
from ..tensor.tensor_sums import place
from ..tensor.tensor_pieces import PieceJoin, cut, join, names, pieced


class FixedMesh:
    """The --deterministic half of MeshParallel (strategies/mesh/mesh_parallel.py), whose attributes
    it reads and sets. Context ctx[mesh.rank(dp=r, pp=s, tp=j)] holds pieces j*Q/T .. (j+1)*Q/T - 1
    of every split parameter of pipeline stage s (then its unsplit parameters), in replica r (see the
    module docstring): groups[r][k][j] is place j of replica r's stage k (a tensor rank; a stage of
    lanes: lane j's context, lane_sums.py), params[r][k][j] its arrays in cut's layout (shard j % T),
    states[r][k][j] their optimiser state."""

    lanes = None          # a stage of lanes: lanes[r][k], the Lanes of replica r's stage k (lane_sums.py)

    def hold_pieces(self, params, ctx, optimizer, S, T, micro_batches, schedule, V, model):
        """dp x pp x tp on len(ctx) = D S T contexts, every split layer in the policy's Q pieces;
        ValueError where the degrees do not divide or the model or schedule cannot run."""
        net = self.net = stateless(model, "--deterministic --mode mesh")
        Q, n = self.sums.tensor_pieces, len(ctx)
        if n % (S * T) or Q % T:
            raise ValueError(f"pp={S} x tp={T} must divide the {n} contexts and tp={T} the {Q} pieces "
                             f"of --tensor-pieces")
        if not net.splits_by_layer() or net.tensor_refusal(Q):
            raise ValueError(net.tensor_refusal(Q) or f"{net.name} splits as a whole; tp x pp needs layers "
                                                      f"that split on their own")
        check_schedule(net, schedule, S, micro_batches, V, "tp")
        self.mesh = Mesh(dp=n // (S * T), pp=S, cp=1, tp=T)
        self.C, self.T, self.G, self.Q, self.k = 1, T, T, Q, Q // T
        self.hold_stages(params, ctx, optimizer, S, V, micro_batches, schedule,
                         [[[ctx[self.mesh.rank(dp=r, pp=k % S, tp=j)] for j in range(T)] for k in range(S * V)]
                          for r in range(self.mesh.dp)])

    def hold_stages(self, params, ctx, optimizer, S, V, micro_batches, schedule, groups):
        """Afterwards place j of groups[r][k] holds its copy of stage k's arrays (tensor shard j % T,
        cut's layout) and their state, and runs[r][k] runs the stage on its group (or its lanes)."""
        net = self.net
        self.ctx, self.optimizer, self.S, self.V, self.groups = list(ctx), optimizer, S, V, groups
        self.micro_batches, self.schedule, self.cuts = micro_batches, schedule, net.cuts(S * V)
        self.sequence_parallel, self.zero = False, None                 # as MeshParallel.layout and arrays read them
        slices, split = net.slices(), [p.split for p in net.param_table()]
        self.own = [slice(slices[ids[0]].start, slices[ids[-1]].stop) for ids in self.cuts]
        self.splits = [split[sl] for sl in self.own]                   # splits[k]: stage k's split axes
        self.runs = [[self.stage(ids, where, s) for ids, where, s in zip(self.cuts, row, self.splits)]
                     for row in self.lanes or groups]
        values = [p.asnumpy() for p in params]
        self.params = [[[place(cut(values[sl], s, self.Q, self.T, j % self.T), c) for j, c in enumerate(group)]
                        for sl, s, group in zip(self.own, self.splits, row)] for row in groups]
        self.states = [[[init_states(P, optimizer) for P in stage] for stage in row] for row in self.params]
        self.t, self.held, self.bubbles = 0, None, []

    def stage(self, ids, where, split):
        """The function (hs, P, F) of the layers `ids` on `where`, P[j] place j's arrays (cut's layout,
        each context's arrays as its pieces): tensor_stage over a PieceJoin of the tensor group
        `where`, or sequence_stage over the Lanes `where`."""
        run = sequence_stage(self.net, ids, where) if self.lanes else \
            tensor_stage(self.net, ids, PieceJoin(where, self.k))
        return lambda hs, P, F=nd: run(hs, [w for Pj in P for w in pieced(Pj, split, self.k)], F)

    def fixed_backward(self, X, y):
        """Every replica's run of pieces through its stages' groups; afterwards held[k][j] adds the
        tree's total of stage k, place j (the last stage's then loss sum and correct count)."""
        bounds, runs, mine = self.sums.cut(len(X), len(self.groups))
        m = len(bounds)
        leaves = [[{} for _ in group] for group in self.groups[0]]        # leaves[k][j][piece]
        for r, (lo, hi) in enumerate(mine):
            if hi > lo:
                self.run_replica(r, X, y, bounds[lo:hi], lo, leaves)
        totals = [[self.sums.total(self.sums.subtrees(leaves[k][j], mine, m, c), runs, m, self.width(k), c,
                                   f"mesh{k}.{j}-") for j, c in enumerate(self.groups[0][k])]
                  for k in range(len(self.cuts))]
        self.held = totals if self.held is None else \
            [[a + b for a, b in zip(A, B)] for A, B in zip(self.held, totals)]
        n = self.width(len(self.cuts) - 1) - 2
        loss, correct = totals[-1][0][n:n + 1], totals[-1][0][n + 1:n + 2]
        return [(loss.zeros_like(), correct.zeros_like())] if self.sums.rank else [(loss, correct)]   # rank 0's

    def width(self, k):
        """Elements of a leaf of stage k on one place: its arrays, the last stage's loss and count."""
        return sum(p.size for p in self.params[0][k][0]) + (2 if k == len(self.cuts) - 1 else 0)

    def run_replica(self, r, X, y, parts, first, leaves):
        """Replica r's pieces (rows `parts`, numbered from `first`) on the schedule, each stage's
        per-place leaf of each piece in leaves[k][j][piece] (stage_leaves); on lanes each lane
        backpropagates 1/K of the (same) loss."""
        row = self.groups[r]
        Xs = [host(X[a:b]).as_in_context(row[0][0]) for a, b in parts]
        ys = [host(y[a:b]).as_in_context(row[-1][0]) for a, b in parts]
        p = self.plan(len(parts))
        self.bubbles.append(bubbles(p, simulate(p))[0])
        ends = np.cumsum([0] + shard_sizes(len(Xs), p.n_micro))

        def collect(k, q, got):
            for j, value in enumerate(self.stage_leaves(r, k, got)):
                leaves[k][j][first + q] = value
        run = PiecePass(Xs, ys, self.params[r], row, self.runs[r], 1 / self.K if self.lanes else 1,
                        [self.net.noisy(nd, X) for X in Xs], collect=collect)
        run.run(piece_actions(run_order(p), [range(a, b) for a, b in zip(ends, ends[1:])]))

    def stage_leaves(self, r, k, got):
        """Replica r's stage k's leaf of a piece per place, from got[j] (place j's gradients, the last
        stage's then loss and count): each its own (on lanes: lane_leaves)."""
        return self.lane_leaves(r, k, got) if self.lanes else [leaf(arrays) for arrays in got]

    def fixed_update(self, lr, n_examples):
        """The tree's gradients into every copy of every stage's arrays, then the same elementwise update."""
        n_examples = self.counted(n_examples)
        self.t += 1
        for row, row_states in zip(self.params, self.states):
            for held_k, stage, stage_states in zip(self.held, row, row_states):
                for total, P, S in zip(held_k, stage, stage_states):
                    into_grads(total, P)
                    apply_update_and_clear(P, S, self.optimizer, lr, self.t, n_examples)
        self.held = None

    def pieces_whole(self, per_stage):
        """The model's arrays in its order, from per_stage[k][j] (tensor rank j's arrays of stage k, in
        cut's layout): each split one's pieces concatenated on the first context."""
        out = []
        for s, per_context in zip(self.splits, per_stage):
            home = per_context[0][0].context
            ws = [w for P in per_context for w in pieced(P, s, self.k)]
            out += [ws[0][i] if a is None else nd.concat(*[w[i].as_in_context(home) for w in ws], dim=a)
                    for i, a in enumerate(s)]
        return out

    def fixed_grads(self):
        """The tree's gradient of every parameter, whole, in the model's order (the first T places'
        totals: a tensor group's, or lane 0's): the elements every layout sums."""
        def arrays(total, P):
            at = [0] + list(np.cumsum([p.size for p in P]))
            return [total[a:b].reshape(p.shape) for a, b, p in zip(at, at[1:], P)]
        return self.pieces_whole([[arrays(t, P) for t, P in zip(held_k[:self.T], stage[:self.T])]
                                  for held_k, stage in zip(self.held, self.params[0])])

    def piece_scores(self, X, r):
        """Class scores of images X (NDArray) through replica r's stages, on its last group's first context."""
        row, hs = self.groups[r], None
        for k, (run, group) in enumerate(zip(self.runs[r], row)):
            hs = run(copies(X.as_in_context(group[0]), group) if k == 0 else [h.copyto(c) for h, c in zip(hs, group)],
                     self.params[r][k])
        return hs[0]

    def fixed_correct(self, X, y):
        """Correct predictions on (X, y): pieces of the policy's rows spread over the replicas."""
        bounds, counts = pieces(len(X), self.sums.piece), []
        for r, (lo, hi) in enumerate(spans(len(bounds), len(self.groups))):
            for a, b in bounds[lo:hi]:
                scores = self.piece_scores(host(X[a:b]), r)
                counts.append(count_correct(scores, host(y[a:b]).as_in_context(scores.context)).as_in_context(self.ctx[0]))
        return nd.add_n(*counts) if len(counts) > 1 else counts[0]

    def fixed_fingerprints(self):
        """Stage k's copies of tensor shard j in every replica ("stage k shard j"); on lanes every
        lane's copy of stage k in every replica ("stage k")."""
        all_names, out = self.net.names(), {}
        for k, (sl, s) in enumerate(zip(self.own, self.splits)):
            for j in range(self.T):
                out[f"stage {k}" if self.lanes else f"stage {k} shard {j}"] = [
                    fingerprint(c, P, names(all_names[sl], s, self.Q, self.T, j))
                    for row, Pr in zip(self.groups, self.params)
                    for i, (c, P) in enumerate(zip(row[k], Pr[k])) if i % self.T == j]
        return out

    def fixed_state_dict(self):
        """Replica 0's first T places joined (a tensor group's pieces; lane 0's copy): the whole
        parameters and optimiser state, in the model's order."""
        params, slots = [], len(self.states[0][0][0][0])
        per_slot = [[] for _ in range(slots)]
        for s, stage, stage_states in zip(self.splits, self.params[0], self.states[0]):
            params += join([[p.asnumpy() for p in P] for P in stage[:self.T]], s, self.k)
            for i in range(slots):
                per_slot[i] += join([[st[i].asnumpy() for st in S] for S in stage_states[:self.T]], s, self.k)
        return {"params": params, "opt_state": [[v[g] for v in per_slot] for g in range(len(params))],
                "t": self.t, "extra": {}}

    def fixed_load_state_dict(self, state):
        """Every place's arrays and state cut from the whole ones (tensor shard j % T)."""
        want = [v.shape for v in self.state_dict()["params"]]
        got = [tuple(np.shape(v)) for v in state["params"]]
        slots = len(self.states[0][0][0][0])
        if got != want or [len(s) for s in state["opt_state"]] != [slots] * len(want):
            raise CheckpointError(f"the checkpoint's parameters {got} or optimiser state do not fit this run's {want}")
        for row, row_states in zip(self.params, self.states):
            for sl, s, stage, stage_states in zip(self.own, self.splits, row, row_states):
                for j, (P, S) in enumerate(zip(stage, stage_states)):
                    for p, v in zip(P, cut(state["params"][sl], s, self.Q, self.T, j % self.T)):
                        p[:] = nd.array(v, ctx=p.context)
                    for i in range(slots):
                        for st, v in zip(S, cut([o[i] for o in state["opt_state"][sl]], s, self.Q, self.T, j % self.T)):
                            st[i][:] = nd.array(v, ctx=st[i].context)
        self.t = state["t"]
