"""Data x pipeline x tensor parallelism at once (Megatron's "3-D parallelism"): the mesh dp x pp x tp
(manual_dp.mesh), each pipeline stage a tensor group; or dp x pp x cp, each stage a context-parallel
group (sequence_stage: the stage's layers' sequence_forward, ring or Ulysses attention between the
blocks, every parameter whole on each context and its gradient summed over the group too); or
dp x pp x cp x tp, each stage a C x T grid (grid_stage: each row a tensor group, each column a
context-parallel group, as ContextTensorParallel runs the whole model; tensor shard t of every
parameter summed over its column and the replicas).

Context (r, s, j) of the mesh holds tensor shard j of pipeline stage s of replica r. A stage is a
run of the model's layers (Model.cuts) computed on its tensor group the way TensorParallel computes
the whole model: each split layer's split_forward with Megatron's f and g (or, under
sequence_parallel, the all-gather and reduce-scatter of SequenceJoin), the other layers whole on
every context of the group. Between stages, context (r, s, j) sends its output to (r, s + 1, j),
and the gradient comes back the same way: each rank of a tensor group holds a full copy of what
is not split, so the copies pair up rank by rank. A stage's backward runs over its whole group in
one autograd call (f's and g's backward cross the group), so cutting the graph between stages
changes nothing: every rank receives the gradient the uncut graph gives it.

The schedule is any of manual_dp.strategies.pipeline.schedules with an unsplit backward (gpipe, 1f1b,
interleaved: stage k on pipeline rank k % S). Gradients: each shard's summed over the replicas (and,
under sequence parallelism, a replicated parameter's over its tensor group too, as TensorParallel).

With --deterministic's FixedSums (`sums`) the batch is cut in pieces and every sum is the policy's
fixed tree, for the bits of one context's --deterministic step: dp x pp x tp with every split layer
in Q pieces (mesh_sums.py), or dp x pp x cp with the sequence in K lanes (lane_sums.py).
"""
from mxnet import nd

from ...config import FAST_STEP, RunConfig
from ...errors import CheckpointError
from ...fast.collectives import make_allreduce
from ...fast.tensor_ops import Join, SequenceJoin
from ...lesson import shard_sizes, split_and_load
from ...models.contract import count_correct
from ...mesh import Mesh
from ...models import stateless
from ...optim import apply_update_and_clear, init_states
from ...replicas import fingerprint
from ..base import Strategy, placed
from ..context.context import Sequence
from ..zero.dp_zero import DataShardedOptimizer, gathered, peak
from .group_stages import GroupPass, check_groups, check_schedule, group_runs
from .lane_sums import FixedLanes
from ..pipeline.pipeline_pass import cut
from ..pipeline.schedules import bubbles, held, plan, run_order, simulate
from ..tensor.tensor_layout import copies, even_split, held_whole, shard, whole_layout


class MeshParallel(FixedLanes, Strategy):
    """dp x pp x tp on len(ctx) = D * P * T contexts, context ctx[mesh.rank(dp=r, pp=s, tp=j)];
    with context_parallel C > 1, dp x pp x cp x tp (ctx[mesh.rank(dp=r, pp=s, cp=c, tp=t)], rank
    j = c T + t of its stage's group; T may be 1).

    stages P and tensor_parallel T; micro_batches, schedule and virtual_stages as PipelineParallel's;
    sequence_parallel: Megatron-SP inside every tensor group; attention: "ring" or "ulysses" between
    a context-parallel group's blocks. model: a network whose layers split on their own
    (Layer.split_forward) or cut the sequence (Layer.sequence_forward): the transformer;
    allreduce_fn sums over the replicas (and the groups, where every context holds a whole copy).
    self.G is the size of a stage's group, C T. sums: None, those sums; or --deterministic's FixedSums:
    every split layer in the policy's tensor_pieces (mesh_sums.py) or, with C > 1 or sequence_pieces
    given (T = 1), each stage's sequence in sequence_pieces lanes (default 4; lane_sums.py), all in
    fixed trees."""

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, stages=2, tensor_parallel=2, micro_batches=1,
                 schedule="1f1b", virtual_stages=1, allreduce_fn=None, tp_allreduce=None, model=None,
                 sequence_parallel=False, context_parallel=1, attention="ring", zero_stage=0, sums=None,
                 sequence_pieces=None):
        self.sums = sums
        if sums:                     # the policy's pieces and trees (lane_sums.py, mesh_sums.py)
            self.hold_sums(params, ctx, optimizer, stages, tensor_parallel, context_parallel, micro_batches, schedule,
                           virtual_stages, attention, sequence_pieces, model, sequence_parallel, zero_stage)
            return
        net = self.net = stateless(model, "--mesh with pp and tp or cp")
        C, T = self.C, self.T = context_parallel, tensor_parallel
        S, V, n, G = stages, virtual_stages, len(ctx), C * T
        check_groups(net, n, S, C, T, sequence_parallel, attention)
        check_schedule(net, schedule, S, micro_batches, V, "tp" if C == 1 else "cp")
        self.mesh = Mesh(dp=n // (S * G), pp=S, cp=C, tp=T)
        self.summed_in_group = sequence_parallel or C > 1     # whole parameters that see a block of tokens
        self.ctx, self.optimizer, self.S, self.G, self.V = list(ctx), optimizer, S, G, V
        self.micro_batches, self.schedule, self.sequence_parallel = micro_batches, schedule, sequence_parallel
        self.allreduce_fn = allreduce_fn or make_allreduce(FAST_STEP["allreduce"])
        tp_allreduce = tp_allreduce or make_allreduce(FAST_STEP["allreduce"])
        self.cuts = net.cuts(S * V)
        join = SequenceJoin(tp_allreduce, net.tokens, T) if sequence_parallel else Join(tp_allreduce)   # f and g
        seq = Sequence(net.tokens, C, attention, tp_allreduce, net.causal) if C > 1 else None   # between a group's blocks
        self.stages = group_runs(net, self.cuts, T, join, seq)
        slices = net.slices()
        self.own = [slice(slices[ids[0]].start, slices[ids[-1]].stop) for ids in self.cuts]   # params per stage
        self.split = [p.split if T > 1 else None for p in net.param_table()]
        # groups[r][k]: the group (tensor, context-parallel or grid) of replica r's stage k, rank c T + t
        self.groups = [[[self.ctx[self.mesh.rank(dp=r, pp=k % S, cp=j // T, tp=j % T)] for j in range(G)]
                        for k in range(S * V)] for r in range(self.mesh.dp)]
        values = [p.asnumpy() for p in params]
        self.params = [[[placed([shard(values[i], self.split[i], j % T, T) for i in range(sl.start, sl.stop)], c)
                         for j, c in enumerate(group)] for sl, group in zip(self.own, row)] for row in self.groups]
        self.zero = DataShardedOptimizer([g for _, g in self.copy_groups()], optimizer, zero_stage) if zero_stage else None
        self.states = None if self.zero else \
            [[[init_states(P, optimizer) for P in stage] for stage in row] for row in self.params]
        self.t, self.bubbles = 0, []

    def copy_groups(self):
        """[((k, t, i), arrays)]: the copies whose gradients are summed: tensor shard t of stage k's
        parameter i over the replicas and, under context parallelism, over the blocks (the group's
        column t); a whole parameter under sequence parallelism over the replicas and the group
        (keyed t = None)."""
        out = []
        for k, j, i, g in self.each_param():
            if j >= self.T:
                continue
            if self.C == 1 and self.summed_in_group and self.split[g] is None:
                if j == 0:
                    out.append(((k, None, i), [row[k][jj][i] for row in self.params for jj in range(self.G)]))
            else:
                out.append(((k, j, i), [row[k][c * self.T + j][i] for row in self.params for c in range(self.C)]))
        return out

    @property
    def batch_places(self):
        """A pipeline of stage groups a place (strategies/base.py)."""
        return self.mesh.dp

    def plan(self, n_examples):
        m = min(self.micro_batches, n_examples)
        if self.schedule == "interleaved" and m > self.S and m % self.S:
            m -= m % self.S
        return plan(self.schedule, self.S, m, self.V)

    def backward(self, X, y):
        """Every replica pipelines its shard of the batch over its stages' tensor groups."""
        if self.sums:
            return self.fixed_backward(X, y)
        metrics = []
        scale = 1 / (self.C if self.C > 1 else self.T) if self.summed_in_group else 1
        with gathered(self.zero):     # ZeRO-3: every stage whole on its contexts for the step's pass
            for row, P, Xr, yr in zip(self.groups, self.params, split_and_load(X, [g[0][0] for g in self.groups]),
                                      split_and_load(y, [g[-1][0] for g in self.groups])):
                p = self.plan(Xr.shape[0])
                self.bubbles.append(bubbles(p, simulate(p))[0])
                Xs = cut(Xr, p.n_micro)
                run = GroupPass(Xs, cut(yr, p.n_micro), P, row, self.stages, scale,
                                [self.net.noisy(nd, X) for X in Xs], self.zero)
                metrics.append(run.run(run_order(p)))
        return metrics

    def each_param(self):
        """(stage k, rank j, position i within the stage, model index) of every shard of replica 0."""
        for k, sl in enumerate(self.own):
            for j in range(self.G):
                for i, g in enumerate(range(sl.start, sl.stop)):
                    yield k, j, i, g

    def update(self, lr, n_examples):
        """Each shard's gradient summed over the replicas (a replicated one's, under sequence or
        context parallelism, over its group too); one optimiser step on every context (under ZeRO,
        over the data dimension: each copy steps its chunk, then the chunks are gathered; under
        --deterministic the tree's totals)."""
        if self.sums:
            return self.fixed_update(lr, n_examples)
        if self.zero:
            self.t += 1
            self.zero.step(lr, self.t, self.counted(n_examples))
            return
        for _, arrays in self.copy_groups():
            self.allreduce_fn([a.grad for a in arrays])
        self.t += 1
        n_examples = self.counted(n_examples)
        for row, row_states in zip(self.params, self.states):
            for stage, stage_states in zip(row, row_states):
                for P, S in zip(stage, stage_states):
                    apply_update_and_clear(P, S, self.optimizer, lr, self.t, n_examples)

    def whole(self, get):
        """Replica 0's shards joined, in the model's order: get(k, j, i) is the NDArray of stage k's
        parameter i on tensor rank j."""
        out = []
        for k, sl in enumerate(self.own):
            for i, g in enumerate(range(sl.start, sl.stop)):
                pieces = [get(k, j, i) for j in range(self.T)]
                a = self.split[g]
                home = pieces[0].context
                out.append(nd.concat(*[x.as_in_context(home) for x in pieces], dim=a)
                           if a is not None and self.T > 1 else pieces[0])
        return out

    def reduced_grads(self):
        """The whole summed gradient in the model's order (under ZeRO summed here: the update
        reduce-scatters it instead; --deterministic: the tree's)."""
        if self.sums:
            return self.fixed_grads()
        if not self.zero:
            return self.whole(lambda k, j, i: self.params[0][k][j][i].grad)
        total = {key: self.zero.total(n, self.ctx[0]) for n, (key, _) in enumerate(self.copy_groups())}
        return self.whole(lambda k, j, i: total.get((k, j, i), total.get((k, None, i))))

    def end_epoch(self, lr):
        stats = {"bubble_fraction": sum(self.bubbles) / len(self.bubbles)} if self.bubbles else {}
        self.bubbles = []
        return stats

    def correct(self, X, y):
        if self.sums:
            return self.fixed_correct(X, y)
        rows = self.groups[:min(len(self.groups), X.shape[0])]
        counts = []
        with gathered(self.zero):
            for row, P, Xr, yr in zip(rows, self.params, split_and_load(X, [g[0][0] for g in rows]),
                                      split_and_load(y, [g[-1][0] for g in rows])):
                hs = copies(Xr, row[0])
                for k, (stage, group) in enumerate(zip(self.stages, row)):
                    hs = stage(hs if k == 0 else [h.copyto(c) for h, c in zip(hs, group)], P[k])
                counts.append(count_correct(hs[0], yr).copyto(self.ctx[0]))
        return nd.add_n(*counts) if len(counts) > 1 else counts[0]

    def fingerprints(self):
        if self.sums:
            return self.fixed_fingerprints()
        names = self.net.names()
        with gathered(self.zero):
            return {f"stage {k} shard {j}": [fingerprint(row[k][j], P[k][j], names[sl])
                                             for row, P in zip(self.groups, self.params)]
                    for k, sl in enumerate(self.own) for j in range(self.G)}

    def layout(self, batch_size):
        """Each context: its stage's activations for the examples the schedule holds there
        (schedules.held), priced as TensorParallel prices a group's: 1/T of them each, and for
        the others what every rank of the stage's group holds whole (tensor.held_whole of the
        stage's layers); a context-parallel group or grid, 1/(C T) of them each and the images
        whole on the first stage (a floor, as ContextTensorParallel's). --deterministic: the same (an
        upper bound: a stage holds one piece's activations per micro-batch in flight), a stage of
        lanes priced on its C contexts, not its K lanes."""
        out, groups = [], [[lanes.row for lanes in row] for row in self.lanes] if self.lanes else self.groups
        for row, n in zip(groups, shard_sizes(batch_size, len(groups))):
            p = self.plan(n)
            kept = held(p, shard_sizes(n, p.n_micro), per="stage")
            for group, pieces, h in zip(row, self.cuts, kept):
                out += [(c, pieces, e) for c, e in zip(group, even_split(h, self.G))]
                if self.C == 1:
                    out += whole_layout(group, h, held_whole(self.net, pieces, self.sequence_parallel))
                elif pieces[0] == 0:                   # the images, copied whole to every context
                    out += whole_layout(group, h, self.net.layers[0].inputs)
        return out

    def arrays(self):
        params = [p for row in self.params for stage in row for P in stage for p in P] + \
            (self.zero.param_arrays() if self.zero else [])
        state = self.zero.state_arrays() if self.zero else \
            [s for row in self.states for stage in row for S in stage for st in S for s in st]
        return {"param": params, "grad": self.zero.grad_arrays() if self.zero else [p.grad for p in params],
                "state": state}

    def peak_arrays(self):
        return peak(self.arrays(), self.zero)

    def first_state(self):
        """get(k, j, i, slot): replica 0's optimiser state of stage k's parameter i on rank j (under
        ZeRO gathered whole from the chunks, on the host), and the number of slots."""
        if not self.zero:
            return (lambda k, j, i, s: self.states[0][k][j][i][s]), len(self.states[0][0][0][0])
        whole = {key: self.zero.whole_state(n) for n, (key, _) in enumerate(self.copy_groups())}

        def get(k, j, i, s):
            if (k, j, i) in whole:
                return nd.array(whole[(k, j, i)][s])
            return nd.array(shard(whole[(k, None, i)][s], self.split[self.own[k].start + i], j, self.T))
        return get, len(next(iter(whole.values()))) if whole else 0

    def state_dict(self):
        """Replica 0's shards joined: the whole parameters and optimiser state, in the model's order."""
        if self.sums:
            return self.fixed_state_dict()
        with gathered(self.zero):
            params = [a.asnumpy() for a in self.whole(lambda k, j, i: self.params[0][k][j][i])]
        get, slots = self.first_state()
        opt = [[a.asnumpy() for a in self.whole(lambda k, j, i, s=s: get(k, j, i, s))] for s in range(slots)]
        return {"params": params, "opt_state": [[o[g] for o in opt] for g in range(len(params))],
                "t": self.t, "extra": {}}

    def load_state_dict(self, state):
        if self.sums:
            return self.fixed_load_state_dict(state)
        with gathered(self.zero, keep=True):
            self.load_wholes(state)

    def load_wholes(self, state):
        want = len(self.split)
        if len(state["params"]) != want:
            raise CheckpointError(f"the checkpoint holds {len(state['params'])} parameters, this model {want}")
        for row, row_states in zip(self.params, self.states or [None] * len(self.params)):
            for k, sl in enumerate(self.own):
                for j in range(self.G):
                    for i, g in enumerate(range(sl.start, sl.stop)):
                        p = row[k][j][i]
                        value = shard(state["params"][g], self.split[g], j % self.T, self.T)
                        if tuple(value.shape) != p.shape:
                            raise CheckpointError(f"the checkpoint's {self.net.names()[g]} does not fit this run")
                        p[:] = nd.array(value, ctx=p.context)
                        for s, v in zip(row_states[k][j][i] if row_states else (), state["opt_state"][g]):
                            s[:] = nd.array(shard(v, self.split[g], j % self.T, self.T), ctx=s.context)
        if self.zero:
            for n, ((k, j, i), _) in enumerate(self.copy_groups()):
                g = self.own[k].start + i
                self.zero.load_state(n, [v if j is None else shard(v, self.split[g], j, self.T)
                                         for v in state["opt_state"][g]])
        self.t = state["t"]


