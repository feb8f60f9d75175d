"""--deterministic --mode mesh with cp > 1: data x pipeline x context parallelism with the bits of
one context's --deterministic step given the same --sequence-pieces K, for any pp, any C dividing
K, any schedule MeshDeterministic runs, and any number of processes.

It is MeshDeterministic (strategies/mesh/mesh_deterministic.py: whole batch pieces on the schedule,
every stage's gradients of a piece one leaf of FixedSums' tree) whose stages run on lanes instead
of tensor pieces: a stage's group is its K lanes (strategies/context/sequence_pieces.py), K/C on each of
the stage's C contexts, each lane with its own copy of the stage's parameters; a stage runs its
layers' sequence_forward over the lanes (group_stages.sequence_stage: attention folded in one
order, the pooling added in the lanes' tree), sends each lane's activations to the same lane of
the next stage, and each lane backpropagates 1/K of the (same) loss. A stage's leaf of a batch
piece is the tree's sum over the lanes of the copies' gradients (tree_reduce: each context its
whole subtrees, the first the rest), then lane 0's loss and count on the last stage: the slice of
ContextParallel's --deterministic leaf that the stage's parameters own.

Every lane keeps its own copy of its stage's parameters and optimiser state (K/C a context: each
copy gets the same total and the same elementwise update), and the tree over the batch is taken
once per lane (K times the same sums): simple, not frugal.
"""
import numpy as np
from mxnet import nd

from ...config import RunConfig, SEQUENCE_PIECES
from ...errors import CheckpointError
from ...fast.attention import ATTENTION
from ...mesh import Mesh
from ...models import stateless
from ...optim import init_states
from ...replicas import fingerprint
from ..sums.fixed_sums import FixedSums, leaf
from .group_stages import sequence_stage
from .mesh_deterministic import MeshDeterministic, PiecePass
from .mesh_parallel import MeshParallel
from ..pipeline.pipeline_pass import piece_actions
from ..pipeline.schedules import check_micro, check_name, run_order
from ..context.sequence_pieces import Lanes
from ..tensor.tensor_sums import place
from ..tensor.tensor_pieces import cut, join, names, pieced, tree_reduce


class MeshLanes(MeshDeterministic):
    """dp x pp x cp on len(ctx) = D P C contexts: stage s of replica r on ctx[mesh.rank(dp=r, pp=s,
    cp=c)], c = 0..C-1, holding lanes c K/C .. (c+1) K/C - 1 (see the module docstring). stages,
    micro_batches, schedule, virtual_stages: as MeshParallel's; attention: ring or ulysses; pieces: K;
    sums: the policy (FixedSums, its tensor_pieces 1)."""

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, stages=2, context_parallel=2, micro_batches=1,
                 schedule="1f1b", virtual_stages=1, attention="ring", pieces=SEQUENCE_PIECES, sums=None, model=None):
        net = self.net = stateless(model, "--deterministic --mode mesh")
        self.sums = sums or FixedSums()
        S, V, C, K, n = stages, virtual_stages, context_parallel, pieces, len(ctx)
        if attention not in ATTENTION:
            raise ValueError(f"unknown attention {attention!r}: choose from {', '.join(ATTENTION)}")
        why = net.sequence_refusal(C, attention) or (f"{K} sequence pieces exceed the {net.tokens} tokens"
                                                     if K > net.tokens else None)
        if why or n % (S * C) or K % C or self.sums.tensor_pieces != 1:
            raise ValueError(why or ("--tensor-pieces with cp in a pipeline: not yet" if self.sums.tensor_pieces != 1
                                     else f"pp={S} x cp={C} must divide the {n} contexts and cp={C} the {K} "
                                          f"sequence pieces"))
        check_name(schedule, S, max(micro_batches, 1), V)
        check_micro(schedule, S, micro_batches)
        if schedule == "zb-h1" or S * V > len(net.layers):
            raise ValueError("zb-h1 with cp: not yet (gpipe, 1f1b or interleaved)" if schedule == "zb-h1" else
                             f"{S} stages x {V} virtual stages need {S * V} layers; {net.name} has {len(net.layers)}")
        self.mesh = Mesh(dp=n // (S * C), pp=S, cp=C, tp=1)
        self.ctx, self.optimizer, self.S, self.V, self.K, self.Q, self.k = list(ctx), optimizer, S, V, K, 1, 1
        self.C, self.G, self.sequence_parallel, self.T = C, C, False, K        # T: a stage's copies, one a lane
        self.micro_batches, self.schedule, self.cuts = micro_batches, schedule, net.cuts(S * V)
        slices, split = net.slices(), [p.split for p in net.param_table()]
        self.own = [slice(slices[ids[0]].start, slices[ids[-1]].stop) for ids in self.cuts]
        self.splits = [split[sl] for sl in self.own]
        self.lanes = [[Lanes(net.tokens, K, [self.ctx[self.mesh.rank(dp=r, pp=k % S, cp=c)] for c in range(C)],
                             attention) for k in range(S * V)] for r in range(self.mesh.dp)]
        self.groups = [[lanes.where for lanes in row] for row in self.lanes]          # groups[r][k][lane]
        self.runs = [[self.stage(ids, lanes, s) for ids, lanes, s in zip(self.cuts, row, self.splits)]
                     for row in self.lanes]
        values = [p.asnumpy() for p in params]
        self.params = [[[place(cut(values[sl], s, 1, 1, 0), c) for c in group]
                        for sl, s, group in zip(self.own, self.splits, row)] for row in self.groups]
        self.states = [[[init_states(P, optimizer) for P in stage] for stage in row] for row in self.params]
        self.t, self.held, self.bubbles = 0, None, []

    def stage(self, ids, lanes, split):
        """The function (hs, P, F) of the layers `ids` on `lanes`, P[b] lane b's copy (cut's layout)."""
        run = sequence_stage(self.net, ids, lanes)
        return lambda hs, P, F=nd: run(hs, [pieced(Pb, split, 1)[0] for Pb in P], F)

    def run_replica(self, r, X, y, parts, first, leaves):
        """Replica r's pieces on the schedule, each lane backpropagating 1/K of the loss; a stage's
        leaf of a piece the lanes' tree sum of their gradients (then lane 0's loss and count)."""
        row, Xs, ys, p, ends = self.replica_pieces(r, X, y, parts)

        def collect(k, q, per_lane):
            n, lanes = len(self.params[r][k][0]), self.lanes[r][k]
            total = tree_reduce([leaf(arrays[:n]) for arrays in per_lane], lanes.row, lanes.k)
            value = leaf([total] + [a.as_in_context(total.context) for a in per_lane[0][n:]])
            for j in range(self.K):
                leaves[k][j][first + q] = value
        run = PiecePass(Xs, ys, self.params[r], row, self.runs[r], 1 / self.K, [self.net.noisy(nd, X) for X in Xs],
                        collect=collect)
        run.run(piece_actions(run_order(p), [range(a, b) for a, b in zip(ends, ends[1:])]))

    def reduced_grads(self):
        """The tree's gradient of every parameter, in the model's order (lane 0's copy)."""
        def arrays(total, P):
            at = [0] + list(np.cumsum([p.size for p in P]))
            return [total[a:b].reshape(p.shape) for a, b, p in zip(at, at[1:], P)]
        return self.whole([[arrays(held_k[0], stage[0])] for held_k, stage in zip(self.held, self.params[0])])

    def fingerprints(self):
        """Every lane's copy of every stage, in every replica: all equal."""
        all_names = self.net.names()
        return {f"stage {k}": [fingerprint(c, P, names(all_names[sl], s, 1, 1, 0))
                               for row, Pr in zip(self.groups, self.params) for c, P in zip(row[k], Pr[k])]
                for k, (sl, s) in enumerate(zip(self.own, self.splits))}

    def layout(self, batch_size):
        """As MeshParallel prices a context-parallel stage, its C contexts (not its K lanes)."""
        lanes, self.groups = self.groups, [[group.row for group in row] for row in self.lanes]
        try:
            return MeshParallel.layout(self, batch_size)
        finally:
            self.groups = lanes

    def state_dict(self):
        """Lane 0's copies in replica 0: the whole parameters and optimiser state, in the model's order."""
        params, slots = [], len(self.states[0][0][0][0])
        per_slot = [[] for _ in range(slots)]
        for s, stage, stage_states in zip(self.splits, self.params[0], self.states[0]):
            params += join([[p.asnumpy() for p in stage[0]]], s, 1)
            for i in range(slots):
                per_slot[i] += join([[st[i].asnumpy() for st in stage_states[0]]], s, 1)
        return {"params": params, "opt_state": [[v[g] for v in per_slot] for g in range(len(params))],
                "t": self.t, "extra": {}}

    def load_state_dict(self, state):
        mine = self.state_dict()
        if [np.shape(v) for v in state["params"]] != [np.shape(v) for v in mine["params"]] or \
                [len(s) for s in state["opt_state"]] != [len(s) for s in mine["opt_state"]]:
            raise CheckpointError("the checkpoint's parameters or optimiser state do not fit this run")
        for row, row_states in zip(self.params, self.states):
            for sl, s, stage, stage_states in zip(self.own, self.splits, row, row_states):
                values = cut(state["params"][sl], s, 1, 1, 0)
                slots = [cut([o[i] for o in state["opt_state"][sl]], s, 1, 1, 0) for i in range(len(mine["opt_state"][0]))]
                for P, S in zip(stage, stage_states):
                    for p, v in zip(P, values):
                        p[:] = nd.array(v, ctx=p.context)
                    for i, vs in enumerate(slots):
                        for st, v in zip(S, vs):
                            st[i][:] = nd.array(v, ctx=st[i].context)
        self.t = state["t"]
