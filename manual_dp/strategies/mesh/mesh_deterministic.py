"""--deterministic --mode mesh: data x pipeline x tensor parallelism with the bits of --deterministic
in every other layout given the same --tensor-pieces Q (sync on any count, ZeRO, pipelines, tensor
groups), on any dp x pp x tp whose T divides Q, and any number of processes.

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
                     them piece by piece (GroupPass on the schedule's actions, piece_actions), and
                     each context's gradients of a piece are one leaf, added in the one tree over
                     the piece numbers (FixedSums.subtrees, total: each replica's whole subtrees on
                     its context, the rest on replica 0's context of that stage and shard position,
                     after the processes swapped their subtrees)

The update is elementwise, per piece array: the same bits everywhere. Schedules: gpipe, 1f1b and
interleaved (zb-h1's split backward is not written for tensor groups). Context parallelism in the
stages (pp x cp) is strategies/mesh/mesh_lanes.py, a subclass; cp with tp in a pipeline and sequence
parallelism in one are refused by the command line. Each process must run its ops with the same thread count (the
command line gives one thread per op with --deterministic).
"""
import numpy as np
from mxnet import nd

from ...config import RunConfig, TENSOR_PIECES
from ...errors import CheckpointError
from ...fast.prefetch import host
from ...lesson import n_correct, shard_sizes
from ...mesh import Mesh
from ...models import stateless
from ...optim import apply_update_and_clear, init_states
from ...replicas import fingerprint
from ..base import Strategy
from ..sums.fixed_sums import FixedSums, WholeBatch, into_grads, leaf, pieces, spans
from .group_stages import GroupPass, tensor_stage
from .mesh_parallel import MeshParallel
from ..pipeline.pipeline_pass import piece_actions
from ..pipeline.schedules import bubbles, check_micro, check_name, run_order, simulate
from ..tensor.tensor_layout import copies
from ..tensor.tensor_sums import place
from ..tensor.tensor_pieces import PieceJoin, cut, join, names, pieced


class PiecePass(GroupPass):
    """GroupPass whose micro-batches are single batch pieces: as soon as stage k's backward of piece
    m ran, collect(k, m, [arrays of context j]) takes every context's gradients (the parameters'
    grad_req "write": each backward overwrites), the last stage's followed by the piece's loss sum
    and correct count, copied to each context of the group."""

    def __init__(self, *args, collect):
        super().__init__(*args)
        self.collect, self.done = collect, {}

    def forward(self, k, m):
        super().forward(k, m)
        if k == self.last:
            self.done[m] = self.metrics[-1]

    def backward(self, k, m):
        super().backward(k, m)
        self.collect(k, m, [[p.grad for p in P] + ([a.as_in_context(c) for a in self.done[m]] if k == self.last
                                                   else []) for P, c in zip(self.params[k], self.groups[k])])


class MeshDeterministic(WholeBatch, Strategy):
    """dp x pp x tp on len(ctx) = D P T contexts, context ctx[mesh.rank(dp=r, pp=s, tp=j)] holding
    pieces j*Q/T .. (j+1)*Q/T - 1 of every split parameter of pipeline stage s (then its unsplit
    parameters), in replica r (see the module docstring).

    stages P, tensor_parallel T, micro_batches, schedule, virtual_stages: as MeshParallel's;
    sums: the policy (FixedSums: piece rows, the processes, tensor_pieces Q; default Q = 4).
    model: a network whose layers split on their own (the transformer)."""

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, stages=2, tensor_parallel=2, micro_batches=1,
                 schedule="1f1b", virtual_stages=1, sums=None, model=None):
        net = self.net = stateless(model, "--deterministic --mode mesh")
        self.sums = sums or FixedSums(tensor_pieces=TENSOR_PIECES)
        S, V, T, Q, n = stages, virtual_stages, tensor_parallel, self.sums.tensor_pieces, len(ctx)
        if n % (S * T) or Q % T:
            raise ValueError(f"pp={S} x tp={T} must divide the {n} contexts and tp={T} the {Q} pieces "
                             f"of --tensor-pieces")
        if not net.splits_by_layer() or net.tensor_refusal(Q):
            raise ValueError(net.tensor_refusal(Q) or f"{net.name} splits as a whole; tp x pp needs layers "
                                                      f"that split on their own")
        check_name(schedule, S, max(micro_batches, 1), V)
        check_micro(schedule, S, micro_batches)
        if schedule == "zb-h1" or S * V > len(net.layers):
            raise ValueError("zb-h1 with tp: not yet (gpipe, 1f1b or interleaved)" if schedule == "zb-h1" else
                             f"{S} stages x {V} virtual stages need {S * V} layers; {net.name} has {len(net.layers)}")
        self.mesh = Mesh(dp=n // (S * T), pp=S, cp=1, tp=T)
        self.ctx, self.optimizer, self.S, self.V, self.T, self.Q, self.k = list(ctx), optimizer, S, V, T, Q, Q // T
        self.C, self.G, self.sequence_parallel = 1, T, False         # as MeshParallel.layout reads them
        self.micro_batches, self.schedule, self.cuts = micro_batches, schedule, net.cuts(S * V)
        slices, split = net.slices(), [p.split for p in net.param_table()]
        self.own = [slice(slices[ids[0]].start, slices[ids[-1]].stop) for ids in self.cuts]
        self.splits = [split[sl] for sl in self.own]                   # splits[k]: stage k's split axes
        self.groups = [[[self.ctx[self.mesh.rank(dp=r, pp=k % S, tp=j)] for j in range(T)]
                        for k in range(S * V)] for r in range(self.mesh.dp)]
        self.runs = [[self.stage(ids, group, s) for ids, group, s in zip(self.cuts, row, self.splits)]
                     for row in self.groups]
        values = [p.asnumpy() for p in params]
        self.params = [[[place(cut(values[sl], s, Q, T, j), c) for j, c in enumerate(group)]
                        for sl, s, group in zip(self.own, self.splits, row)] for row in self.groups]
        self.states = [[[init_states(P, optimizer) for P in stage] for stage in row] for row in self.params]
        self.t, self.held, self.bubbles = 0, None, []

    def stage(self, ids, group, split):
        """The function (hs, P, F) of the layers `ids` on the tensor group `group`, P[j] context j's
        arrays (cut's layout): tensor_stage over a PieceJoin, each context's arrays as its pieces."""
        run = tensor_stage(self.net, ids, PieceJoin(group, self.k))
        return lambda hs, P, F=nd: run(hs, [w for Pj in P for w in pieced(Pj, split, self.k)], F)

    def plan(self, n_pieces):
        """The schedule's Plan for a replica's run of n_pieces: min(M, n_pieces) micro-batches of
        whole pieces (interleaved: rounded down to a multiple of S if more than S)."""
        return MeshParallel.plan(self, n_pieces)

    def backward(self, X, y):
        """Every replica's run of pieces through its stages' groups; afterwards held[k][j] adds the
        tree's total of stage k, shard position j (the last stage's then loss sum and correct count)."""
        bounds, runs, mine = self.sums.cut(len(X), len(self.groups))
        m = len(bounds)
        leaves = [[{} for _ in range(self.T)] for _ in self.cuts]        # leaves[k][j][piece]
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
        """Elements of a leaf of stage k on one context: its arrays, the last stage's loss and count."""
        return sum(p.size for p in self.params[0][k][0]) + (2 if k == len(self.cuts) - 1 else 0)

    def replica_pieces(self, r, X, y, parts):
        """(replica r's row of groups, its pieces' images on its first stage and labels on its last,
        the schedule's Plan for them, the bounds of its micro-batches in pieces); the plan's bubble kept."""
        row = self.groups[r]
        Xs = [host(X[a:b]).as_in_context(row[0][0]) for a, b in parts]
        ys = [host(y[a:b]).as_in_context(row[-1][0]) for a, b in parts]
        p = self.plan(len(parts))
        self.bubbles.append(bubbles(p, simulate(p))[0])
        return row, Xs, ys, p, np.cumsum([0] + shard_sizes(len(Xs), p.n_micro))

    def run_replica(self, r, X, y, parts, first, leaves):
        """Replica r's pieces (rows `parts`, numbered from `first`) on the schedule, each stage's
        per-context gradients of each piece a leaf in leaves[k][j][piece]."""
        row, Xs, ys, p, ends = self.replica_pieces(r, X, y, parts)

        def collect(k, q, per_context):
            for j, arrays in enumerate(per_context):
                leaves[k][j][first + q] = leaf(arrays)
        run = PiecePass(Xs, ys, self.params[r], row, self.runs[r], 1, [self.net.noisy(nd, X) for X in Xs],
                        collect=collect)
        run.run(piece_actions(run_order(p), [range(a, b) for a, b in zip(ends, ends[1:])]))

    def update(self, lr, n_examples):
        """The tree's gradients into every copy of every stage's arrays, then the same elementwise update."""
        n_examples = self.counted(n_examples)
        self.t += 1
        for row, row_states in zip(self.params, self.states):
            for held_k, stage, stage_states in zip(self.held, row, row_states):
                for total, P, S in zip(held_k, stage, stage_states):
                    into_grads(total, P)
                    apply_update_and_clear(P, S, self.optimizer, lr, self.t, n_examples)
        self.held = None

    def whole(self, per_stage):
        """The model's arrays in its order, from per_stage[k][j] (context j's arrays of stage k, in
        cut's layout): each split one's pieces concatenated on the first context."""
        out = []
        for s, per_context in zip(self.splits, per_stage):
            home = per_context[0][0].context
            ws = [w for P in per_context for w in pieced(P, s, self.k)]
            out += [ws[0][i] if a is None else nd.concat(*[w[i].as_in_context(home) for w in ws], dim=a)
                    for i, a in enumerate(s)]
        return out

    def reduced_grads(self):
        """The tree's gradient of every parameter, whole, in the model's order: the elements every
        layout sums."""
        def arrays(total, P):
            at = [0] + list(np.cumsum([p.size for p in P]))
            return [total[a:b].reshape(p.shape) for a, b, p in zip(at, at[1:], P)]
        return self.whole([[arrays(t, P) for t, P in zip(held_k, stage)]
                           for held_k, stage in zip(self.held, self.params[0])])

    def forward(self, X, r):
        """Class scores of images X (NDArray) through replica r's stages, on its last group's first context."""
        row, hs = self.groups[r], None
        for k, (run, group) in enumerate(zip(self.runs[r], row)):
            hs = run(copies(X.as_in_context(group[0]), group) if k == 0 else [h.copyto(c) for h, c in zip(hs, group)],
                     self.params[r][k])
        return hs[0]

    def correct(self, X, y):
        """Correct predictions on (X, y): pieces of the policy's rows spread over the replicas."""
        bounds, counts = pieces(len(X), self.sums.piece), []
        for r, (lo, hi) in enumerate(spans(len(bounds), len(self.groups))):
            for a, b in bounds[lo:hi]:
                scores = self.forward(host(X[a:b]), r)
                counts.append(n_correct(scores, host(y[a:b]).as_in_context(scores.context)).as_in_context(self.ctx[0]))
        return nd.add_n(*counts) if len(counts) > 1 else counts[0]

    def end_epoch(self, lr):
        stats = {"bubble_fraction": sum(self.bubbles) / len(self.bubbles)} if self.bubbles else {}
        self.bubbles = []
        return stats

    def fingerprints(self):
        """Stage k's shard position j in every replica."""
        all_names = self.net.names()
        return {f"stage {k} shard {j}": [fingerprint(row[k][j], P[k][j], names(all_names[sl], s, self.Q, self.T, j))
                                         for row, P in zip(self.groups, self.params)]
                for k, (sl, s) in enumerate(zip(self.own, self.splits)) for j in range(self.T)}

    def layout(self, batch_size):
        """As MeshParallel prices its tensor groups' activations (an upper bound here: a stage holds
        one piece's activations per micro-batch piece in flight, at most a micro-batch's)."""
        return MeshParallel.layout(self, batch_size)

    def arrays(self):
        params = [p for row in self.params for stage in row for P in stage for p in P]
        states = [s for row in self.states for stage in row for S in stage for st in S for s in st]
        return {"param": params, "grad": [p.grad for p in params], "state": states}

    def state_dict(self):
        """Replica 0's pieces joined: the whole parameters and optimiser state, in the model's order."""
        params, slots = [], len(self.states[0][0][0][0])
        per_slot = [[] for _ in range(slots)]
        for s, stage, stage_states in zip(self.splits, self.params[0], self.states[0]):
            params += join([[p.asnumpy() for p in P] for P in stage], s, self.k)
            for i in range(slots):
                per_slot[i] += join([[st[i].asnumpy() for st in S] for S in stage_states], s, self.k)
        return {"params": params, "opt_state": [[v[g] for v in per_slot] for g in range(len(params))],
                "t": self.t, "extra": {}}

    def load_state_dict(self, state):
        want = [v.shape for v in self.state_dict()["params"]]
        got = [tuple(np.shape(v)) for v in state["params"]]
        slots = len(self.states[0][0][0][0])
        if got != want or any(len(s) != slots for s in state["opt_state"]):
            raise CheckpointError(f"the checkpoint's parameters {got} or optimiser state do not fit this run's {want}")
        for row, row_states in zip(self.params, self.states):
            for sl, s, stage, stage_states in zip(self.own, self.splits, row, row_states):
                for j, (P, S) in enumerate(zip(stage, stage_states)):
                    for p, v in zip(P, cut(state["params"][sl], s, self.Q, self.T, j)):
                        p[:] = nd.array(v, ctx=p.context)
                    for i in range(slots):
                        for st, v in zip(S, cut([o[i] for o in state["opt_state"][sl]], s, self.Q, self.T, j)):
                            st[i][:] = nd.array(v, ctx=st[i].context)
        self.t = state["t"]
