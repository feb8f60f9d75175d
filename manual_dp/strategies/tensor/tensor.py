"""Tensor parallelism (Megatron-LM style): every layer's weights split over the T contexts of a
tensor group, joined by the conjugate operators f and g (manual_dp.fast.tensor_ops); groups of T
contexts are data parallel to each other.

The model says how it splits (models.contract: each Param's split axis, and Model.split_forward
with f and g handed in); this strategy cuts the parameters, keeps the shards, joins them with f
and g and sums each shard's gradient over the groups. A transformer block is two pairs: attention
(q, k, v by heads, column-parallel; the output projection row-parallel, its bias added after g)
and the MLP (column then row); layer norms, the embedding and the head stay whole.

LeNet as two Megatron blocks, each a column-parallel layer followed by a row-parallel one:

    images (copied to every context of the group; they need no gradient, so no f)
    conv1   column-parallel: W1, b1 split by output channel     (B, c1/T, 13, 13) per context
    conv2   row-parallel:    W2 split by input channel, no bias (B, c2, 9, 9) partial sums
    g       all-reduce forward, identity backward; + b2 (whole on every context), ReLU, pool
    f       identity forward, all-reduce backward               (B, c2, 4, 4) on every context
    dense1  column-parallel: W3, b3 split by unit (column)      (B, hidden/T)
    dense2  row-parallel:    W4 split by input (row), no bias   (B, 10) partial sums
    g       then + b4: the same scores on every context

Why conv2 takes sharded input channels rather than an all-gather of conv1's channels: then only
f and g are needed, T need divide only c1 and the hidden units (20 and 128: T = 4 runs the lesson's
LeNet; splitting conv2's 50 outputs too would allow only T = 2), and an all-gather in front of an
output-split conv2 would need a reduce-scatter backward, not a slice (conv2's shards differ).

Every context computes the loss of the group's examples; the backward of all of them, through f
and g, gives each shard the gradient one device computes for its slice. b2 and b4 are whole on
every context (after g everything is replicated): their gradients agree, so do their updates.
"""
import numpy as np
from mxnet import autograd, nd

from ...config import FAST_STEP, SEQUENCE_PIECES, RunConfig
from ...errors import CheckpointError
from ...fast.collectives import make_allreduce
from ...fast.prefetch import host
from ...fast.tensor_ops import Join, SequenceJoin
from ...lesson import split_and_load
from ...models.contract import example_loss, count_correct
from ...models import as_model, stateless
from ...optim import apply_update_and_clear, init_states
from ...replicas import fingerprint
from ...models.batchnorm import Moments
from ..base import Strategy, placed
from ..running import RunningStats
from ..zero.dp_zero import DataShardedOptimizer, backward, gathered, peak
from .sequence_sums import FixedSequence
from .tensor_layout import (copies, even_split, grid_layout, group_layout, held_whole, shard, shard_of_whole,
                            unshard, whole_layout)

# The axis along which each of LeNet's 8 parameters is split; None: whole on every context.
SPLIT = [p.split for p in as_model(None).param_table()]    # W1, b1 | W2, b2 | W3, b3 | W4, b4: 0, 0, 1, None, 1, 0, 0, None
NAMES = as_model(None).names()


def group_forward(Xs, P, allreduce, net=None, join=None, moments=None):
    """Class scores (B, 10) on every context of a tensor group from its copies of the images Xs
    (B, 1, 28, 28) and its shards P[j] (the model's parameters cut by their Param.split); moments:
    a model with BatchNorm's Moments, one per context."""
    net = as_model(net, P[0] if net is None else None)
    return net.split_forward(Xs, P, join or Join(allreduce), moments=moments) if moments else \
        net.split_forward(Xs, P, join or Join(allreduce))


class TensorParallel(RunningStats, FixedSequence, Strategy):
    """len(ctx) // T data-parallel tensor groups; group r's shard j on ctx[r * T + j].

    A model with BatchNorm (a user's block: its BatchNorms sit outside the Dense pairs, on whole
    activations): every context of a group normalises the group's examples with their statistics
    (each context its own Moments; they are the same numbers), so a group is one data-parallel
    replica with per-context statistics, and the mean over every context is folded after the step.

    tp_allreduce joins the shards inside a group (f and g); allreduce_fn sums each shard's
    gradients over the groups (and, under a multi-process world, over the processes).

    sequence_parallel (Megatron-SP, SequenceJoin): between the split layers each context keeps
    only its block of tokens. A replicated parameter used there (layer norms, the biases added
    after g, the embedding) then sees only its context's tokens, so its gradient is summed over
    the group too; each context backpropagates 1/T of the loss, whose sum over the group (through
    unshard's all-gather, whose backward adds every context's gradient) is the one-context loss,
    so the replicated parameters after the gather (the head) also get 1/T each and sum to theirs.

    zero_stage 1: ZeRO over the data dimension (strategies/zero/dp_zero.py): each group's copy of a
    shard keeps the optimiser state of 1/D of it, in this process's contexts; 2: and 1/D of its
    summed gradient; 3: and 1/D of the shard itself between steps, gathered whole for a step's
    forward and backward, an evaluation or a checkpoint.

    sums: None, the sums above; or --deterministic's FixedSums (strategies/sums/fixed_sums.py): every
    split layer in its tensor_pieces Q (T dividing Q), each context its Q/T pieces, and every sum in a
    fixed tree (tensor_sums.py); with sequence_parallel the sequence in `sequence_pieces` lanes, K/T at
    home on each context (sequence_sums.py).
    """

    def __init__(self, params, ctx, optimizer=RunConfig.optimizer, tensor_parallel=None,
                 allreduce_fn=None, tp_allreduce=None, model=None, sequence_parallel=False, zero_stage=0,
                 sums=None, sequence_pieces=SEQUENCE_PIECES):
        self.sums, self.sequence_parallel = sums, sequence_parallel
        if sums and sequence_parallel:              # Megatron-SP's lanes, each lane's token-wise work at home
            self.hold_sequence(params, ctx, optimizer, tensor_parallel or len(ctx), sequence_pieces, model)
            return
        if sums:                                    # every split layer in the policy's pieces
            self.hold_tensor(params, ctx, optimizer, tensor_parallel or len(ctx), model)
            return
        self.ctx, self.optimizer = list(ctx), optimizer
        self.net = as_model(model, params)
        if sequence_parallel:
            self.net = stateless(self.net, "--sequence-parallel")
        T = self.T = tensor_parallel or len(self.ctx)
        self.split, self.join = [p.split for p in self.net.param_table()], None
        refusal = self.net.tensor_refusal(T)
        if len(self.ctx) % T or refusal:
            raise ValueError(f"tensor degree {T} does not divide {len(self.ctx)} contexts"
                             if len(self.ctx) % T else f"tensor degree {refusal}")
        self.allreduce_fn = allreduce_fn or make_allreduce(FAST_STEP["allreduce"])
        self.tp_allreduce = tp_allreduce or make_allreduce(FAST_STEP["allreduce"])
        self.keep_running(False, self.allreduce_fn)
        if sequence_parallel:
            why = self.net.sequence_refusal(T, None)
            if why:
                raise ValueError(f"--sequence-parallel: {why}")
            self.join = SequenceJoin(self.tp_allreduce, self.net.tokens, T)
        self.grid = [self.ctx[r:r + T] for r in range(0, len(self.ctx), T)]   # grid[group][shard]
        host_params = [p.asnumpy() for p in params]
        self.shards = [[placed([shard(v, a, j, T) for v, a in zip(host_params, self.split)], c)
                        for j, c in enumerate(row)] for row in self.grid]
        self.zero = DataShardedOptimizer([g for _, g in self.copy_groups()], optimizer, zero_stage) if zero_stage else None
        self.states = None if self.zero else [[init_states(P, optimizer) for P in row] for row in self.shards]
        self.t = 0

    def copy_groups(self):
        """[((j, i), arrays)]: the copies of shard j of parameter i whose gradients are summed, over
        the groups; under sequence parallelism a replicated parameter's over the groups and shards,
        keyed (None, i)."""
        out = []
        for i, axis in enumerate(self.split):
            if self.sequence_parallel and axis is None:
                out.append(((None, i), [P[j][i] for P in self.shards for j in range(self.T)]))
            else:
                out += [((j, i), [P[j][i] for P in self.shards]) for j in range(self.T)]
        return out

    @property
    def batch_places(self):
        """A tensor group a place (strategies/base.py)."""
        return len(self.grid)

    def backward(self, X, y):
        """Every group runs its shard of the batch through its T contexts; gradients add up."""
        if self.sums:
            return self.lane_backward(X, y) if self.sequence_parallel else self.piece_backward(X, y)
        heads, metrics, moments = [], [], []
        with gathered(self.zero):
            with autograd.record():
                for row, P, Xg, yg in zip(self.grid, self.shards, split_and_load(host(X), [r[0] for r in self.grid]),
                                          split_and_load(host(y), [r[0] for r in self.grid])):
                    ys = copies(yg, row)
                    mine = [self.moments(True) for _ in row] if self.running else None
                    moments += mine or []
                    scores = group_forward(copies(Xg, row), P, self.tp_allreduce, self.net, self.join, mine)
                    losses = [example_loss(s, yj).sum() for s, yj in zip(scores, ys)]
                    heads += [l * (1 / self.T) for l in losses] if self.sequence_parallel else losses
                    metrics.append((losses[0], count_correct(scores[0], ys[0])))
            backward(heads, [p for P_row in self.shards for P in P_row for p in P], self.zero)
        if self.running:
            self.fold_each_context(moments)
        return metrics

    def fold_each_context(self, moments):
        """Afterwards every context's running statistics took the mean of every context's batch
        statistics: moments, one a context in self.ctx's order (every group's contexts hold the
        same ones)."""
        self.fold_batch([[M.batch[i][0] for M in moments] for i in range(len(moments[0].batch))])

    def update(self, lr, n_examples):
        """Sum each shard's gradients over the groups, then one optimiser step on every context (under
        ZeRO: each copy steps its chunk, then the chunks are gathered; --deterministic: the tree's)."""
        if self.sums:
            return self.fixed_update(lr, n_examples)
        if self.zero:
            self.t += 1
            self.zero.step(lr, self.t, self.counted(n_examples))
            return
        for i, axis in enumerate(self.split):
            if self.sequence_parallel and axis is None:     # a block of tokens each: summed over the group too
                self.allreduce_fn([P[j][i].grad for P in self.shards for j in range(self.T)])
                continue
            for j in range(self.T):
                self.allreduce_fn([P[j][i].grad for P in self.shards])
        self.t += 1
        n_examples = self.counted(n_examples)
        for P_row, S_row in zip(self.shards, self.states):
            for P, S in zip(P_row, S_row):
                apply_update_and_clear(P, S, self.optimizer, lr, self.t, n_examples)

    def reduced_grads(self):
        """The first group's gradients, a split parameter's shards joined on the first context, a
        replicated one's once: the whole model's gradient in its order (under ZeRO, summed here:
        the update reduce-scatters them instead; --deterministic: the tree's)."""
        if self.sums:
            return self.fixed_grads()
        row, home = self.shards[0], self.grid[0][0]
        if self.zero:
            total = {key: self.zero.total(g, home) for g, (key, _) in enumerate(self.copy_groups())}
            return [total[(None, i)] if (None, i) in total else
                    nd.concat(*[total[(j, i)] for j in range(self.T)], dim=a) if a is not None and self.T > 1
                    else total[(0, i)] for i, a in enumerate(self.split)]
        return [nd.concat(*[P[i].grad.as_in_context(home) for P in row], dim=a) if a is not None and self.T > 1
                else row[0][i].grad for i, a in enumerate(self.split)]

    def correct(self, X, y):
        """Correct predictions on (X, y), sharded over the groups (idle ones if X is tiny)."""
        if self.sums:
            return self.lane_correct(X, y) if self.sequence_parallel else self.piece_correct(X, y)
        rows = self.grid[:min(len(self.grid), X.shape[0])]
        counts = []
        with gathered(self.zero):
            for row, P, Xg, yg in zip(rows, self.shards, split_and_load(X, [r[0] for r in rows]),
                                      split_and_load(y, [r[0] for r in rows])):
                mine = [Moments(False, [self.running[self.ctx.index(c)]]) for c in row] if self.running else None
                scores = group_forward(copies(Xg, row), P, self.tp_allreduce, self.net, self.join, mine)
                counts.append(count_correct(scores[0], yg).copyto(self.ctx[0]))
        return nd.add_n(*counts) if len(counts) > 1 else counts[0]

    def fingerprints(self):
        """Shard j of every group; and b2, b4, whole on every context (under ZeRO-3 gathered); and
        every context's running statistics."""
        if self.sums:
            return self.fixed_fingerprints()
        with gathered(self.zero):
            return {**self.fingerprints_of_wholes(), **self.running_fingerprints()}

    def fingerprints_of_wholes(self):
        names = self.net.names()
        groups = {f"tensor shard {j}": [fingerprint(row[j], P_row[j], names) for row, P_row in zip(self.grid, self.shards)]
                  for j in range(self.T)}
        whole = [i for i, a in enumerate(self.split) if a is None]
        groups["unsplit " + ", ".join(names[i] for i in whole)] = [
            fingerprint(c, [P[i] for i in whole], [names[i] for i in whole])
            for row, P_row in zip(self.grid, self.shards) for c, P in zip(row, P_row)]
        return groups

    def layout(self, batch_size):
        """Each context of a group holds activations for the group's examples, but only its own
        channels and units of the split layers: priced as 1/T of the group's examples each, and
        for the group's other examples what every context holds whole (held_whole: the images,
        what f and g join, the layers outside the split). --deterministic: 1/T of the group's examples
        each, nothing whole (an upper bound: a group holds one batch piece's activations at a time)."""
        if self.sums:
            return grid_layout(self.grids, len(self.net.layers), batch_size) if self.sequence_parallel else \
                group_layout(self.grid, self.T, batch_size)
        whole = held_whole(self.net, range(len(self.net.layers)), self.sequence_parallel)
        out = group_layout(self.grid, self.T, batch_size)
        for row, n in zip(self.grid, even_split(batch_size, len(self.grid))):
            out += whole_layout(row, n, whole)
        return out

    def arrays(self):
        if self.sums:
            return self.fixed_arrays()
        params = [p for P_row in self.shards for P in P_row for p in P] + (self.zero.param_arrays() if self.zero else [])
        states = self.zero.state_arrays() if self.zero else [s for S_row in self.states for S in S_row for st in S for s in st]
        return {"param": params, "grad": self.zero.grad_arrays() if self.zero else [p.grad for p in params],
                "state": states + self.running_arrays()}

    def peak_arrays(self):
        return peak(self.arrays(), self.zero)

    def first_states(self):
        """Group 0's optimiser state, S_row[j][i] a list per slot (under ZeRO, gathered whole)."""
        if not self.zero:
            return self.states[0]
        whole = {key: self.zero.whole_state(g) for g, (key, _) in enumerate(self.copy_groups())}
        return [[[nd.array(v) for v in (whole[(None, i)] if (None, i) in whole and j == 0 else
                                        shard_of_whole(whole, j, i, a, self.T))] for i, a in enumerate(self.split)]
                for j in range(self.T)]

    def state_dict(self):
        """Group 0's shards joined: the whole parameters and optimiser state, in the model's order."""
        if self.sums:
            return self.fixed_state_dict()
        P_row, S_row = self.shards[0], self.first_states()
        with gathered(self.zero):
            params = [unshard([P[i].asnumpy() for P in P_row], a) for i, a in enumerate(self.split)]
        opt_state = [[unshard([S[i][k].asnumpy() for S in S_row], a) for k in range(len(S_row[0][i]))]
                     for i, a in enumerate(self.split)]
        return {"params": params, "opt_state": opt_state, "t": self.t, "extra": self.running_state()}

    def load_state_dict(self, state):
        if self.sums:
            return self.fixed_load_state_dict(state)
        self.load_running(state)
        with gathered(self.zero, keep=True):
            self.load_wholes(state)

    def load_wholes(self, state):
        want = [tuple(s if a != k else s * self.T for k, s in enumerate(p.shape))
                for p, a in zip(self.shards[0][0], self.split)]
        got = [tuple(np.shape(v)) for v in state["params"]]
        if got != want or [len(s) for s in state["opt_state"]] != [len(s) for s in self.first_states()[0]]:
            raise CheckpointError(f"the checkpoint's parameters {got} or optimiser state do not fit "
                                  f"this run's {want}")
        for r, P_row in enumerate(self.shards):
            for j, P in enumerate(P_row):
                for i, a in enumerate(self.split):
                    P[i][:] = nd.array(shard(state["params"][i], a, j, self.T), ctx=P[i].context)
                    for s, v in zip(self.states[r][j][i] if not self.zero else (), state["opt_state"][i]):
                        s[:] = nd.array(shard(v, a, j, self.T), ctx=s.context)
        if self.zero:
            for g, ((j, i), _) in enumerate(self.copy_groups()):
                self.zero.load_state(g, [v if j is None else shard(v, self.split[i], j, self.T)
                                         for v in state["opt_state"][i]])
        self.t = state["t"]
