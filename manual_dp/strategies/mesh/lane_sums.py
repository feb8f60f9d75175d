"""--deterministic --mode mesh with cp > 1: MeshParallel(..., context_parallel=C, sums=FixedSums,
sequence_pieces=K), data x pipeline x context parallelism with the bits of one context's
--deterministic step given the same --sequence-pieces K, for any pp, any C dividing K (C = 1 too, K
given), any schedule of mesh_sums.py, and any number of processes.

It is mesh_sums.py's FixedMesh (whole batch pieces on the schedule, every stage's gradients of a
piece one leaf of FixedSums' tree) whose stages run on lanes instead of tensor pieces: a stage's
group is its K lanes (strategies/context/sequence_pieces.py), K/C on each of the stage's C contexts,
each lane with its own copy of the stage's parameters; a stage runs its layers' sequence_forward
over the lanes (group_stages.sequence_stage: attention folded in one order, the pooling added in
the lanes' tree), sends each lane's activations to the same lane of the next stage, and each lane
backpropagates 1/K of the (same) loss. A stage's leaf of a batch piece is the tree's sum over the
lanes of the copies' gradients (tree_reduce: each context its whole subtrees, the first the rest),
then lane 0's loss and count on the last stage: the slice of ContextParallel's --deterministic leaf
that the stage's parameters own.

Every lane keeps its own copy of its stage's parameters and optimiser state (K/C a context: each
copy gets the same total and the same elementwise update), and the tree over the batch is taken
once per lane (K times the same sums, keys "mesh{k}.{lane}-"): simple, not frugal. Checkpoints,
fingerprints and the memory layout read lane 0's copy (FixedMesh's with T = 1, Q = 1).
"""
from ...config import SEQUENCE_PIECES
from ...fast.attention import ATTENTION
from ...mesh import Mesh
from ...models import stateless
from ..sums.fixed_sums import leaf
from .group_stages import check_schedule
from .mesh_sums import FixedMesh
from ..context.sequence_pieces import Lanes
from ..tensor.tensor_pieces import tree_reduce


class FixedLanes(FixedMesh):
    """FixedMesh whose stages run on lanes: dp x pp x cp on len(ctx) = D S C contexts, stage s of
    replica r on ctx[mesh.rank(dp=r, pp=s, cp=c)], c = 0..C-1, holding lanes c K/C .. (c+1) K/C - 1
    (see the module docstring); groups[r][k][lane] the lane's context, lanes[r][k] the stage's Lanes."""

    def hold_sums(self, params, ctx, optimizer, S, T, C, micro_batches, schedule, V, attention, K, model,
                  sequence_parallel, zero_stage):
        """MeshParallel's __init__ under sums: stages of K lanes where C > 1 or K is given (hold_lanes; K
        None: SEQUENCE_PIECES), else tensor groups of pieces (hold_pieces); ValueError for what neither runs."""
        lanes = C > 1 or K is not None
        if sequence_parallel or zero_stage or lanes and T > 1:
            raise ValueError("with sums (--deterministic): dp x pp x tp or dp x pp x cp only, not cp (or "
                             "sequence_pieces) with tp, sequence_parallel or zero_stage")
        if lanes:
            self.hold_lanes(params, ctx, optimizer, S, C, micro_batches, schedule, V, attention, K or SEQUENCE_PIECES,
                            model)
        else:
            self.hold_pieces(params, ctx, optimizer, S, T, micro_batches, schedule, V, model)

    def hold_lanes(self, params, ctx, optimizer, S, C, micro_batches, schedule, V, attention, K, model):
        """The stages' lanes and every lane's copy of its stage; ValueError where the degrees do not
        divide, the model or schedule cannot run, or the policy cuts the split layers (Q > 1)."""
        net = self.net = stateless(model, "--deterministic --mode mesh")
        n = len(ctx)
        if attention not in ATTENTION:
            raise ValueError(f"unknown attention {attention!r}: choose from {', '.join(ATTENTION)}")
        why = net.sequence_refusal(C, attention) or (f"{K} sequence pieces exceed the {net.tokens} tokens"
                                                     if K > net.tokens else None)
        if why or n % (S * C) or K % C or self.sums.tensor_pieces != 1:
            raise ValueError(why or ("--tensor-pieces with cp in a pipeline: not yet" if self.sums.tensor_pieces != 1
                                     else f"pp={S} x cp={C} must divide the {n} contexts and cp={C} the {K} "
                                          f"sequence pieces"))
        check_schedule(net, schedule, S, micro_batches, V, "cp")
        self.mesh = Mesh(dp=n // (S * C), pp=S, cp=C, tp=1)
        self.C, self.T, self.G, self.Q, self.k, self.K = C, 1, C, 1, 1, K   # G: a stage's contexts, not its lanes
        self.lanes = [[Lanes(net.tokens, K, [ctx[self.mesh.rank(dp=r, pp=k % S, cp=c)] for c in range(C)],
                             attention, net.causal) for k in range(S * V)] for r in range(self.mesh.dp)]
        self.hold_stages(params, ctx, optimizer, S, V, micro_batches, schedule,
                         [[lanes.where for lanes in row] for row in self.lanes])

    def lane_leaves(self, r, k, per_lane):
        """Replica r's stage k's leaf of a piece, the same for every lane: the lanes' tree sum of their
        gradients (per_lane[b]: lane b's, the last stage's then loss and count), then lane 0's loss and
        count."""
        n, lanes = len(self.params[r][k][0]), self.lanes[r][k]
        total = tree_reduce([leaf(arrays[:n]) for arrays in per_lane], lanes.row, lanes.k)
        return [leaf([total] + [a.as_in_context(total.context) for a in per_lane[0][n:]])] * self.K
